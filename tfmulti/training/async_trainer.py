"""The Trainer's asynchronous mode: steps scheduled on a parameter-server job.

Under `ParameterServerStrategy` the chief runs this loop and the workers only
serve: each step is a closure the `ClusterCoordinator` schedules on whichever
worker is free, which reads the variables from the parameter servers,
computes its gradient on its own batch and applies it there, without waiting
for the other workers. A worker that dies is TensorFlow's to handle: its
in-flight closure is put back in the queue and runs on another worker.

TensorFlow retries a closure at least once, not exactly once: a worker can
die after its update reached the parameter server but before the coordinator
heard back, and the retry would apply a second update. Every closure here
has an id, and a `ClosureLedger` on the parameter servers lets one attempt
per id claim the right to update, after all its gradients arrived and before
any write: a retried closure is never applied twice, and an update cut off
by its worker's death is lost and counted (`lost_updates` in the history).
`RetryCounter` counts the coordinator's retries.

Keras 3's `model.fit` does not run under this strategy
(keras-team/keras#18624: Keras 3 has no `ClusterCoordinator` path); Keras 3
models, optimizers and metrics do.
"""

from __future__ import annotations

import math
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

from tfmulti import cluster as cluster_lib
from tfmulti import parameter_server
from tfmulti.data import pipeline as pipeline_lib
from tfmulti.training import checkpoints as checkpoints_lib
from tfmulti.training import controller as controller_lib
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import numerics
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

# How often a join looks at the workers' state: small against a loop of
# steps (seconds), and a lock or two per look.
_JOIN_POLL_SECONDS = 0.05


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


class WorkerWatch:
    """Which workers the coordinator holds failed, waiting for them.

    TensorFlow exposes no such state; this reads each of the coordinator's
    private `Worker._is_dead_with_error` (TF 2.18-2.21,
    `cluster_coordinator.Worker`: set when a closure fails with a worker
    error, cleared when the worker is back). Without it `available` is
    False and `Trainer.fit` joins unbounded, as TensorFlow does.
    """

    def __init__(self, coordinator):
        self._workers = list(getattr(getattr(coordinator, "_cluster", None),
                                     "workers", None) or ())
        self.available = bool(self._workers) and all(
            hasattr(w, "_is_dead_with_error") for w in self._workers)

    def failed(self) -> list[int]:
        """Indices of the workers held failed now."""
        return [w.worker_index for w in self._workers
                if w._is_dead_with_error]

    @property
    def size(self) -> int:
        return len(self._workers)


class ClosureLedger:
    """Per-closure marks on the parameter servers: at most one update each.

    TensorFlow's coordinator runs a closure at least once, not exactly once:
    a worker that dies while its update is landing on the parameter servers
    has its closure run again on another worker. TensorFlow has no
    transaction over several variables (each write runs as soon as its own
    inputs arrive), so "update, then mark it done" applied one closure twice
    (measured: 126 steps after a 125-step job) and an atomic update is not
    possible. `guarded` therefore marks first, then updates: a retry of a
    marked closure applies nothing. The price is at-most-once: an update cut
    off by its worker's death is lost, possibly with some of its writes
    landed (like a gradient dropped, which asynchronous training tolerates),
    and `lost` counts them.

    `attempts[i]` counts the executions of closure `i` that started (more
    than one: retried); `claimed[i]` is 1 once an attempt took the right to
    update (never more, by construction); `completed[i]` is 1 once that
    update's writes have all landed. `steps` counts the claimed closures on
    top of the restored step: the Trainer's step.

    Args:
      strategy: the ParameterServerStrategy.
      size: the number of closure ids (steps of the job).
      steps: the job's step counter (int64 variable on the ps), shared by
        the ledgers of successive `fit` calls.
    """

    def __init__(self, strategy, size: int, *, steps):
        self.size = size
        self.steps = steps

        def counter(name):
            return tf.Variable(tf.zeros([size], tf.int32), trainable=False,
                               name=name)

        with strategy.scope():
            self.attempts = counter("closure_attempts")
            self.claimed = counter("closure_claimed")
            self.completed = counter("closure_completed")
        with tf.device(self.claimed.device):
            # A mutex on the ps: claim, update and completed mark of one
            # closure are one step (a retry arriving meanwhile waits, then
            # sees the claim), and the updates are serialised.
            self._lock = tf.CriticalSection(name="closure_ledger")

    def count_attempt(self, closure_id):
        self.attempts.scatter_nd_add([[closure_id]], [1])

    def guarded(self, closure_id, apply_fn, inputs, *, written):
        """Runs `apply_fn(inputs)` unless closure `closure_id` claimed one.

        Placed on the parameter server that holds the ledger. The claim
        waits for every input (the gradients) to arrive there, so a worker
        that dies before sending all of them leaves its closure unclaimed
        for the retry.

        Args:
          closure_id: int32 scalar, the closure's id (its step).
          apply_fn: the update, `apply_fn(inputs)`.
          inputs: a nest of tensors (from the worker).
          written: the variables `apply_fn` writes; their reads, which
            tf.function orders after the writes, are what `completed`
            waits for.

        Returns:
          bool scalar: whether this attempt applied the update.
        """
        with tf.device(self.claimed.device):
            # Every input on this device BEFORE the claim is read.
            # TensorFlow lowers tf.cond to Switch/Merge, whose branch ops
            # each start as soon as their own input arrives.
            arrived = [tf.identity(t) for t in
                       tf.nest.flatten(inputs, expand_composites=True)]

            def claim_and_apply():
                with tf.control_dependencies(arrived):
                    fresh = tf.equal(self.claimed[closure_id], 0)
                take = tf.cast(fresh, tf.int32)
                marks = [self.claimed.scatter_nd_add([[closure_id]], [take]),
                         self.steps.assign_add(tf.cast(take, tf.int64),
                                               read_value=False)]
                # The branch waits for the predicate, so for the marks:
                # the claim is set before any write of the update.
                with tf.control_dependencies(marks):
                    fresh = tf.identity(fresh)

                def apply():
                    apply_fn(inputs)
                    with tf.control_dependencies(
                            [tf.identity(v) for v in written]):
                        done = self.completed.scatter_nd_add(
                            [[closure_id]], [1])
                    with tf.control_dependencies([done]):
                        return tf.constant(True)

                return tf.cond(fresh, apply, lambda: tf.constant(False))

            # The section's lock is held until its output exists, which
            # waits for the completed mark. Not exclusive: the model's
            # variables are also read outside it (the forward pass), and
            # `steps` is shared by the ledgers of later fits.
            return self._lock.execute(claim_and_apply,
                                      exclusive_resource_access=False)

    def counts(self) -> dict:
        """{"attempts", "claimed", "completed"}: arrays read from the ps."""
        return {"attempts": self.attempts.numpy(),
                "claimed": self.claimed.numpy(),
                "completed": self.completed.numpy()}

    @staticmethod
    def lost(counts) -> int:
        """Updates claimed but never completed (their worker died)."""
        return int(np.sum(counts["claimed"]) - np.sum(counts["completed"]))


def _reject_sharded(model):
    for variable in model.variables:
        if isinstance(getattr(variable, "value", None),
                      sharded_variable.ShardedVariable):
            raise ValueError(
                f"The model's variable {variable.path!r} is sharded over the "
                "parameter servers (the strategy has a `variable_"
                "partitioner`), and Keras 3 cannot train a sharded variable: "
                "its gradient fails ('ShardedVariable' object has no "
                "attribute 'handle') and its optimizer cannot update it "
                "('ShardedVariable doesn't support being used as a "
                "reference'). Create the strategy without "
                "`variable_partitioner`.")


class RetryCounter:
    """Counts the closures the coordinator put back in its queue to run
    again after their worker failed.

    TensorFlow has no public count of these; this wraps the `put_back` of
    the coordinator's private closure queue (TF 2.21,
    `cluster_coordinator._CoordinatedClosureQueue`). A retry whose first
    attempt never started on its worker reaches no parameter server, so the
    `ClosureLedger` alone would miss it. Without that private method the
    count is None.
    """

    def __init__(self, coordinator):
        self.count = 0
        queue = getattr(getattr(coordinator, "_cluster", None),
                        "closure_queue", None)
        put_back = getattr(queue, "put_back", None)
        self.available = callable(put_back)
        if self.available and not getattr(put_back, "_tfmulti_counted",
                                          False):
            def counted(closure):
                self.count += 1
                return put_back(closure)
            counted._tfmulti_counted = True
            queue.put_back = counted

    def value(self):
        return self.count if self.available else None


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


class AsyncTraining:
    """The asynchronous mode of a `tfmulti.Trainer` under
    ParameterServerStrategy (the Trainer creates it; use the Trainer).

    Args:
      trainer: the `Trainer` whose model, optimizer, loss, metrics, step
        counter and `model_dir` this mode uses.
    """

    def __init__(self, trainer):
        if trainer._options.grad_accum_steps != 1:
            raise ValueError(
                f"`grad_accum_steps` is {trainer._options.grad_accum_steps} "
                "but under ParameterServerStrategy every step is applied on "
                "its own, asynchronously. Use grad_accum_steps=1 and a larger "
                "`global_batch_size`.")
        _reject_sharded(trainer.model)
        self._trainer = trainer
        self.strategy = trainer.strategy
        self.coordinator = parameter_server.coordinator(self.strategy)
        self.retries = RetryCounter(self.coordinator)
        self._watch = WorkerWatch(self.coordinator)
        self._stall_timeout = parameter_server.stall_timeout(self.strategy)
        self._cluster = cluster_lib.of_strategy(self.strategy)
        self.warmup_steps = (DEFAULT_WARMUP_STEPS if
                             trainer._async_warmup_steps is None
                             else trainer._async_warmup_steps)
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
        trainer = self._trainer
        variables = trainer.model.trainable_variables
        x, y, sample_weight = step_lib.unpack_batch(batch)
        with tf.GradientTape() as tape:
            loss, y_pred = compute_loss(x, y, sample_weight)
            scaled = trainer.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        for metric in trainer.metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        return loss, grads

    # Plain TensorFlow ops: AutoGraph has nothing to convert.
    @tf.autograph.experimental.do_not_convert
    def _apply(self, grads):
        trainer = self._trainer
        options = trainer._options
        # Sums a worker's local replicas (identity with one); never across
        # workers, which do not wait for one another.
        grads = gradients_lib.all_reduce_sum(grads,
                                             dtype=options.allreduce_dtype)
        if options.clip_global_norm is not None:
            scale = tf.cast(trainer.optimizer.scale_loss(tf.constant(1.0)),
                            tf.float32)
            grads, _ = gradients_lib.clip_by_global_norm(
                grads, options.clip_global_norm * scale)
        variables = trainer.model.trainable_variables
        if not self.warmup_steps:
            trainer.optimizer.apply(grads, variables)
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
        trainer.optimizer.apply(grads, variables)
        for variable, old in zip(variables, before):
            variable.assign(old + tf.cast(fraction, variable.dtype) * (
                variable.value - old))

    def _build_step(self, steps, global_batch_size):
        if self.ledger is not None and self.ledger.size == steps:
            return self._step_fn
        self.ledger = ClosureLedger(self.strategy, steps,
                                    steps=self.steps_done)
        compute_loss = self._trainer._compute_loss_fn(global_batch_size)
        strategy, ledger = self.strategy, self.ledger
        written = [*self._trainer.model.trainable_variables,
                   *self._trainer.optimizer.variables]

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

    # -- fit ----------------------------------------------------------------

    def _sync_step(self) -> int:
        self._trainer._steps_done = int(self.steps_done.numpy())
        return self._trainer.step

    def _latest_checkpoint(self):
        model_dir = self._trainer.model_dir
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

    def _join(self):
        """`coordinator.join()`, bounded when every worker is lost.

        TensorFlow retries a failed worker's closures on the others and,
        with none left, waits for one to return (up to an hour). With
        every worker held failed for `stall_timeout_seconds` this raises
        `WorkersLostError` instead.
        """
        if (self._stall_timeout is None or self._stall_timeout == math.inf
                or not self._watch.available):
            self.coordinator.join()
            return
        all_failed_since = None
        # done() raises the closures' error, as join() does.
        while not self.coordinator.done():
            failed = self._watch.failed()
            now = time.monotonic()
            if len(failed) < self._watch.size:
                all_failed_since = None
            elif all_failed_since is None:
                all_failed_since = now
            elif now - all_failed_since >= self._stall_timeout:
                raise self._workers_lost(failed, now - all_failed_since)
            time.sleep(_JOIN_POLL_SECONDS)

    def fit(self, train_data, **kwargs):
        """See `Trainer.fit`; `steps_per_loop` closures are scheduled, then
        joined, per loop (losses fetched, logs, evaluation, checkpoint).

        Raises:
          ParameterServerError: a parameter server died or is unreachable.
        """
        self._last_step = None
        try:
            return self._fit(train_data, **kwargs)
        except _PS_ERRORS as e:
            # Any read or write of a variable reports it, wherever in the
            # loop it happens first.
            raise self._ps_error(e, self._last_step) from e

    def _fit(self, train_data, *, steps, global_batch_size, eval_data,
             eval_every, checkpoint_every, callbacks, actions, verbose,
             seed=0):
        trainer = self._trainer
        self._check_train_data(train_data, global_batch_size)
        step_fn = self._build_step(steps, global_batch_size)
        checkpointer = None
        if trainer.model_dir:
            checkpointer = checkpoints_lib.Checkpointer(
                trainer.model_dir, self.strategy, model=trainer.model,
                optimizer=trainer.optimizer)
            position = checkpointer.restore()
            if position is not None:
                self.steps_done.assign(position.step)
                self._sync_step()
                if verbose:
                    trainer._print(f"restored {checkpointer.restored_path} "
                                   f"at step {trainer.step}")
        try:
            iterator = self._per_worker_iterator(
                train_data, global_batch_size, seed,
                examples_done=trainer.step * global_batch_size)
            return self._loop(iterator, step_fn, checkpointer, steps=steps,
                              global_batch_size=global_batch_size,
                              eval_data=eval_data, eval_every=eval_every,
                              checkpoint_every=checkpoint_every,
                              callbacks=callbacks, actions=actions,
                              verbose=verbose)
        finally:
            if checkpointer is not None:
                checkpointer.close()  # the chief's model_dir lock

    def _loop(self, iterator, step_fn, checkpointer, *, steps,
              global_batch_size, eval_data, eval_every, checkpoint_every,
              callbacks, actions, verbose):
        # The synchronous Trainer's controller and actions: only the inner
        # loop differs (closures scheduled and joined instead of one
        # tf.function over the replicas).
        trainer = self._trainer
        callback_list = keras.callbacks.CallbackList(list(callbacks),
                                                     model=trainer.model)
        trainer.model.stop_training = False
        history = {key: [] for key in (
            "step", "loss", "step_loss", "steps_per_sec", "examples_per_sec",
            "retried_closures", "reattempted_on_ps", "lost_updates",
            *[m.name for m in trainer.metrics])}

        def train_loop(start, n):
            for metric in trainer.metrics:
                metric.reset_state()
            callback_list.on_train_batch_begin(start)
            retried_before = self.retries.value()
            began = time.perf_counter()
            remote = [self.coordinator.schedule(step_fn, args=(
                iterator, tf.constant(start + i, tf.int32)))
                      for i in range(n)]
            self._join()
            losses = np.array([float(r.fetch()) for r in remote])
            # Counted inside the ledger's claims on the ps: a closure
            # applied twice would show here (history["step"]).
            step = self._last_step = self._sync_step()
            elapsed = time.perf_counter() - began
            skipped = numerics.check_losses(
                losses, first_step=start, on_nonfinite=numerics.mode_for(
                    trainer.optimizer, trainer._on_nonfinite))
            counts = self.ledger.counts()
            logs = {"loss": float(losses.mean()),
                    **{m.name: float(m.result()) for m in trainer.metrics}}
            history["step"].append(step)
            history["step_loss"].extend(losses.tolist())
            history["retried_closures"].append(self.retries.value())
            history["reattempted_on_ps"].append(
                int(np.sum(counts["attempts"] > 1)))
            lost_before = (history["lost_updates"] or [0])[-1]
            history["lost_updates"].append(ClosureLedger.lost(counts))
            logs_and_speed = {
                **logs, "steps_per_sec": n / elapsed,
                "examples_per_sec": n * global_batch_size / elapsed}
            for key, value in logs_and_speed.items():
                history[key].append(value)
            if skipped:
                trainer._print(f"skipped non-finite update(s) {skipped}")
            if (verbose and self.retries.available and
                    self.retries.value() > retried_before):
                trainer._print(
                    f"retried closures {self.retries.value()} (a worker "
                    "failed; its closures ran again on the others)")
            if history["lost_updates"][-1] > lost_before:
                trainer._print(
                    f"lost updates {history['lost_updates'][-1]} (a worker "
                    "died while its update was landing on the parameter "
                    "servers; none is applied twice)")
            callback_list.on_train_batch_end(start + n - 1, logs)
            return controller_lib.LoopResult(
                step=start + n, steps=steps, at_end=False, losses=losses,
                logs=logs_and_speed)

        trainer._run_controller(
            train_loop, callback_list, history, steps=steps,
            eval_data=eval_data, eval_every=eval_every, actions=actions,
            checkpointer=checkpointer, checkpoint_every=checkpoint_every,
            batch=global_batch_size, verbose=verbose,
            preemption_watcher=_ChiefPreemption(
                getattr(trainer, "_preemption", None)))
        callback_list.on_train_end(history)
        return history

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
        trainer = self._trainer
        if self._eval_fn is None:
            @tf.function
            def run_eval(dataset):
                for batch in dataset:
                    trainer._eval_step(batch)
            self._eval_fn = run_eval
        for metric in (trainer._eval_loss, *trainer.metrics):
            metric.reset_state()
        try:
            self._eval_fn(eval_data)
        except _PS_ERRORS as e:
            raise self._ps_error(e, self._last_step) from e
        return {m.name: float(m.result())
                for m in (trainer._eval_loss, *trainer.metrics)}
