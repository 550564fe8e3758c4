"""Trainer: the custom train loop for Keras 3 models under any strategy.

Per-example losses averaged with the global batch, one explicit gradient
all-reduce per update, clipping by the reduced norm, accumulation, mixed
precision, N steps per `tf.function`, checkpoints and TensorBoard scalars in
`model_dir` (chief only), and resumption from the latest checkpoint.
"""

from __future__ import annotations

import functools
import time

import keras
import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import data as data_lib
from tfmulti import compat, parameter_server, peer_failure, strategies
from tfmulti import watchdog
from tfmulti.data import finiteness
from tfmulti.training import actions as actions_lib
from tfmulti.training import agreement
from tfmulti.training import balancing
from tfmulti.training import async_trainer
from tfmulti.training import checkpoints as checkpoints_lib
from tfmulti.training import controller as controller_lib
from tfmulti.training import data_checks
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import loop as loop_lib
from tfmulti.training import numerics, preemption, reducers
from tfmulti.training import runner as runner_lib
from tfmulti.training import step as step_lib
from tfmulti.training import worker_state as worker_state_lib
from tfmulti.training import summaries
from tfmulti.training import xla as xla_lib

MIXED_PRECISION = ("mixed_float16", "mixed_bfloat16")



def _positive_int(arg, value, hint):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{arg}` should be an int >= 1, got {value!r}. "
                         f"{hint}")
    return value


def _resolve_strategy(strategy, model):
    if strategy is not None:
        return strategy
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    for variable in model.variables:
        owner = compat.variable_strategy(variable)
        if owner is not None:
            return owner
    return tf.distribute.get_strategy()


def _resolve_metric(metric, strategy):
    if isinstance(metric, keras.metrics.Metric):
        if strategies.outside_scope(strategy, metric.variables) is not None:
            raise ValueError(
                f"The metric {metric.name!r} was created outside the "
                f"scope of the strategy {type(strategy).__name__}, so "
                "its counts would not be summed across replicas and "
                "workers. Create it inside `with strategy.scope():`, or "
                f"pass its name (e.g. {metric.name!r}) and the Trainer "
                "creates it there.")
        return metric
    resolved = keras.metrics.get(metric)
    if isinstance(resolved, keras.metrics.Metric):
        return resolved
    if callable(resolved):
        name = metric if isinstance(metric, str) else resolved.__name__
        return keras.metrics.MeanMetricWrapper(resolved, name=name)
    raise ValueError(f"`metrics` has an entry {metric!r} that is not a "
                     "keras.metrics.Metric or a metric name.")


def _float32(y_pred):
    return tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating and
        t.dtype != tf.float64 else t, y_pred)


def _check_per_example(per_example):
    if per_example.shape.rank == 0:
        raise ValueError(
            "`loss` returned a scalar; the Trainer needs PER-EXAMPLE losses "
            "so it can average them with the global batch size across "
            "replicas. Pass a Keras loss with `reduction=None`, e.g. "
            "keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
            "reduction=None), or a function returning shape [batch].")


def _async_warmup_steps(value, strategy):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"`async_warmup_steps` should be an int >= 0 (asynchronous "
            f"updates over which the rate warms up; 0: none), got {value!r}.")
    if not parameter_server.is_parameter_server(strategy):
        raise ValueError(
            f"`async_warmup_steps`={value} warms up asynchronous updates, but "
            f"the strategy is {type(strategy).__name__}, whose updates are "
            "synchronous. Drop it, or warm the optimizer's learning rate up "
            "(tfmulti.scaled_learning_rate(..., warmup_steps=...)).")
    return value


def _check_eval_data(eval_data):
    finiteness.check_finite(eval_data, arg="eval_data", fix=(
        "Pass an exact-once evaluation stream: tfmulti.distribute_"
        "dataset(..., training=False), or a dataset without .repeat()."))


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
    """

    def __init__(self, model, optimizer=None, *, loss=None, strategy=None,
                 metrics=(), grad_accum_steps=1, clip_global_norm=None,
                 allreduce_dtype=None, steps_per_loop=100,
                 mixed_precision=None, model_dir=None,
                 on_nonfinite="raise", sync=None, compression=None,
                 jit_compile=False, async_warmup_steps=None, balance=None):
        # A PipelinedModel brings its own step; the rest of fit is shared.
        self._pipeline = runner_lib.model_runner(
            model, optimizer=optimizer, loss=loss, strategy=strategy,
            grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype, mixed_precision=mixed_precision,
            on_nonfinite=on_nonfinite, jit_compile=jit_compile, sync=sync,
            compression=compression,
        )
        if self._pipeline is not None:
            model, optimizer = self._pipeline.model, self._pipeline.optimizer
            loss = self._pipeline.pipe.loss
        if optimizer is None:
            raise ValueError("`optimizer` is required: a Keras optimizer "
                             "created under the strategy's scope.")
        if not callable(loss):
            raise ValueError(
                f"`loss` should be a callable loss(y_true, y_pred) returning "
                f"per-example losses, got {loss!r}.")
        self._options = step_lib.GradientOptions(
            grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype)
        reducers.check_options(sync, compression,
                                allreduce_dtype=allreduce_dtype)
        if (sync or compression) and parameter_server.is_parameter_server(
                _resolve_strategy(strategy, model)):
            # Asynchronous updates through the ps: no all-reduce to reduce.
            raise ValueError(
                f"`sync`={sync!r} / `compression`={compression!r} do not "
                "apply to ParameterServerStrategy; pass neither.")
        self._steps_per_loop = _positive_int(
            "steps_per_loop", steps_per_loop,
            "It is how many steps run inside one tf.function call.")
        self.strategy = _resolve_strategy(strategy, model)
        self._async_warmup_steps = _async_warmup_steps(
            async_warmup_steps, self.strategy)
        if self._pipeline is None:
            strategies.check_created_in_scope(self.strategy, model,
                                              optimizer)
        self.model = model
        self._loss = loss
        self.model_dir = model_dir
        self.mixed_precision = self._check_precision(mixed_precision)
        self._on_nonfinite = numerics.check_on_nonfinite(on_nonfinite)
        self._jit_compile = xla_lib.check_jit_compile(jit_compile)
        with self.strategy.scope():
            optimizer = numerics.skipping_optimizer(optimizer, on_nonfinite)
            if (self.mixed_precision == "mixed_float16" and not isinstance(
                    optimizer, keras.optimizers.LossScaleOptimizer)):
                # Its finiteness check runs on the reduced gradients, so the
                # skip decision is the same on every replica.
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            self.metrics = [_resolve_metric(m, self.strategy)
                            for m in metrics]
            self._eval_loss = keras.metrics.Mean(name="loss")
        # Updates made; restored from the checkpoint's position. A host int:
        # a mirrored variable would cost a device round trip every loop.
        self._steps_done = 0
        gradients_lib.disable_optimizer_reduction(optimizer)
        self.optimizer = optimizer
        self._reducer = reducers.make_reducer(
            self.strategy, model.trainable_variables, sync=sync,
            compression=compression,
            communication_options=strategies.communication_options(
                self.strategy),
            allreduce_dtype=allreduce_dtype)
        self._loops = {}
        self._eval_fn = None
        # NaN weights after finite losses stop training; and evidence for
        # a non-finite loss's message (numerics.likely_cause). Skipping
        # never writes NaN; a pipeline has its own loop.
        self._weight_check = numerics.WeightCheck(
            model.trainable_variables) if (
                numerics.mode_for(optimizer, on_nonfinite) == "raise"
                and self._pipeline is None) else None
        # The last `train_data` given to fit, its iterator and global batch:
        # the same object given again continues where it stopped.
        self._source = self._iterator = self._source_batch = None
        # Under ParameterServerStrategy fit and evaluate are asynchronous.
        self._async = async_trainer.AsyncTraining(self) if (
            parameter_server.is_parameter_server(self.strategy)) else None
        self._balancer = balancing.for_trainer(
            self.strategy, balance, pipelined=self._pipeline is not None,
            asynchronous=self._async is not None,
            jit_compile=self._jit_compile)

    @property
    def step(self) -> int:
        """Optimizer updates made so far (restored with a checkpoint)."""
        return self._steps_done

    @property
    def balance_history(self) -> list[dict] | None:
        """With `balance`: per loop of the last `fit`, the step, each
        replica's example count and compute seconds per step, and the
        barrier idle fraction; else None."""
        return None if self._balancer is None else list(
            self._balancer.shares_history)

    @property
    def communication(self) -> dict:
        """All-reduce calls and payload bytes this worker issued so far, in
        total and between workers (`communication.TRAFFIC_KEYS`)."""
        return self._reducer.traffic.result()

    def _check_precision(self, mixed_precision):
        model_policy = self.model.dtype_policy.name
        if mixed_precision is None:
            return model_policy if model_policy in MIXED_PRECISION else None
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"`mixed_precision` is {mixed_precision!r}; use None or one "
                f"of {list(MIXED_PRECISION)}.")
        if model_policy != mixed_precision:
            raise ValueError(
                f"`mixed_precision` is {mixed_precision!r} but the model was "
                f"built with dtype policy {model_policy!r}. Call keras."
                f"mixed_precision.set_global_policy({mixed_precision!r}) "
                "before building the model.")
        return mixed_precision

    # -- training ---------------------------------------------------------

    def _compute_loss_fn(self, global_batch_size):
        def compute_loss(x, y, sample_weight, global_batch=None):
            y_pred = self.model(x, training=True)
            per_example = tf.convert_to_tensor(
                self._loss(y, _float32(y_pred)))
            _check_per_example(per_example)
            # A partial batch is averaged over the examples it holds, as
            # one device does (TrainStep passes its actual global size).
            loss = tf.nn.compute_average_loss(
                per_example, sample_weight=sample_weight,
                global_batch_size=global_batch_size if global_batch is None
                else tf.cast(global_batch, tf.int64))
            if self.model.losses:
                # Added on every replica, so scaled by 1/replicas once.
                loss += tf.nn.scale_regularization_loss(tf.add_n(
                    [tf.cast(l, loss.dtype) for l in self.model.losses]))
            return loss, y_pred
        return compute_loss

    def _train_loop(self, global_batch_size):
        if global_batch_size not in self._loops and self._pipeline:
            self._loops[global_batch_size] = self._pipeline.train_loop(
                global_batch_size, metrics=self.metrics)
        if global_batch_size not in self._loops:
            train_step = step_lib.TrainStep(
                self.strategy, self.model, self.optimizer,
                self._compute_loss_fn(global_batch_size),
                options=self._options, metrics=self.metrics,
                communication_options=strategies.communication_options(
                    self.strategy), reducer=self._reducer,
                jit_compile=self._jit_compile,
                timer=self._balancer and self._balancer.timer)
            self._loops[global_batch_size] = loop_lib.create_train_loop(
                train_step, strategy=self.strategy, metrics=self.metrics,
                before=[self._weight_check.record] if (
                    self._weight_check) else [])
        return self._loops[global_batch_size]

    def _distribute(self, data, global_batch_size):
        if isinstance(data, tf.data.Dataset):
            return self.strategy.experimental_distribute_dataset(data)
        if isinstance(data, (tf.distribute.DistributedDataset,
                             tf.distribute.DistributedIterator)):
            return data
        if callable(data):
            if global_batch_size is None:
                raise ValueError(
                    "`train_data` is a dataset_fn, so pass "
                    "`global_batch_size` too: the batch summed over all "
                    "replicas, which tfmulti.distribute_dataset splits.")
            # The data layer's training mode: sharded, shuffled, repeated,
            # full per-replica batches.
            return data_lib.distribute_dataset(
                self.strategy, data, global_batch_size=global_batch_size)
        raise ValueError(
            f"`train_data` should be a tf.distribute.DistributedDataset, a "
            f"distributed iterator, a tf.data.Dataset of GLOBAL batches or an "
            f"unbatched dataset_fn(input_context) for tfmulti.distribute_"
            f"dataset; got {type(data).__name__}.")

    def _global_batch_size(self, data, given):
        per_replica = data_checks.batch_size(data.element_spec)
        replicas = self.strategy.num_replicas_in_sync
        found = None if per_replica is None else per_replica * replicas
        if given is not None:
            _positive_int("global_batch_size", given,
                          "Pass the batch summed over all replicas.")
            if found is not None and found != given:
                raise ValueError(
                    f"`global_batch_size` is {given} but the data yields "
                    f"{per_replica} examples per replica x {replicas} "
                    f"replicas = {found}. Fix one of them.")
            return given
        if found is None:
            raise ValueError(
                "Cannot determine the global batch size: the training data "
                "has no static batch dimension. Batch it with "
                "drop_remainder=True (training batches must be full on every "
                "replica), or pass `global_batch_size` to fit.")
        return found

    def _iterator_for(self, train_data, global_batch_size):
        if train_data is self._source:
            return self._iterator, self._source_batch
        if self._balancer is not None:
            iterator = self._balancer.iterator(train_data, global_batch_size)
            self._source, self._iterator, self._source_batch = (
                train_data, iterator, iterator.global_batch_size)
            return iterator, iterator.global_batch_size
        if not callable(train_data):  # a dataset_fn is batched for us
            data_checks.check_batched(getattr(train_data, "element_spec",
                                              None))
            data_checks.check_not_empty(train_data)
        data = self._distribute(train_data, global_batch_size)
        batch = self._global_batch_size(data, global_batch_size)
        iterator = data if isinstance(
            data, tf.distribute.DistributedIterator) else iter(data)
        self._source, self._iterator, self._source_batch = (
            train_data, iterator, batch)
        return iterator, batch

    def _checkpointer(self, iterator):
        """A Checkpointer, and whether it saves the iterator's position."""
        trackables = dict(model=self.model, optimizer=self.optimizer if (
            self._pipeline is None) else self._pipeline.optimizer_view,
            **self._reducer.trackables())
        if compat.is_trackable(iterator):
            trackables["iterator"] = iterator
        # Optional: a checkpoint Keras `fit` wrote has no iterator.
        return (checkpoints_lib.Checkpointer(
            self.model_dir, self.strategy, optional=("iterator",),
            worker_state=worker_state_lib.for_training(
                self.strategy, self._reducer, self.model, self.optimizer)
            if self._pipeline is None else None, **trackables),
                "iterator" in trackables)

    def _position(self, step, batch, *, loss_finite=True):
        cluster = cluster_lib.of_strategy(self.strategy)
        accum = self._options.grad_accum_steps
        return checkpoints_lib.Position(
            step=step, examples=step * batch * accum,
            global_batch_size=batch, batches_per_step=accum,
            num_replicas=self.strategy.num_replicas_in_sync,
            num_workers=cluster.num_workers, loss_finite=loss_finite)

    def _restore(self, iterator, fresh_iterator, batch, verbose):
        checkpointer, saves_iterator = self._checkpointer(iterator)
        try:
            position = checkpointer.restore()
            if cluster_lib.of_strategy(self.strategy).num_workers > 1:
                checkpoints_lib.check_workers_agree(self.strategy, position)
        except BaseException:
            checkpointer.close()
            raise
        if position is None:
            return checkpointer
        if self._pipeline is not None:
            self._pipeline.after_restore()
        self._steps_done = position.step
        now = self._position(position.step, batch)
        if position.global_batch_size not in (None, batch):
            checkpointer.close()
            raise ValueError(
                f"`model_dir` {self.model_dir!r} was trained with global "
                f"batch {position.global_batch_size}, and this run's is "
                f"{batch}. Resume with `global_batch_size`="
                f"{position.global_batch_size} (the per-replica batch is "
                "recomputed for the replicas you have), or use a new "
                "`model_dir`.")
        if (not saves_iterator or "iterator" in checkpointer.missing) and (
                fresh_iterator):
            # Distributed iterators cannot be checkpointed: replay the
            # batches the restored updates consumed, so a deterministic
            # pipeline continues where it stopped. Counted in examples, so
            # the count holds on another number of replicas or workers.
            loop_lib.skip_batches(iterator, (
                position.examples // batch if position.examples
                else position.step * self._options.grad_accum_steps))
        if verbose:
            changes = position.changes_to(now)
            self._print(
                f"restored {checkpointer.restored_path} at step {self.step}"
                + (f" (elastic resume: {'; '.join(changes)}; the "
                   "learning-rate schedule continues at step "
                   f"{self.step})" if changes else ""))
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
        _positive_int("steps", steps, "It is the total number of optimizer "
                      "updates to train for.")
        for name, value, hint in (
                ("eval_every", eval_every,
                 "Or pass None to evaluate only at the end."),
                ("checkpoint_every", checkpoint_every,
                 "Or pass None to save at evaluations and the end.")):
            if value is not None:
                _positive_int(name, value, hint)
        if eval_data is not None:
            _check_eval_data(eval_data)
        if self._async is not None:
            return self._async.fit(
                train_data, steps=steps, global_batch_size=global_batch_size,
                eval_data=eval_data, eval_every=eval_every,
                checkpoint_every=checkpoint_every, callbacks=callbacks,
                actions=actions, verbose=verbose)
        fresh_iterator = train_data is not self._source
        iterator, batch = self._iterator_for(train_data, global_batch_size)
        checkpointer = self._restore(iterator, fresh_iterator, batch,
                                     verbose) if self.model_dir else None
        try:
            # Data that runs out, or does not fit the model, is named.
            with data_checks.translated(
                    iterator.element_spec, step=lambda: self.step,
                    steps=steps,
                    batches_per_step=self._options.grad_accum_steps):
                return self._fit(iterator, batch, steps, checkpointer,
                                 eval_data=eval_data, eval_every=eval_every,
                                 callbacks=callbacks, actions=actions,
                                 checkpoint_every=checkpoint_every,
                                 verbose=verbose)
        finally:
            if checkpointer is not None:
                checkpointer.close()

    def _fit(self, iterator, batch, steps, checkpointer, *, eval_data,
             eval_every, callbacks, actions, checkpoint_every, verbose):
        # Before the train loop is built: with another grad_accum_steps it
        # creates other variables, whose broadcasts would meet this check's
        # all-reduce on the other worker.
        self._check_workers_agree(batch, steps)
        train = self._train_loop(batch)
        callback_list = keras.callbacks.CallbackList(list(callbacks),
                                                     model=self.model)
        self.model.stop_training = False
        history = {key: [] for key in (
            "step", "loss", "step_loss", "steps_per_sec", "examples_per_sec",
            *[m.name for m in self.metrics])}
        examples_per_step = batch * self._options.grad_accum_steps
        on_nonfinite = numerics.mode_for(self.optimizer, self._on_nonfinite)
        lengths = {}
        skips_in_a_row = [0]
        weight_check = self._weight_check

        def train_loop(start, n):
            callback_list.on_train_batch_begin(start)
            began = time.perf_counter()
            if n not in lengths:
                lengths[n] = tf.constant(n, tf.int32)
            if weight_check is not None:
                weight_check.take(start)
            # Applied updates advance it, skipped ones do not: a loop that
            # skipped every update is seen even when its losses were finite.
            iterations = int(self.optimizer.iterations.numpy())
            losses, metrics = train(iterator, lengths[n]) if (
                self.metrics) else (train(iterator, lengths[n]), {})
            losses = losses.numpy()
            skipped = numerics.check_losses(
                losses, first_step=start, on_nonfinite=on_nonfinite,
                previous=history["step_loss"], weights=weight_check)
            elapsed = time.perf_counter() - began
            skips_in_a_row[0] = numerics.consecutive_skips(
                skips_in_a_row[0], losses,
                applied=int(self.optimizer.iterations.numpy()) - iterations)
            numerics.check_consecutive_skips(
                skips_in_a_row[0], step=start + n, optimizer=self.optimizer)
            self._steps_done = start + n
            logs = {"loss": float(losses.mean()),
                    **{k: float(v) for k, v in metrics.items()},
                    **(self._balancer.after_loop(start + n)
                       if self._balancer else {})}
            history["step"].append(start + n)
            history["step_loss"].extend(losses.tolist())
            logs_and_speed = {
                **logs, "steps_per_sec": n / elapsed,
                "examples_per_sec": n * examples_per_step / elapsed}
            for key, value in logs_and_speed.items():
                history.setdefault(key, []).append(value)
            if skipped:
                self._print(f"skipped non-finite update(s) {skipped}")
            callback_list.on_train_batch_end(start + n - 1, logs)
            return controller_lib.LoopResult(
                step=start + n, steps=steps, at_end=False, losses=losses,
                logs=logs_and_speed)

        self._run_controller(
            train_loop, callback_list, history, steps=steps, agree=self._agree,
            eval_data=eval_data, eval_every=eval_every, actions=actions,
            checkpointer=checkpointer, checkpoint_every=checkpoint_every,
            batch=batch, verbose=verbose, preemption_watcher=self._preemption)
        if weight_check is not None:
            # Once per fit; a checkpoint of NaN weights is refused anyway.
            weight_check.check_now(step=self.step)
        callback_list.on_train_end(history)
        return history

    def _run_controller(self, train_loop, callback_list, history, *, steps,
                        agree=None, **loop_actions):
        """Runs `train_loop` loop after loop up to `steps` under the
        controller, with `_loop_actions(**loop_actions)` between loops (both
        modes of `fit`; `agree`: the workers' agreement on stopping)."""
        actions = self._loop_actions(callback_list, history, **loop_actions)
        callback_list.on_train_begin()
        controller_lib.Controller(
            train_loop, steps_per_loop=self._steps_per_loop, actions=actions,
            agree=agree).run(self.step, steps,
                             stop=lambda: self.model.stop_training)

    def _loop_actions(self, callback_list, history, *, eval_data,
                      eval_every, actions, checkpointer, checkpoint_every,
                      batch, verbose, preemption_watcher):
        """The controller's actions of `fit` (also its asynchronous mode's):
        summaries, the log line, evaluation, the user's `actions`, the
        checkpoint and the exit on preemption, in that order."""
        eval_schedule = controller_lib.Schedule(
            every_steps=eval_every, exact=eval_every is not None)
        loop_actions = []
        writer = summaries.ScalarWriter(self.model_dir, self.strategy,
                                        "train")
        if writer.active:
            loop_actions.append(actions_lib.WriteSummaries(
                writer, extra=lambda: {"learning_rate": float(
                    keras.ops.convert_to_numpy(
                        self.optimizer.learning_rate))}))
        if verbose:
            loop_actions.append(actions_lib.Log(self._print))
        if eval_data is not None:
            loop_actions.append(actions_lib.Evaluate(
                lambda: self._evaluate_with(callback_list, eval_data),
                schedule=eval_schedule,
                sinks=[functools.partial(_record_eval, history),
                       summaries.ScalarWriter(self.model_dir, self.strategy,
                                              "eval").write,
                       *([functools.partial(_log_eval, self._print)]
                         if verbose else [])]))
        loop_actions.extend(actions)
        if checkpointer is not None:
            position = functools.partial(self._position, batch=batch)
            save_schedule = controller_lib.Schedule(
                every_steps=checkpoint_every) if (
                    checkpoint_every is not None or eval_data is None) else (
                        eval_schedule)
            loop_actions.append(actions_lib.SaveCheckpoint(
                checkpointer, position, schedule=save_schedule,
                say=self._print))
            loop_actions.append(actions_lib.ExitOnPreemption(
                preemption_watcher, checkpointer, position, say=self._print))
        return loop_actions

    def _agree(self, flags):
        """Element-wise OR of `flags` over all workers (one all-reduce)."""
        if cluster_lib.of_strategy(self.strategy).num_workers < 2:
            return flags
        summed = loop_lib.sum_over_replicas(
            self.strategy, tf.constant([float(f) for f in flags]))
        return [bool(v > 0) for v in summed.numpy()]

    def _evaluate_with(self, callback_list, eval_data):
        callback_list.on_test_begin()
        results = self.evaluate(eval_data)
        callback_list.on_test_end(results)
        return results

    # -- evaluation -------------------------------------------------------

    def _eval_step(self, batch):
        x, y, sample_weight = step_lib.unpack_batch(batch)
        y_pred = self.model(x, training=False) if self._pipeline is None else (
            self._pipeline.forward(x))
        per_example = tf.convert_to_tensor(self._loss(y, _float32(y_pred)))
        _check_per_example(per_example)
        self._eval_loss.update_state(per_example, sample_weight=sample_weight)
        for metric in self.metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)

    def _check_workers_agree(self, global_batch_size, steps):
        agreement.check_agreement(self.strategy, {
            "global_batch_size": global_batch_size,
            "grad_accum_steps": self._options.grad_accum_steps,
            "steps_per_loop": self._steps_per_loop,
            "steps": steps,
            # The restored step is agreed by the checkpoint layer's own
            # position check, at the restore.
            "model variable shapes (fingerprint)":
                agreement.shapes_fingerprint(self.model.variables),
        })

    def evaluate(self, eval_data) -> dict:
        """Loss and metrics over `eval_data`, each example counted once.

        Args:
          eval_data: a distributed dataset of per-replica `(x, y,
            sample_weight)` batches (sample_weight 0.0 marks padding, as the
            data layer's eval mode gives), or `(x, y)`; or a `tf.data.Dataset`
            of global batches. Every replica must get the same number of
            batches.

        Returns:
          {"loss": weighted mean loss, metric name: value, ...}.
        """
        _check_eval_data(eval_data)
        if self._async is not None:
            return self._async.evaluate(eval_data)
        data_checks.check_not_empty(eval_data, arg="eval_data",
                                    purpose="evaluate")
        if isinstance(eval_data, tf.data.Dataset):
            eval_data = self.strategy.experimental_distribute_dataset(
                eval_data)
        if self._eval_fn is None:
            @tf.function
            def run_eval(iterator):
                for batch in iterator:
                    self.strategy.run(self._eval_step, args=(batch,))
            self._eval_fn = run_eval
        for metric in (self._eval_loss, *self.metrics):
            metric.reset_state()
        # The iterator is made here, not inside the tf.function: creating a
        # multi-device iterator while tracing got slower with every Trainer
        # in the process (minutes by the 5th, TF 2.21, 4 CPU replicas).
        # A label or shape that does not fit the model is named, as in fit.
        # Between local-SGD synchronisations: on the workers' mean weights.
        with watchdog.calling(self.strategy, self._eval_fn), data_checks.translated(
                getattr(eval_data, "element_spec", None), arg="eval_data"), \
                self._reducer.evaluation_weights():
            self._eval_fn(iter(eval_data))
        if float(self._eval_loss.count.numpy()) == 0:
            raise ValueError(
                "`eval_data` yielded no examples (an empty dataset, or one "
                "whose every batch was padding), so there is no loss to "
                "report. Check the split and any filter() in the pipeline.")
        return {m.name: float(m.result())
                for m in (self._eval_loss, *self.metrics)}

    def _print(self, line):
        """Prints `line` on the chief."""
        if cluster_lib.of_strategy(self.strategy).is_chief:
            print(line, flush=True)


def _record_eval(history, step, results):
    history.setdefault("val_step", []).append(step)
    for key, value in results.items():
        history.setdefault(f"val_{key}", []).append(value)


def _log_eval(say, step, results):
    say(f"eval at step {step} " + " ".join(
        f"- {k} {v:.4f}" for k, v in results.items()))
