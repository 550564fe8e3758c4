"""Fault-tolerant Keras `fit`: a thin adapter over tfmulti's one checkpoint
layer (`tfmulti.training.checkpoints`), plus the chief-only callback list.

`BackupAndRestore` saves the same checkpoints as the Trainer (weights,
optimizer and position, `ckpt-<step>`), so a job resumes under either entry
point; the layer gives the chief-only writes with worker temporary
directories, the fallback to the newest intact checkpoint, the refusal to
save non-finite weights and the `model_dir` lock. Keras 3's own
BackupAndRestore (checked up to 3.15) has no chief logic, writes weights and
metadata as two non-atomic files, and with `save_freq=N` reruns the
interrupted epoch from its first batch on top of weights that already saw
part of it.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil

import keras

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti.keras import fit_state
from tfmulti.keras import pipelined as pipelined_lib
from tfmulti.training import checkpoints as checkpoints_lib
from tfmulti.training import loop as loop_lib
from tfmulti.training import numerics, preemption, resume
from tfmulti.training import worker_state as worker_state_lib
from tfmulti.rundir import worker_temp_dir

BACKUP_DIR = "backup"
CHECKPOINT_DIR = "checkpoints"
LOG_DIR = "logs"
_RESERVED_CHECKPOINT_OPTIONS = ("filepath",)
# Saved in a backup's `Position.extra`: the epoch length it counts in.
_STEPS_PER_EPOCH = "steps_per_epoch"
_RESERVED_TENSORBOARD_OPTIONS = ("log_dir",)

__all__ = ["BackupAndRestore", "callbacks", "worker_temp_dir"]


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state and resumes `fit` from it after a failure.

    Each backup is a checkpoint of tfmulti's one format in `backup_dir`
    (model, optimizer, step, epoch and batch). On restart `fit` resumes at
    the saved epoch and, after a mid-epoch backup (`save_freq=N`), skips the
    batches of that epoch already trained, so the run ends with the weights
    of an uninterrupted one, provided the input yields the same batches in
    the same order in every run. A checkpoint the Trainer wrote (no epoch)
    resumes at epoch, batch = divmod(step, steps per epoch). Metrics of the
    resumed epoch cover only the batches trained after the restart.

    Every worker restores from `backup_dir` (the chief's: on a filesystem
    all workers read) and takes part in every save; only the chief writes
    there. Before resuming, the workers check with one all-reduce that they
    resume at the same point.

    Args:
      backup_dir: the chief's backup directory.
      save_freq: "epoch", or an int N: back up every N batches and at the
        end of every epoch. With `steps_per_execution` K > 1, Keras reports
        batches K at a time; a multiple of K backs up every N batches.
      delete_on_end: remove the backups when `fit` completes.
      save_on_preemption: on SIGTERM to any worker, all workers agree (one
        small all-reduce per batch under several workers) to back up the
        current batch and exit with `tfmulti.exit_codes.PREEMPTED`.

    A batch whose (cross-replica) loss is NaN or inf raises
    `NonFiniteLossError` naming the epoch and batch, and no backup of
    non-finite weights is ever written.
    """

    def __init__(self, backup_dir, *, save_freq="epoch", delete_on_end=True,
                 save_on_preemption=True):
        super().__init__()
        if not backup_dir:
            raise ValueError(f"`backup_dir` should be a directory path, got "
                             f"{backup_dir!r}.")
        _check_freq("save_freq", save_freq)
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_on_end = delete_on_end
        self.save_on_preemption = save_on_preemption
        self.restored = None
        self._epoch = 0
        self._done = 0
        self._skipper = None
        self._watcher = None
        self._checkpointer = None

    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                f"BackupAndRestore needs a built model, and {model.name} is "
                "not built. Build it (call it on a batch or give it an Input) "
                "before `fit`.")
        strategy = model.distribute_strategy
        if model.optimizer is not None and not model.optimizer.built:
            with strategy.scope():
                model.optimizer.build(model.trainable_variables)
        # A pipelined model saves its stage optimizers in the unsplit
        # optimizer's format, as the Trainer does.
        optimizer, after_restore = pipelined_lib.checkpoint_optimizer(model)
        # `fit` made the train function (and its reducer) before this.
        reducer = fit_state.reducer_of(model)
        sharding = fit_state.sharding_of(model)
        if sharding is not None:
            # The backup holds the unsharded optimizer, as the Trainer's.
            after_restore = functools.partial(sharding.load_from,
                                              model.optimizer)
        self._checkpointer = checkpoints_lib.Checkpointer(
            self.backup_dir, strategy, keep=2, model=model,
            before_save=sharding and functools.partial(sharding.assign_to,
                                                       model.optimizer),
            optimizer=optimizer, worker_state=(
                worker_state_lib.for_training(strategy, reducer, model,
                                              model.optimizer)
                if reducer is not None and after_restore is None else None),
            **(reducer.trackables() if reducer is not None else {}))
        try:
            position = resume.restore(
                self._checkpointer, strategy,
                after=after_restore and (lambda position: after_restore()))
        except BaseException:
            self._close()
            raise
        epoch, batch = self._epoch_and_batch(position)
        self.restored = (epoch, batch) if (epoch, batch) != (0, 0) else None
        if position is not None and position.changes_to(self._position(0, 0)):
            print(resume.restored_line(self._checkpointer, position,
                                       self._position(0, 0)), flush=True)
        compat.set_initial_epoch(model, epoch)
        self._epoch = epoch
        stream = fit_state.stream_of(model)
        stream_end = None
        if stream is not None:
            # An endless stream runs on across epochs (steps_per_epoch is
            # set): epoch `epoch` began `epoch` epochs into it, which a
            # restarted stream must skip first (Keras itself would read its
            # first batches again).
            per_step = fit_state.batches_per_step(model)
            stream.skip_to(epoch * self.params["steps"] * per_step)
            stream_end = (epoch * self.params["steps"] + batch) * per_step
        if batch:
            self._skipper = _SkipBatches(model, batch, stream_end=stream_end)
            model.train_function = self._skipper
        if self.save_on_preemption:
            self._watcher = preemption.PreemptionWatcher(strategy).__enter__()

    def _epoch_and_batch(self, position):
        if position is None:
            return 0, 0
        steps = self.params.get("steps")
        saved_steps = position.extra.get(_STEPS_PER_EPOCH)
        if position.epoch is not None and saved_steps and steps and (
                saved_steps != steps):
            # Epochs of another length (a run continued with more steps):
            # the same number of batches in, counted in this fit's epochs.
            return divmod(position.epoch * saved_steps +
                          (position.batch or 0), steps)
        if position.epoch is not None:
            return position.epoch, position.batch or 0
        if not steps:
            raise ValueError(
                f"The checkpoint in {self.backup_dir!r} was written by the "
                f"Trainer at step {position.step}; to resume it with `fit`, "
                "pass `steps_per_epoch` so the step maps to an epoch.")
        return divmod(position.step, steps)

    def _position(self, epoch, batch):
        strategy = self.model.distribute_strategy
        return checkpoints_lib.Position(
            step=int(self.model.optimizer.iterations.numpy()), epoch=epoch,
            batch=batch, num_replicas=strategy.num_replicas_in_sync,
            batches_per_step=fit_state.batches_per_step(self.model),
            num_workers=cluster_lib.of_strategy(strategy).num_workers,
            extra={_STEPS_PER_EPOCH: self.params.get("steps")})

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        done = self._done = batch + 1
        if done == self.params.get("steps"):
            position = self._position(self._epoch + 1, 0)
        else:
            position = self._position(self._epoch, done)
        if self._skipper is None:
            preemption.save_and_exit_if_preempted(
                self._watcher, self._checkpointer, position,
                say=self._say)
        elif self._watcher is not None and self._watcher.agreed():
            # Still skipping: the restored backup is the state to resume.
            self._close()
            preemption.exit_preempted(say=self._say)
        if self._skipper is not None:
            # Until the skipped batches are behind, the weights are still
            # the restored ones: nothing new to back up.
            if not self._skipper.remaining:
                self._unwrap()
            return
        loss = (logs or {}).get("loss")
        if loss is not None:
            numerics.check_losses(
                [float(loss)], first_step=done - 1,
                where=lambda _: f"epoch {self._epoch} batch {done}",
                fix="clipping (`global_clipnorm`)")
        if (self.save_freq != "epoch" and done % self.save_freq == 0 and
                done != self.params.get("steps")):
            self._checkpointer.save(position)

    def on_epoch_end(self, epoch, logs=None):
        self._unwrap()
        steps = self.params.get("steps")
        if self.model.stop_training and steps and self._done < steps:
            # Stopped inside the epoch (`model.stop_training`): resume there.
            self._checkpointer.save(self._position(epoch, self._done))
        else:
            self._checkpointer.save(self._position(epoch + 1, 0))

    def _say(self, line):
        if self._checkpointer is not None and self._checkpointer.is_chief:
            print(line, flush=True)

    def _close(self):
        if self._watcher is not None:
            self._watcher.__exit__(None, None, None)
            self._watcher = None
        if self._checkpointer is not None:
            self._checkpointer.close()

    def on_train_end(self, logs=None):
        self._close()
        self._unwrap()
        # Keras never resets it: a second `fit` would start there too.
        compat.set_initial_epoch(self.model, None)
        if self.delete_on_end:
            self._checkpointer.delete_worker_state()
        if self.delete_on_end and self._checkpointer.is_chief:
            self._checkpointer.delete_all()
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass   # other files of the user's

    def _unwrap(self):
        if self._skipper is not None:
            if self.model.train_function is self._skipper:
                self.model.train_function = self._skipper.function
            self._skipper = None


def _check_freq(name, value):
    if value != "epoch" and (isinstance(value, bool) or
                             not isinstance(value, int) or value < 1):
        raise ValueError(
            f"`{name}` is {value!r}; use 'epoch' or a positive int number "
            "of batches between backups.")


class _SkipBatches:
    """Stands in for `model.train_function` while batches are skipped.

    Each call consumes what one real call would (`steps_per_execution`
    batches) from the iterator without training, with the Trainer's skip
    (`loop.skip_batches`); other attributes are the real function's. On a
    kept endless stream it reads up to the backup's place in the stream
    (`stream_end`, in batches; None without one) instead: a `fit` continued
    in this process from an older backup finds the stream already past it,
    and reads nothing more (counting would skip batches no run has trained
    on).
    """

    def __init__(self, model, count, *, stream_end):
        self.function = model.train_function
        # Counted in batches: a step of a tfmulti.keras.distributed model
        # with gradient accumulation reads several.
        per_step = fit_state.batches_per_step(model)
        self.remaining = count * per_step
        self._stream = fit_state.stream_of(model)
        self._stream_end = stream_end
        self._per_call = max(1, int(getattr(model, "steps_per_execution",
                                            1))) * per_step

    def __call__(self, iterator):
        n = min(self._per_call, self.remaining)
        self.remaining -= n
        if self._stream is not None and iterator is self._stream.iterator():
            self._stream.skip_to(self._stream_end - self.remaining)
        else:
            loop_lib.skip_batches(iterator, n)
        return {}

    def __getattr__(self, name):
        return getattr(self.function, name)


class _RemoveDirectory(keras.callbacks.Callback):
    """Removes a non-chief worker's temporary directory when `fit` ends.

    Last in the list, so the other callbacks have closed their files.
    """

    def __init__(self, path):
        super().__init__()
        self.path = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)

    def on_train_end(self, logs=None):
        shutil.rmtree(self.path, ignore_errors=True)


def _check_options(name, options, reserved):
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"`{name}` should be a dict of keyword arguments, "
                         f"got {options!r}.")
    clash = sorted(set(options) & set(reserved))
    if clash:
        raise ValueError(
            f"`{name}` sets {clash}, which tfmulti derives from `model_dir` "
            "so that only the chief writes there. Remove them.")
    return dict(options)


def callbacks(model_dir, *, backup: bool = True, checkpoint: bool = True,
              tensorboard: bool = True, backup_freq="epoch",
              keep_backup: bool = False,
              checkpoint_name: str = "model-{epoch:04d}.keras",
              checkpoint_options: dict | None = None,
              tensorboard_options: dict | None = None,
              cluster: cluster_lib.ClusterConfig | None = None,
              temp_root: str | None = None) -> list[keras.callbacks.Callback]:
    """The callbacks for a fault-tolerant distributed `model.fit`.

    Every worker gets the same callbacks and takes part in every save; the
    chief writes to `model_dir`, the others to `worker_temp_dir(model_dir)`,
    removed when `fit` ends. Layout of `model_dir`:
    `backup/` (removed when `fit` completes), `checkpoints/<checkpoint_name>`
    (Keras ModelCheckpoint), `logs/` (TensorBoard). A `.keras` checkpoint
    written by a multi-worker job loads in a single process.

    Args:
      model_dir: the job's output directory, shared by all workers (they
        restore from the chief's backup in it) on a filesystem with atomic
        renames (local or NFS, not an object store).
      backup: add `BackupAndRestore` (resume after a failure).
      checkpoint: add `keras.callbacks.ModelCheckpoint`.
      tensorboard: add `keras.callbacks.TensorBoard`.
      backup_freq: "epoch", or an int N: back up every N batches too, and
        resume mid-epoch (see `BackupAndRestore`).
      keep_backup: keep the last backup when `fit` completes, so that a
        later `fit` with more `epochs` continues from it (the default
        removes it, as Keras's BackupAndRestore does).
      checkpoint_name: file name pattern in `checkpoints/`; ends in
        ".keras" (whole model) or ".weights.h5" (with
        checkpoint_options={"save_weights_only": True}).
      checkpoint_options: other ModelCheckpoint arguments (monitor,
        save_best_only, save_freq, ...).
      tensorboard_options: other TensorBoard arguments (update_freq,
        histogram_freq, ...).
      cluster: this process's cluster; default `tfmulti.cluster_config()`.
      temp_root: where non-chief workers make their temporary directory;
        default the system's temporary directory.

    Returns:
      A list of callbacks for `model.fit(callbacks=...)`; put callbacks of
      your own after them.

    Raises:
      ValueError: bad arguments; the message names the argument.
    """
    if not model_dir:
        raise ValueError(f"`model_dir` should be a directory path, got "
                         f"{model_dir!r}.")
    if "/" in checkpoint_name or os.sep in checkpoint_name:
        raise ValueError(
            f"`checkpoint_name` is {checkpoint_name!r}; it is a file name "
            f"inside `model_dir`/{CHECKPOINT_DIR}, without directories.")
    _check_freq("backup_freq", backup_freq)
    checkpoint_options = _check_options(
        "checkpoint_options", checkpoint_options,
        _RESERVED_CHECKPOINT_OPTIONS)
    tensorboard_options = _check_options(
        "tensorboard_options", tensorboard_options,
        _RESERVED_TENSORBOARD_OPTIONS)
    model_dir = os.fspath(model_dir)
    cluster = cluster or cluster_lib.cluster_config()
    if cluster.is_chief:
        write_dir, temp_dir = model_dir, None
    else:
        temp_dir = worker_temp_dir(model_dir, cluster=cluster,
                                   temp_root=temp_root)
        # Left by a killed run with this rank: nothing in it is needed.
        shutil.rmtree(temp_dir, ignore_errors=True)
        write_dir = temp_dir
    result = []
    if backup:
        # The checkpoint layer sends a non-chief's writes to its own
        # temporary directory.
        result.append(BackupAndRestore(os.path.join(model_dir, BACKUP_DIR),
                                       save_freq=backup_freq,
                                       delete_on_end=not keep_backup))
    if checkpoint:
        result.append(keras.callbacks.ModelCheckpoint(
            os.path.join(write_dir, CHECKPOINT_DIR, checkpoint_name),
            **checkpoint_options))
    if tensorboard:
        result.append(keras.callbacks.TensorBoard(
            os.path.join(write_dir, LOG_DIR), **tensorboard_options))
    if temp_dir is not None:
        result.append(_RemoveDirectory(temp_dir))
    return result
