"""Trainer: the custom train loop for Keras 3 models under any strategy.

A small controller over runners (`runner.py`): it checks its arguments,
picks the runner, restores, and runs the runner's loops under the
`controller.Controller` with what every way of training shares (actions,
callbacks, history, non-finite checks)."""

from __future__ import annotations

import functools
import time

import keras

from tfmulti import cluster as cluster_lib
from tfmulti import parameter_server, peer_failure, strategies
from tfmulti.training import actions as actions_lib
from tfmulti.training import agreement
from tfmulti.training import async_trainer, balancing
from tfmulti.training import controller as controller_lib
from tfmulti.training import history as history_lib
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import numerics, preemption, shard_placement
from tfmulti.training import reducers, resume
from tfmulti.training import runner as runner_lib
from tfmulti.training import step as step_lib
from tfmulti.training import synchronous
from tfmulti.training import trainer_args as args_lib
from tfmulti.training import xla as xla_lib


class Trainer:
    """Trains a Keras 3 model with an explicit, correct distributed step.

    Args:
      model: a Keras model whose variables were created under `strategy`;
        or a `tfmulti.pipeline.PipelinedModel` (then pass no optimizer, loss
        or strategy: the pipeline has its own; see `tfmulti/pipeline/
        runner.py`).
      optimizer: a Keras optimizer created under `strategy`; the Trainer
        builds it and replaces its own cross-replica reduction.
      loss: `loss(y_true, y_pred)` returning PER-EXAMPLE losses (a Keras
        loss with `reduction=None`).
      strategy: the strategy; default: the one in scope, else the one the
        model's variables belong to.
      metrics: Keras metrics (instances or names) for training and eval.
      grad_accum_steps: K micro-batches per update (one all-reduce each).
      clip_global_norm: clip the REDUCED gradient to this global norm.
      allreduce_dtype: None, "float16" or "bfloat16" on the wire.
      steps_per_loop: steps per `tf.function` call (and per progress line).
      mixed_precision: None (follow the model's dtype policy),
        "mixed_float16" (adds dynamic loss scaling) or "mixed_bfloat16"; must
        match the policy the model was built with.
      model_dir: where checkpoints and TensorBoard scalars go; `fit` resumes
        from the latest checkpoint here.
      on_nonfinite: "raise" (NonFiniteLossError naming the step, before any
        checkpoint of the weights) or "skip" (skip that update on every
        replica; see `numerics.skipping_optimizer`).
      sync: None (synchronous) or `tfmulti.LocalSGD(every=H, ...)`: workers
        synchronise every H updates (checkpoints only at those points).
      compression: None or `tfmulti.PowerSGD(rank=r)` for the gradient
        all-reduce.
      jit_compile: compile each replica's forward and backward with XLA
        (`tfmulti.training.xla`); an op XLA cannot compile raises
        `XlaCompileError` naming its layer at the first step.
      async_warmup_steps: under ParameterServerStrategy only: the first W
        asynchronous updates are scaled by k/W (a linear warm-up of the
        learning rate on top of the optimizer's own); None: 100
        (`async_trainer.DEFAULT_WARMUP_STEPS`); 0: none.
      balance: None (an even split), "auto" (each replica's share of the
        global batch follows its measured speed, updated between loops) or
        a list of weights, one per replica or per worker (fixed shares);
        the updates are those of the even split (`tfmulti.balance`).
      shard_optimizer_state: the ZeRO stage over a MirroredStrategy's
        replicas (`optimizer_sharding`): True or 1, each replica keeps the
        optimizer state of 1/N of the parameters; 2, also only its 1/N of
        the reduced gradient (reduce-scattered, not all-reduced). The
        updates are the unsharded optimizer's; checkpoints stay unsharded
        (kept in host memory, once per worker), so a run resumes sharded
        or not on any number of replicas. Pass an unbuilt, element-wise
        Keras optimizer (SGD, Adam, AdamW, RMSprop, ...).
    """

    def __init__(self, model, optimizer=None, *, loss=None, strategy=None,
                 metrics=(), grad_accum_steps=1, clip_global_norm=None,
                 allreduce_dtype=None, steps_per_loop=100,
                 mixed_precision=None, model_dir=None,
                 on_nonfinite="raise", sync=None, compression=None,
                 jit_compile=False, async_warmup_steps=None, balance=None,
                 shard_optimizer_state=False):
        # A PipelinedModel brings its own step (a part the synchronous
        # runner plugs in); the rest of fit is shared.
        pipeline = runner_lib.model_runner(
            model, optimizer=optimizer, loss=loss, strategy=strategy,
            grad_accum_steps=grad_accum_steps, sync=sync,
            clip_global_norm=clip_global_norm, compression=compression,
            allreduce_dtype=allreduce_dtype, mixed_precision=mixed_precision,
            on_nonfinite=on_nonfinite, jit_compile=jit_compile)
        if pipeline is not None:
            model, optimizer = pipeline.model, pipeline.optimizer
            loss = pipeline.pipe.loss
        args_lib.check_optimizer_and_loss(optimizer, loss)
        options = step_lib.GradientOptions(
            grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype)
        reducers.check_options(sync, compression,
                               allreduce_dtype=allreduce_dtype)
        self.strategy = args_lib.resolve_strategy(strategy, model)
        asynchronous = parameter_server.is_parameter_server(self.strategy)
        args_lib.check_reduction(sync, compression, asynchronous=asynchronous)
        self._steps_per_loop = args_lib.positive_int(
            "steps_per_loop", steps_per_loop,
            "It is how many steps run inside one tf.function call.")
        warmup = args_lib.async_warmup_steps(async_warmup_steps,
                                             self.strategy)
        sharded = args_lib.check_sharding(
            shard_optimizer_state, strategy=self.strategy,
            optimizer=optimizer, pipelined=pipeline is not None, sync=sync,
            compression=compression)
        if pipeline is None:
            strategies.check_created_in_scope(self.strategy, model,
                                              optimizer)
        self.model = model
        self.model_dir = model_dir
        self.mixed_precision = args_lib.check_precision(mixed_precision,
                                                        model)
        self._on_nonfinite = numerics.check_on_nonfinite(on_nonfinite)
        jit_compile = xla_lib.check_jit_compile(jit_compile)
        optimizer = numerics.guarded_optimizer(
            optimizer, model.trainable_variables, strategy=self.strategy,
            mixed_precision=self.mixed_precision, on_nonfinite=on_nonfinite,
            build_scope=shard_placement.host_variables(self.strategy)
            if sharded else None)
        with self.strategy.scope():
            self.metrics = [args_lib.resolve_metric(m, self.strategy)
                            for m in metrics]
            eval_loss = keras.metrics.Mean(name="loss")
        gradients_lib.disable_optimizer_reduction(optimizer)
        self.optimizer = optimizer
        # Updates made; restored from the checkpoint's position. A host int:
        # a mirrored variable would cost a device round trip every loop.
        self._steps_done = 0
        self._options = options
        parts = runner_lib.Parts(
            strategy=self.strategy, model=model, optimizer=optimizer,
            loss=loss, metrics=self.metrics, eval_loss=eval_loss,
            options=options, on_nonfinite=on_nonfinite, say=self._print)
        self._reducer = reducers.make_reducer(
            self.strategy, model.trainable_variables, sync=sync,
            compression=compression, allreduce_dtype=allreduce_dtype,
            communication_options=strategies.communication_options(
                self.strategy))
        balancer = balancing.for_trainer(
            self.strategy, balance, pipelined=pipeline is not None,
            asynchronous=asynchronous, jit_compile=jit_compile)
        runner_options = dict(reducer=self._reducer, balancer=balancer,
                              steps_per_loop=self._steps_per_loop,
                              jit_compile=jit_compile)
        if asynchronous:
            self.runner = async_trainer.AsyncRunner(
                parts, model_dir=model_dir, warmup_steps=warmup)
        elif pipeline is not None:
            self.runner = pipeline.trainer_runner(parts, **runner_options)
        else:
            self.runner = synchronous.SynchronousRunner(
                parts, shard_optimizer_state=sharded, **runner_options)

    @property
    def step(self) -> int:
        """Optimizer updates made so far (restored with a checkpoint)."""
        return self._steps_done

    @property
    def balance_history(self) -> list[dict] | None:
        """With `balance`: per loop of the last `fit`, the step, each
        replica's example count and compute seconds per step, and the
        barrier idle fraction; else None."""
        balancer = self.runner.balancer
        return None if balancer is None else list(balancer.shares_history)

    @property
    def communication(self) -> dict:
        """All-reduce calls and payload bytes this worker issued so far, in
        total and between workers (`communication.TRAFFIC_KEYS`)."""
        return self._reducer.traffic.result()

    # -- training ---------------------------------------------------------

    def _position(self, step, batch, *, loss_finite=True):
        return resume.position(self.strategy, step, batch,
                               self._options.grad_accum_steps,
                               loss_finite=loss_finite)

    def _restore(self, batch, verbose):
        checkpointer, position = resume.restore_runner(
            self.runner, self.model_dir, self.strategy, batch=batch,
            batches_per_step=self._options.grad_accum_steps,
            say=self._print if verbose else None)
        if position is not None:
            self._steps_done = position.step
        return checkpointer

    @peer_failure.translating
    @preemption.watching_preemption
    def fit(self, train_data, *, steps, eval_data=None, eval_every=None,
            callbacks=(), global_batch_size=None, checkpoint_every=None,
            actions=(), verbose=1):
        """Trains until the optimizer has made `steps` updates in total.

        With `model_dir`, first restores the newest intact checkpoint there
        (model, optimizer and position; the data iterator where it is
        trackable; a distributed iterator is not, so a fresh one is advanced
        past the examples the restored updates used), so a resumed job
        finishes the remaining updates, also on another number of replicas
        or workers at the same global batch.

        Args:
          train_data: a distributed dataset or iterator of per-replica
            `(x, y)` (or `(x, y, sample_weight)`) batches; a `tf.data.Dataset`
            of global batches; or an unbatched `dataset_fn(input_context)`
            with `global_batch_size`, fed through `tfmulti.distribute_dataset`
            (training mode). Reused across `fit` calls with the same object,
            continuing where the last call stopped.
          steps: total number of updates to reach.
          eval_data: evaluated every `eval_every` steps and at the end.
          eval_every: steps between evaluations; default: only at the end.
          callbacks: Keras callbacks; batch hooks run once per loop, with
            the step as the batch index; `model.stop_training = True` stops.
          global_batch_size: the batch summed over replicas (one
            micro-batch); default: from the data's static shape.
          checkpoint_every: steps between checkpoints (with `model_dir`);
            default: at each evaluation and at the end.
          actions: more `controller.Action`s (e.g. `controller.
            PeriodicAction(fn, every_steps=N)`), run after the built-in ones
            when due.
          verbose: 0 silent, 1 one line per loop (chief only).

        Returns:
          History dict: per loop `step`, `loss` (mean over the loop), each
          metric, `steps_per_sec`, `examples_per_sec`; `step_loss`, the loss
          of every step; per evaluation `val_step`, `val_loss`, `val_<metric>`.
        """
        args_lib.check_fit(steps=steps, global_batch_size=global_batch_size,
                           eval_every=eval_every, eval_data=eval_data,
                           checkpoint_every=checkpoint_every)
        runner = self.runner
        with runner.guard():
            batch = runner.begin(train_data, global_batch_size)
            checkpointer = self._restore(batch, verbose) if (
                self.model_dir) else None
            try:
                with runner.translating(steps=steps, step=lambda: self.step):
                    runner.prepare(step=self.step, steps=steps, batch=batch,
                                   verbose=verbose)
                    return self._train(steps, batch, checkpointer,
                                       eval_data=eval_data,
                                       eval_every=eval_every,
                                       callbacks=callbacks, actions=actions,
                                       checkpoint_every=checkpoint_every,
                                       verbose=verbose)
            finally:
                if checkpointer is not None:
                    checkpointer.close()

    def _train(self, steps, batch, checkpointer, *, eval_data, eval_every,
               callbacks, actions, checkpoint_every, verbose):
        runner = self.runner
        callback_list = keras.callbacks.CallbackList(list(callbacks),
                                                     model=self.model)
        self.model.stop_training = False
        history = history_lib.History(
            (*runner.history_keys, *[m.name for m in self.metrics]))
        on_nonfinite = numerics.mode_for(self.optimizer, self._on_nonfinite)
        skips_in_a_row = 0

        def train_loop(start, n):
            nonlocal skips_in_a_row
            callback_list.on_train_batch_begin(start)
            began = time.perf_counter()
            out = runner.run_loop(start, n)
            skipped = numerics.check_losses(
                out.losses, first_step=start, on_nonfinite=on_nonfinite,
                previous=history.step_losses, weights=runner.weight_check)
            elapsed = time.perf_counter() - began
            if out.applied is not None:
                skips_in_a_row = numerics.consecutive_skips(
                    skips_in_a_row, out.losses, applied=out.applied)
                numerics.check_consecutive_skips(
                    skips_in_a_row, step=start + n, optimizer=self.optimizer)
            self._steps_done = out.step
            logs = {"loss": float(out.losses.mean()), **out.logs}
            logs_and_speed = history.record(
                out, logs, n=n, elapsed=elapsed,
                examples_per_step=runner.examples_per_step)
            for line in ([f"skipped non-finite update(s) {skipped}"] if
                         skipped else []) + out.messages:
                self._print(line)
            callback_list.on_train_batch_end(start + n - 1, logs)
            return controller_lib.LoopResult(
                step=start + n, steps=steps, at_end=False, losses=out.losses,
                logs=logs_and_speed)

        loop_actions = actions_lib.fit_actions(
            strategy=self.strategy, model_dir=self.model_dir,
            optimizer=self.optimizer, say=self._print,
            evaluate=None if eval_data is None else (
                lambda: self.evaluate(eval_data)), callbacks=callback_list,
            history=history, eval_every=eval_every, actions=actions,
            checkpointer=checkpointer, checkpoint_every=checkpoint_every,
            position=lambda step, **kw: self._position(step, batch, **kw),
            verbose=verbose,
            preemption_watcher=runner.preemption(self._preemption))
        callback_list.on_train_begin()
        controller_lib.Controller(
            train_loop, steps_per_loop=self._steps_per_loop,
            actions=loop_actions,
            agree=functools.partial(agreement.any_worker, self.strategy)
            if runner.collective else None).run(
                self.step, steps, stop=lambda: self.model.stop_training)
        runner.finish(step=self.step)
        callback_list.on_train_end(history.values)
        return history.values

    def evaluate(self, eval_data) -> dict:
        """Loss and metrics over `eval_data`, each example counted once.

        Args:
          eval_data: a distributed dataset of per-replica `(x, y,
            sample_weight)` batches (sample_weight 0.0 marks padding, as the
            data layer's eval mode gives), or `(x, y)`; or a `tf.data.Dataset`
            of global batches (under ParameterServerStrategy: the chief
            evaluates a `tf.data.Dataset`). Every replica must get the same
            number of batches.

        Returns:
          {"loss": weighted mean loss, metric name: value, ...}.
        """
        args_lib.check_eval_data(eval_data)
        return self.runner.evaluate(eval_data)

    def _print(self, line):
        """Prints `line` on the chief."""
        if cluster_lib.of_strategy(self.strategy).is_chief:
            print(line, flush=True)
