"""The asynchronous runner: steps scheduled on a parameter-server job.

Under `ParameterServerStrategy` the chief runs this loop and the workers only
serve: each step is a closure the `ClusterCoordinator` schedules on whichever
worker is free, which reads the variables from the parameter servers,
computes its gradient on its own batch and applies it there, without waiting
for the other workers. A worker that dies is TensorFlow's to handle: its
in-flight closure is put back in the queue and runs on another worker.

A retried closure is never applied twice (`closure_ledger`); an update cut
off by its worker's death is lost and counted (`lost_updates` in the
history), and the coordinator's retries are counted (`coordinator_watch`).

Keras 3's `model.fit` does not run under this strategy
(keras-team/keras#18624: Keras 3 has no `ClusterCoordinator` path); Keras 3
models, optimizers and metrics do.
"""

from __future__ import annotations

import contextlib
import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti import parameter_server
from tfmulti.data import pipeline as pipeline_lib
from tfmulti.training import closure_ledger
from tfmulti.training import coordinator_watch
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import runner as runner_lib
from tfmulti.training import step as step_lib

# The errors through which the coordinator reports a lost parameter server
# (workers are retried and never surface).
_PS_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
              tf.errors.CancelledError, tf.errors.InternalError,
              tf.errors.UnknownError, tf.errors.DeadlineExceededError)


# Updates over which each applied update is scaled up linearly from 1/W to
# 1 (a warm-up of the learning rate) unless the Trainer is given
# `async_warmup_steps`. Asynchronous gradients are stale (about one step per
# extra worker), and while the model leaves its initial plateau stale
# full-size steps kept it at chance: the recipe's default run (2 workers,
# 300 steps of 128, Adam 1e-3) ended at 39.4% against synchronous 85.6%
# (issue 27); with a warm-up of 150 steps of 64, 1000-step runs ended within
# 0.6 points of synchronous (BUILD_NOTES, issue 16).
DEFAULT_WARMUP_STEPS = 100


class ParameterServerError(RuntimeError):
    """A parameter server died or became unreachable; the job must restart.

    Attributes:
      step: the last step the chief saw completed.
      checkpoint: the chief's latest checkpoint (where a restart resumes),
        or None.
    """

    def __init__(self, message, *, step, checkpoint):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class WorkersLostError(RuntimeError):
    """Every worker of a parameter-server job stayed unreachable too long.

    TensorFlow's coordinator waits (up to an hour) for a failed worker to
    come back at the same address; `stall_timeout_seconds` of
    `create_strategy` bounds that wait when NO worker is left.

    Attributes:
      workers: the addresses of the workers the coordinator held failed.
      step: the last step the chief saw completed.
      checkpoint: the chief's latest checkpoint (where a restart resumes),
        or None.
    """

    def __init__(self, message, *, workers, step, checkpoint):
        super().__init__(message)
        self.workers = workers
        self.step = step
        self.checkpoint = checkpoint


def _reject_sharded(model):
    for variable in model.variables:
        if compat.is_sharded_variable(getattr(variable, "value", None)):
            raise ValueError(
                f"The model's variable {variable.path!r} is sharded over the "
                "parameter servers (the strategy has a `variable_"
                "partitioner`), and Keras 3 cannot train a sharded variable: "
                "its gradient fails ('ShardedVariable' object has no "
                "attribute 'handle') and its optimizer cannot update it "
                "('ShardedVariable doesn't support being used as a "
                "reference'). Create the strategy without "
                "`variable_partitioner`.")



class _ChiefPreemption:
    """A `PreemptionWatcher` as `actions.ExitOnPreemption` wants it, decided
    by the chief alone: under this strategy only the chief trains (the
    watcher's cross-worker agreement is an all-reduce, which this strategy
    has not)."""

    def __init__(self, watcher):
        self._watcher = watcher

    def agreed(self) -> bool:
        return self._watcher is not None and self._watcher.signalled

    def __exit__(self, *exc):
        return self._watcher.__exit__(*exc)


class AsyncRunner(runner_lib.Runner):
    """The runner of a `tfmulti.Trainer` under ParameterServerStrategy (the
    Trainer creates it): per loop, `steps_per_loop` closures are scheduled,
    then joined; only the chief runs the loop.

    Args:
      parts: the Trainer's `runner.Parts`.
      model_dir: the Trainer's (named in error messages), or None.
      warmup_steps: the Trainer's `async_warmup_steps` (None: the default).
    """

    collective = False
    history_keys = ("retried_closures", "reattempted_on_ps", "lost_updates")

    def __init__(self, parts: runner_lib.Parts, *, model_dir, warmup_steps):
        if parts.options.grad_accum_steps != 1:
            raise ValueError(
                f"`grad_accum_steps` is {parts.options.grad_accum_steps} "
                "but under ParameterServerStrategy every step is applied on "
                "its own, asynchronously. Use grad_accum_steps=1 and a larger "
                "`global_batch_size`.")
        _reject_sharded(parts.model)
        self.parts = parts
        self.strategy = parts.strategy
        self._model_dir = model_dir
        self.coordinator = parameter_server.coordinator(self.strategy)
        self.retries = coordinator_watch.RetryCounter(self.coordinator)
        self._watch = coordinator_watch.WorkerWatch(self.coordinator)
        self._stall_timeout = parameter_server.stall_timeout(self.strategy)
        self._cluster = cluster_lib.of_strategy(self.strategy)
        self.warmup_steps = (DEFAULT_WARMUP_STEPS if warmup_steps is None
                             else warmup_steps)
        with self.strategy.scope():
            # Closures claimed, counted inside the ledger's claim on the ps
            # (the Trainer's own count is a Python int, set from this).
            self.steps_done = tf.Variable(0, dtype=tf.int64,
                                          trainable=False,
                                          name="async_steps_done")
        self.ledger = None
        self._step_fn = None
        self._eval_fn = None
        self._source = self._iterator = None
        self._last_step = None

    # -- data ---------------------------------------------------------------

    @staticmethod
    def _check_train_data(dataset_fn, global_batch_size):
        if not callable(dataset_fn) or isinstance(dataset_fn,
                                                  tf.data.Dataset):
            raise ValueError(
                "Under ParameterServerStrategy `train_data` should be an "
                "unbatched `dataset_fn(input_context)` (e.g. tfmulti.tfds_"
                "dataset_fn), which every worker calls for its own shard; got "
                f"{type(dataset_fn).__name__}.")
        if global_batch_size is None:
            raise ValueError(
                "Pass `global_batch_size`: under ParameterServerStrategy it "
                "is the batch of ONE step, which one worker computes.")

    def _per_worker_iterator(self, dataset_fn, global_batch_size, seed, *,
                             examples_done=0):
        if dataset_fn is self._source:
            return self._iterator
        per_replica = global_batch_size // self.strategy.num_replicas_in_sync

        num_workers = len(self._cluster.cluster["worker"])

        def worker_dataset(input_context):
            del input_context  # identical on every worker under this strategy
            # Every worker reads the WHOLE dataset: one shuffled stream
            # (same seed), each worker starting at its own offset in it
            # (index * size / workers; the index is known only when this
            # runs on a worker). The workers start on disjoint parts and a
            # survivor goes on into a dead worker's part; a static shard
            # per worker lost a dead worker's shard for the rest of the
            # run and over-weighted a fast worker's. (A per-worker seed is
            # not possible here: a tensor seed fails in `shuffle` once a
            # global seed is set.)
            index = tf.cast(tf.distribute.coordinator
                            .experimental_get_current_worker_index(),
                            tf.int64)
            dataset = dataset_fn(tf.distribute.InputContext())
            size = dataset.cardinality()
            dataset = dataset.shuffle(pipeline_lib.DEFAULT_SHUFFLE_BUFFER,
                                      seed=seed,
                                      reshuffle_each_iteration=True).repeat()
            # A resumed job goes on past the examples its restored steps
            # read (as the synchronous Trainer's does) instead of reading
            # the stream's start again; which worker read how many is not
            # recorded, so the workers share them evenly. Within one epoch
            # (skipping reads): past the first, any position is as new.
            offset = tf.where(
                size > 0,
                (size * index + examples_done) // num_workers % tf.maximum(
                    size, 1), 0)
            return dataset.skip(offset).batch(
                per_replica, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

        @tf.function
        def per_worker():
            return self.strategy.distribute_datasets_from_function(
                worker_dataset)

        self._iterator = iter(self.coordinator.create_per_worker_dataset(
            per_worker))
        self._source = dataset_fn
        return self._iterator

    # -- the step -------------------------------------------------------------

    # Plain TensorFlow ops: AutoGraph has nothing to convert.
    @tf.autograph.experimental.do_not_convert
    def _gradients(self, batch, compute_loss):
        parts = self.parts
        variables = parts.model.trainable_variables
        x, y, sample_weight = step_lib.unpack_batch(batch)
        with tf.GradientTape() as tape:
            loss, y_pred = compute_loss(x, y, sample_weight)
            scaled = parts.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        for metric in parts.metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        return loss, grads

    # Plain TensorFlow ops: AutoGraph has nothing to convert.
    @tf.autograph.experimental.do_not_convert
    def _apply(self, grads):
        optimizer = self.parts.optimizer
        options = self.parts.options
        # Sums a worker's local replicas (identity with one); never across
        # workers, which do not wait for one another.
        grads = gradients_lib.clip_scaled(
            gradients_lib.all_reduce_sum(grads, dtype=options.allreduce_dtype),
            optimizer, options.clip_global_norm)
        variables = self.parts.model.trainable_variables
        if not self.warmup_steps:
            optimizer.apply(grads, variables)
            return
        # The warm-up scales what this update moves each weight by: for an
        # update that is the learning rate times a function of the
        # gradients seen (Adam, RMSprop, SGD) that is the update at a
        # scaled rate, whatever rate or schedule the optimizer has, and the
        # optimizer's own variables are untouched. `steps_done` counts this
        # update already (claimed under the ledger's lock, in order).
        fraction = tf.minimum(1.0, tf.cast(self.steps_done, tf.float32) /
                              float(self.warmup_steps))
        before = [tf.identity(v.value) for v in variables]
        optimizer.apply(grads, variables)
        for variable, old in zip(variables, before):
            variable.assign(old + tf.cast(fraction, variable.dtype) * (
                variable.value - old))

    def _build_step(self, steps, global_batch_size):
        if self.ledger is not None and self.ledger.size == steps:
            return self._step_fn
        self.ledger = closure_ledger.ClosureLedger(self.strategy, steps,
                                                   steps=self.steps_done)
        compute_loss = self.parts.compute_loss_fn(global_batch_size)
        strategy, ledger = self.strategy, self.ledger
        written = [*self.parts.model.trainable_variables,
                   *self.parts.optimizer.variables]

        def apply(grads):
            # In cross-replica context: a conditional around an update that
            # merge_calls must not sit in replica context (TF's
            # "`merge_call` called while defining a new graph").
            strategy.run(self._apply, args=(grads,))
            return tf.constant(True)

        @tf.function
        def step_fn(iterator, closure_id):
            ledger.count_attempt(closure_id)
            loss, grads = strategy.run(self._gradients,
                                       args=(next(iterator), compute_loss))
            ledger.guarded(closure_id, apply, grads, written=written)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, loss,
                                   axis=None)

        self._step_fn = step_fn
        return step_fn

    def _latest_checkpoint(self):
        model_dir = self._model_dir
        return tf.train.latest_checkpoint(model_dir) if model_dir else None

    @staticmethod
    def _resume_text(latest):
        return (f"the chief resumes from its latest checkpoint {latest!r}"
                if latest else "there is no checkpoint to resume from "
                "(pass `model_dir` and `checkpoint_every`)")

    def _ps_error(self, error, step):
        latest = self._latest_checkpoint()
        resume = self._resume_text(latest)
        return ParameterServerError(
            f"A parameter server of {list(self._cluster.cluster['ps'])} died "
            "or became unreachable (the coordinator reported "
            f"{type(error).__name__}) "
            f"{'before training began' if step is None else f'after step {step}'}. "
            "The variables it "
            "held are lost, so this job cannot continue: restart every role "
            f"(tfmulti-launch --ps N --max_restarts R does), and {resume}. "
            f"TensorFlow said: {str(error).strip()[:400]}",
            step=step, checkpoint=latest)

    def _workers_lost(self, failed, seconds):
        addresses = [self._cluster.cluster["worker"][i] for i in failed]
        latest = self._latest_checkpoint()
        step = self._last_step
        return WorkersLostError(
            f"Every worker of this job ({addresses}) has been unreachable "
            f"for {seconds:.0f} s (`stall_timeout_seconds`), after step "
            f"{step}: the coordinator waits for a worker to come back at "
            "its address and none did. Restart the workers at the same "
            "addresses within that time (a cluster manager such as "
            "Kubernetes does), or restart the job (tfmulti-launch "
            f"--max_restarts does when the chief fails): "
            f"{self._resume_text(latest)}.",
            workers=addresses, step=step, checkpoint=latest)

    # -- the Runner protocol ---------------------------------------------------

    @contextlib.contextmanager
    def guard(self):
        """A lost parameter server, wherever in `fit` a read or write of a
        variable reports it first, is a `ParameterServerError`."""
        self._last_step = None
        try:
            yield
        except _PS_ERRORS as e:
            raise self._ps_error(e, self._last_step) from e

    def begin(self, train_data, global_batch_size) -> int:
        self._check_train_data(train_data, global_batch_size)
        self._data = train_data
        self.examples_per_step = global_batch_size
        return global_batch_size

    def trackables(self) -> dict:
        return dict(model=self.parts.model, optimizer=self.parts.optimizer)

    def restored(self, position, *, batch, missing):
        self.steps_done.assign(position.step)

    def prepare(self, *, step, steps, batch, verbose, seed=0):
        self._verbose = verbose
        self._step_fn = self._build_step(steps, batch)
        self._iterator = self._per_worker_iterator(
            self._data, batch, seed, examples_done=step * batch)
        self._lost = 0

    def run_loop(self, start, n):
        for metric in self.parts.metrics:
            metric.reset_state()
        retried_before = self.retries.value()
        remote = [self.coordinator.schedule(self._step_fn, args=(
            self._iterator, tf.constant(start + i, tf.int32)))
                  for i in range(n)]
        # TensorFlow retries a failed worker's closures on the others and,
        # with none left, waits for one to return (up to an hour): bounded
        # by `stall_timeout_seconds` when every worker is lost.
        coordinator_watch.join(self.coordinator, self._watch,
                               self._stall_timeout, lost=self._workers_lost)
        losses = np.array([float(r.fetch()) for r in remote])
        # Counted inside the ledger's claims on the ps: a closure applied
        # twice would show here (history["step"]).
        step = self._last_step = int(self.steps_done.numpy())
        counts = self.ledger.counts()
        lost_before, self._lost = self._lost, closure_ledger.ClosureLedger.lost(
            counts)
        messages = []
        if (self._verbose and self.retries.available and
                self.retries.value() > retried_before):
            messages.append(
                f"retried closures {self.retries.value()} (a worker failed; "
                "its closures ran again on the others)")
        if self._lost > lost_before:
            messages.append(
                f"lost updates {self._lost} (a worker died while its update "
                "was landing on the parameter servers; none is applied "
                "twice)")
        return runner_lib.LoopOutput(
            step=step, losses=losses,
            logs={m.name: float(m.result()) for m in self.parts.metrics},
            history={"retried_closures": self.retries.value(),
                     "reattempted_on_ps": int(np.sum(counts["attempts"] > 1)),
                     "lost_updates": self._lost},
            messages=messages)

    def preemption(self, watcher):
        return _ChiefPreemption(watcher)

    # -- evaluation ---------------------------------------------------------

    def evaluate(self, eval_data) -> dict:
        """Loss and metrics over `eval_data`, computed on the chief.

        Args:
          eval_data: a `tf.data.Dataset` of batches `(x, y, sample_weight)`
            (weight 0 marks padding; `tfmulti.data.build_pipeline` with
            `training=False` gives them) or `(x, y)`.

        Returns:
          {"loss": weighted mean loss, metric name: value, ...}.
        """
        if not isinstance(eval_data, tf.data.Dataset):
            raise ValueError(
                "Under ParameterServerStrategy the chief evaluates: "
                "`eval_data` should be a tf.data.Dataset of (x, y[, "
                f"sample_weight]) batches, got {type(eval_data).__name__}.")
        if self._eval_fn is None:
            @tf.function
            def run_eval(dataset):
                for batch in dataset:
                    self.parts.eval_step(batch)
            self._eval_fn = run_eval
        self.parts.reset_eval()
        try:
            self._eval_fn(eval_data)
        except _PS_ERRORS as e:
            raise self._ps_error(e, self._last_step) from e
        return self.parts.eval_results()
