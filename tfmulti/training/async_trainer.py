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
has an id and a `ClosureLedger` on the parameter servers counts, per id, the
attempts that ran and the updates applied; the update runs in one
conditional ON the parameter server, after all gradients arrived, and only
if that id has applied none yet. So a retried closure is never applied twice;
`RetryCounter` counts the coordinator's retries.

Keras 3's `model.fit` does not run under this strategy
(keras-team/keras#18624; BUILD_NOTES, issue 16); Keras 3 models, optimizers
and metrics do.
"""

from __future__ import annotations

import sys
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

from tfmulti import cluster as cluster_lib
from tfmulti import exit_codes, parameter_server
from tfmulti.data import pipeline as pipeline_lib
from tfmulti.training import checkpoints as checkpoints_lib
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import loop as loop_lib
from tfmulti.training import numerics
from tfmulti.training import step as step_lib
from tfmulti.training import summaries

# The errors through which the coordinator reports a lost parameter server
# (workers are retried and never surface).
_PS_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
              tf.errors.CancelledError, tf.errors.InternalError,
              tf.errors.UnknownError, tf.errors.DeadlineExceededError)


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


class ClosureLedger:
    """Per-closure counters on the parameter servers.

    `attempts[i]` counts the executions of closure `i` that started (more
    than one: the coordinator retried it after a worker failed);
    `applied[i]` counts its updates applied to the variables (at most one,
    by construction of `guarded`).

    Args:
      strategy: the ParameterServerStrategy.
      size: the number of closure ids (steps of the job).
    """

    def __init__(self, strategy, size: int):
        self.size = size
        with strategy.scope():
            self.attempts = tf.Variable(tf.zeros([size], tf.int32),
                                        trainable=False,
                                        name="closure_attempts")
            self.applied = tf.Variable(tf.zeros([size], tf.int32),
                                       trainable=False,
                                       name="closure_applied")

    def count_attempt(self, closure_id):
        self.attempts.scatter_nd_add([[closure_id]], [1])

    def guarded(self, closure_id, apply_fn, inputs):
        """Runs `apply_fn(inputs)` unless closure `closure_id` applied one.

        Placed on the parameter server that holds the ledger; the
        predicate waits for every input (the gradients) to arrive there, so
        no update starts before all have and none depends on the worker
        staying alive.
        """
        with tf.device(self.applied.device):
            # Every input on this device BEFORE the predicate is read.
            # TensorFlow lowers tf.cond to Switch/Merge, whose branch ops
            # each start as soon as their own input arrives: measured, a
            # worker SIGKILLed mid-send left some updates (and the step
            # count) applied and the ledger at 0, so the retry applied
            # them again (one closure counted twice, 151 steps after 150).
            arrived = [tf.identity(t) for t in
                       tf.nest.flatten(inputs, expand_composites=True)]
            with tf.control_dependencies(arrived):
                fresh = tf.equal(self.applied[closure_id], 0)

            def apply():
                with tf.control_dependencies([apply_fn(inputs)]):
                    self.applied.scatter_nd_add([[closure_id]], [1])
                return tf.constant(True)

            return tf.cond(fresh, apply, lambda: tf.constant(False))

    def counts(self) -> dict:
        """{"attempts": array, "applied": array}, read from the ps."""
        return {"attempts": self.attempts.numpy(),
                "applied": self.applied.numpy()}


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
        self._cluster = cluster_lib.of_strategy(self.strategy)
        with self.strategy.scope():
            # Updates applied, counted inside the guarded update on the ps
            # (the Trainer's own count is a Python int, set from this).
            self.steps_applied = tf.Variable(0, dtype=tf.int64,
                                             trainable=False,
                                             name="async_steps_applied")
        self.ledger = None
        self._step_fn = None
        self._eval_fn = None
        self._source = self._iterator = None
        self._last_step = None

    # -- data ---------------------------------------------------------------

    def _per_worker_iterator(self, dataset_fn, global_batch_size, seed):
        if dataset_fn is self._source:
            return self._iterator
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
            offset = tf.where(size > 0, size * index // num_workers, 0)
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
        trainer.optimizer.apply(grads, trainer.model.trainable_variables)
        self.steps_applied.assign_add(1)

    def _build_step(self, steps, global_batch_size):
        if self.ledger is not None and self.ledger.size == steps:
            return self._step_fn
        self.ledger = ClosureLedger(self.strategy, steps)
        compute_loss = self._trainer._compute_loss_fn(global_batch_size)
        strategy, ledger = self.strategy, self.ledger

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
            ledger.guarded(closure_id, apply, grads)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, loss,
                                   axis=None)

        self._step_fn = step_fn
        return step_fn

    # -- fit ----------------------------------------------------------------

    def _sync_step(self) -> int:
        self._trainer._steps_done = int(self.steps_applied.numpy())
        return self._trainer.step

    def _ps_error(self, error, step):
        model_dir = self._trainer.model_dir
        latest = tf.train.latest_checkpoint(model_dir) if model_dir else None
        resume = (f"the chief resumes from its latest checkpoint {latest!r}"
                  if latest else "there is no checkpoint to resume from "
                  "(pass `model_dir` and `checkpoint_every`)")
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
        if actions:
            raise ValueError(
                f"`actions` is {list(actions)!r} but under ParameterServer"
                "Strategy the Trainer's asynchronous loop runs no controller "
                "actions. Use Keras callbacks (their batch hooks run once per "
                "loop), or pass actions=().")
        trainer = self._trainer
        iterator = self._per_worker_iterator(train_data, global_batch_size,
                                             seed)
        step_fn = self._build_step(steps, global_batch_size)
        checkpointer = None
        if trainer.model_dir:
            checkpointer = checkpoints_lib.Checkpointer(
                trainer.model_dir, self.strategy, model=trainer.model,
                optimizer=trainer.optimizer)
            position = checkpointer.restore()
            if position is not None:
                self.steps_applied.assign(position.step)
                self._sync_step()
                if verbose:
                    trainer._print(f"restored {checkpointer.restored_path} "
                                   f"at step {trainer.step}")
        try:
            return self._loop(iterator, step_fn, checkpointer, steps=steps,
                              global_batch_size=global_batch_size,
                              eval_data=eval_data, eval_every=eval_every,
                              checkpoint_every=checkpoint_every,
                              callbacks=callbacks, verbose=verbose)
        finally:
            if checkpointer is not None:
                checkpointer.close()  # the chief's model_dir lock

    def _loop(self, iterator, step_fn, checkpointer, *, steps,
              global_batch_size, eval_data, eval_every, checkpoint_every,
              callbacks, verbose):
        trainer = self._trainer
        train_writer = summaries.ScalarWriter(trainer.model_dir,
                                              self.strategy, "train")
        eval_writer = summaries.ScalarWriter(trainer.model_dir,
                                             self.strategy, "eval")
        callback_list = keras.callbacks.CallbackList(list(callbacks),
                                                     model=trainer.model)
        trainer.model.stop_training = False
        history = {key: [] for key in (
            "step", "loss", "step_loss", "steps_per_sec", "examples_per_sec",
            "retried_closures", "reattempted_on_ps",
            *[m.name for m in trainer.metrics])}
        callback_list.on_train_begin()
        step = last_saved = self._last_step = trainer.step
        while step < steps and not trainer.model.stop_training:
            start = step
            n = loop_lib.loop_length(
                start, steps=steps, steps_per_loop=trainer._steps_per_loop,
                eval_every=eval_every if eval_data is not None else None)
            for metric in trainer.metrics:
                metric.reset_state()
            callback_list.on_train_batch_begin(start)
            began = time.perf_counter()
            remote = [self.coordinator.schedule(step_fn, args=(
                iterator, tf.constant(start + i, tf.int32)))
                      for i in range(n)]
            self.coordinator.join()
            losses = np.array([float(r.fetch()) for r in remote])
            step = self._last_step = self._sync_step()
            elapsed = time.perf_counter() - began
            skipped = numerics.check_losses(
                losses, first_step=start, on_nonfinite=numerics.mode_for(
                    trainer.optimizer, trainer._on_nonfinite))
            counts = self.ledger.counts()
            logs = {"loss": float(losses.mean()),
                    **{m.name: float(m.result()) for m in trainer.metrics}}
            speed = {"steps_per_sec": n / elapsed,
                     "examples_per_sec": n * global_batch_size / elapsed}
            history["step"].append(step)
            history["step_loss"].extend(losses.tolist())
            history["retried_closures"].append(self.retries.value())
            history["reattempted_on_ps"].append(
                int(np.sum(counts["attempts"] > 1)))
            for key, value in {**logs, **speed}.items():
                history[key].append(value)
            train_writer.write(step, {**logs, **speed})
            if skipped:
                trainer._print(f"skipped non-finite update(s) {skipped}")
            if verbose:
                trainer._print(
                    f"step {step}/{steps} " + " ".join(
                        f"- {k} {v:.4f}" for k, v in logs.items()) +
                    f" - {speed['steps_per_sec']:.1f} steps/s - retried "
                    f"closures {history['retried_closures'][-1]}")
            callback_list.on_train_batch_end(step - 1, logs)
            at_end = step >= steps or trainer.model.stop_training
            if eval_data is not None and (at_end or (
                    eval_every is not None and step % eval_every == 0)):
                results = self.evaluate(eval_data)
                history.setdefault("val_step", []).append(step)
                for key, value in results.items():
                    history.setdefault(f"val_{key}", []).append(value)
                eval_writer.write(step, results)
                if verbose:
                    trainer._print(f"eval at step {step} " + " ".join(
                        f"- {k} {v:.4f}" for k, v in results.items()))
            preempted = getattr(trainer, "_preemption", None)
            preempted = preempted is not None and preempted.signalled
            if checkpointer is not None and (at_end or preempted or (
                    checkpoint_every is not None and
                    step - last_saved >= checkpoint_every)):
                checkpointer.save(step)
                last_saved = step
            if preempted:
                trainer._print(f"preempted: saved the checkpoint of step "
                               f"{step}; exiting with code "
                               f"{exit_codes.PREEMPTED}")
                sys.exit(exit_codes.PREEMPTED)
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
