"""The synchronous runner: every replica of every worker makes each update
together (Mirrored, MultiWorkerMirrored, TPU, one device).

Per loop, one `tf.function` of `steps_per_loop` `TrainStep`s (one explicit
gradient reduction per update through the reducer: an all-reduce, local SGD
or PowerSGD), the losses and metrics read once at its end. A balanced run
feeds every replica its measured share (`balancing`). A pipelined model's
runner is this one with the pipeline's step, forward pass and checkpoint
format (`tfmulti/pipeline/runner.py`).
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import compat, strategies, watchdog
from tfmulti import data as data_lib
from tfmulti.training import agreement
from tfmulti.training import data_checks
from tfmulti.training import loop as loop_lib
from tfmulti.training import numerics
from tfmulti.training import optimizer_sharding
from tfmulti.training import runner as runner_lib
from tfmulti.training import step as step_lib
from tfmulti.training import worker_state as worker_state_lib


class SynchronousRunner(runner_lib.Runner):
    """Args:
      parts: the Trainer's `runner.Parts`.
      reducer: the gradient reducer (`reducers.make_reducer`).
      steps_per_loop: steps per `tf.function` call (agreed by the workers).
      jit_compile: XLA for each replica's forward and backward.
      balancer: a `balancing.Balancer`, or None (an even split).
      shard_optimizer_state: the ZeRO stage (0, 1 or 2): apply updates
        through an `optimizer_sharding.ShardedOptimizer` built here; the
        Trainer's optimizer is then the unsharded form checkpoints hold,
        written before each save and read after each restore.
    """

    optional = ("iterator",)
    # Whether the loop records the weights' finiteness (a subclass whose
    # step has its own loop says False).
    checks_weights = True

    def __init__(self, parts: runner_lib.Parts, *, reducer, steps_per_loop,
                 jit_compile, balancer=None, shard_optimizer_state=0):
        self.parts = parts
        self.strategy = parts.strategy
        self.sharding = None
        if shard_optimizer_state:
            with self.strategy.scope():
                self.sharding = optimizer_sharding.ShardedOptimizer(
                    self.strategy, parts.optimizer,
                    parts.model.trainable_variables,
                    stage=shard_optimizer_state,
                    communication_options=strategies.communication_options(
                        self.strategy),
                    wire_dtype=parts.options.allreduce_dtype)
        self.reducer = reducer
        self.balancer = balancer
        self._steps_per_loop = steps_per_loop
        self._jit_compile = jit_compile
        # Train functions by global batch: one trace per batch size.
        self.loops = {}
        self._eval_fn = None
        # NaN weights after finite losses stop training; and evidence for
        # a non-finite loss's message (numerics.likely_cause). Skipping
        # never writes NaN.
        skips = numerics.mode_for(parts.optimizer,
                                  parts.on_nonfinite) == "skip"
        self.weight_check = numerics.WeightCheck(
            parts.model.trainable_variables) if self.checks_weights and (
                not skips) else None
        # Only where updates can be skipped is the count of applied ones
        # news (a loop that skipped every update); elsewhere its two host
        # reads per loop cost 0.12-0.17 ms each, 3-6% of a 32-step loop of
        # a small model at N=1.
        self.counts_updates = skips
        # The model's output in evaluation (None: the model, inference).
        self.forward = None
        # The last `train_data` given to fit, its iterator and global batch:
        # the same object given again continues where it stopped.
        self._source = self.iterator = self._batch = None
        self._fresh = True
        self._train = None

    # -- data ---------------------------------------------------------------

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

    def begin(self, train_data, global_batch_size) -> int:
        self._fresh = train_data is not self._source
        if not self._fresh:
            return self._batch
        if self.balancer is not None:
            iterator = self.balancer.iterator(train_data, global_batch_size)
            batch = iterator.global_batch_size
        else:
            if not callable(train_data):  # a dataset_fn is batched for us
                data_checks.check_batched(getattr(train_data, "element_spec",
                                                  None))
                data_checks.check_not_empty(train_data)
            data = self._distribute(train_data, global_batch_size)
            batch = self._global_batch_size(data, global_batch_size)
            iterator = data if isinstance(
                data, tf.distribute.DistributedIterator) else iter(data)
        self._source, self.iterator, self._batch = train_data, iterator, batch
        return batch

    @property
    def examples_per_step(self):
        return self._batch * self.parts.options.grad_accum_steps

    # -- checkpoints ----------------------------------------------------------

    def trackables(self) -> dict:
        parts = self.parts
        trackables = dict(model=parts.model, optimizer=parts.optimizer,
                          **self.reducer.trackables())
        if compat.is_trackable(self.iterator):
            trackables["iterator"] = self.iterator
        return trackables

    def worker_state(self):
        return worker_state_lib.for_training(
            self.strategy, self.reducer, self.parts.model,
            self.parts.optimizer)

    def restored(self, position, *, batch, missing):
        saved = "iterator" in self.trackables() and "iterator" not in missing
        if self._fresh and not saved:
            # Distributed iterators cannot be checkpointed: replay the
            # batches the restored updates consumed, so a deterministic
            # pipeline continues where it stopped. Counted in examples, so
            # the count holds on another number of replicas or workers.
            loop_lib.skip_batches(self.iterator, (
                position.examples // batch if position.examples
                else position.step * self.parts.options.grad_accum_steps))
        if self.sharding is not None:
            self.sharding.load_from(self.parts.optimizer)

    def before_save(self):
        if self.sharding is not None:
            # The checkpoint holds the unsharded optimizer.
            self.sharding.assign_to(self.parts.optimizer)

    # -- training -------------------------------------------------------------

    def _train_fn(self, batch):
        """`train(iterator, num_steps)` for global batch `batch`."""
        parts = self.parts
        if batch not in self.loops:
            train_step = step_lib.TrainStep(
                self.strategy, parts.model, parts.optimizer,
                parts.compute_loss_fn(batch), options=parts.options,
                metrics=parts.metrics,
                communication_options=strategies.communication_options(
                    self.strategy), reducer=self.reducer,
                jit_compile=self._jit_compile, sharding=self.sharding,
                timer=self.balancer and self.balancer.timer)
            self.loops[batch] = loop_lib.create_train_loop(
                train_step, strategy=self.strategy, metrics=parts.metrics,
                before=[self.weight_check.record] if (
                    self.weight_check) else [])
        return self.loops[batch]

    def prepare(self, *, step, steps, batch, verbose):
        # Before the train loop is built: with another grad_accum_steps it
        # creates other variables, whose broadcasts would meet this check's
        # all-reduce on the other worker.
        agreement.check_agreement(self.strategy, {
            "global_batch_size": batch,
            "grad_accum_steps": self.parts.options.grad_accum_steps,
            "steps_per_loop": self._steps_per_loop,
            "steps": steps,
            # The restored step is agreed by the checkpoint layer's own
            # position check, at the restore.
            "model variable shapes (fingerprint)":
                agreement.shapes_fingerprint(self.parts.model.variables),
        })
        self._train = self._train_fn(batch)
        self._lengths = {}

    def translating(self, *, steps, step):
        # Data that runs out, or does not fit the model, is named.
        return data_checks.translated(
            self.iterator.element_spec, step=step, steps=steps,
            batches_per_step=self.parts.options.grad_accum_steps)

    def run_loop(self, start, n):
        optimizer, metrics = self.parts.optimizer, self.parts.metrics
        if n not in self._lengths:
            self._lengths[n] = tf.constant(n, tf.int32)
        if self.weight_check is not None:
            self.weight_check.take(start)
        # Applied updates advance it, skipped ones do not: a loop that
        # skipped every update is seen even when its losses were finite.
        iterations = int(optimizer.iterations.numpy()) if (
            self.counts_updates) else None
        losses, values = self._train(self.iterator, self._lengths[n]) if (
            metrics) else (self._train(self.iterator, self._lengths[n]), {})
        logs = {k: float(v) for k, v in values.items()}
        if self.balancer is not None:
            logs.update(self.balancer.after_loop(start + n))
        return runner_lib.LoopOutput(
            step=start + n, losses=losses.numpy(), logs=logs,
            applied=None if iterations is None else (
                int(optimizer.iterations.numpy()) - iterations))

    def finish(self, *, step):
        if self.weight_check is not None:
            # Once per fit; a checkpoint of NaN weights is refused anyway.
            self.weight_check.check_now(step=step)
        if self.sharding is not None:
            # After fit the Trainer's optimizer holds the state, for a
            # save of the user's own (model.save, a Checkpoint).
            self.sharding.assign_to(self.parts.optimizer)

    # -- evaluation -----------------------------------------------------------

    def evaluate(self, eval_data) -> dict:
        parts = self.parts
        data_checks.check_not_empty(eval_data, arg="eval_data",
                                    purpose="evaluate")
        if isinstance(eval_data, tf.data.Dataset):
            eval_data = self.strategy.experimental_distribute_dataset(
                eval_data)
        if self._eval_fn is None:
            forward = self.forward

            @tf.function
            def run_eval(iterator):
                for batch in iterator:
                    self.strategy.run(parts.eval_step, args=(batch, forward))
            self._eval_fn = run_eval
        parts.reset_eval()
        # The iterator is made here, not inside the tf.function: creating a
        # multi-device iterator while tracing got slower with every Trainer
        # in the process (minutes by the 5th, TF 2.21, 4 CPU replicas).
        # A label or shape that does not fit the model is named, as in fit.
        # Between local-SGD synchronisations: on the workers' mean weights.
        with watchdog.calling(self.strategy, self._eval_fn), \
                data_checks.translated(getattr(eval_data, "element_spec",
                                               None), arg="eval_data"), \
                self.reducer.evaluation_weights():
            self._eval_fn(iter(eval_data))
        if float(parts.eval_loss.count.numpy()) == 0:
            raise ValueError(
                "`eval_data` yielded no examples (an empty dataset, or one "
                "whose every batch was padding), so there is no loss to "
                "report. Check the split and any filter() in the pipeline.")
        return parts.eval_results()

