"""The callbacks a distributed `model.fit` wants, with chief-only outputs.

Every worker of a MultiWorkerMirroredStrategy job runs every callback:
saving reads variables that may need collectives, so a chief that saves alone
can deadlock. Only the chief writes to `model_dir`; the other workers write
the same files to a private temporary directory that is removed when
training ends (and at interpreter exit after an error; a directory left by a
killed process is reused and removed by the next run).

Keras 3's own BackupAndRestore (checked up to 3.15) has no chief logic (every
worker writes the same file), writes weights and metadata as two separate
non-atomic files, and restores only the epoch: with `save_freq=N` it reruns
the interrupted epoch from its first batch on top of weights that already saw
part of it. `BackupAndRestore` here fixes all three.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti import exit_codes
from tfmulti.keras import fit as fit_lib
from tfmulti.training import numerics
from tfmulti.training import preemption

BACKUP_DIR = "backup"
CHECKPOINT_DIR = "checkpoints"
LOG_DIR = "logs"
_STATE = re.compile(r"^state-(\d+)$")
_WEIGHTS = "model.weights.h5"
_METADATA = "training_state.json"
_KEEP = 2
_RESERVED_CHECKPOINT_OPTIONS = ("filepath",)
_RESERVED_TENSORBOARD_OPTIONS = ("log_dir",)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state and resumes `fit` from it after a failure.

    Each backup is a directory `state-<n>` holding the weights (model and
    optimizer, including the step counter) and the position in training
    (epochs and batches done). It is written under a temporary name and
    renamed into place, so a process killed mid-write leaves nothing a
    resume would pick up; the newest two are kept and the older one is used
    if the newer cannot be read.

    On restart `fit` resumes at the saved epoch and, after a mid-epoch
    backup (`save_freq=N`), skips the batches of that epoch that were
    already trained (they are read from the input and not trained on), so
    the run ends with the weights of an uninterrupted one, provided the
    input yields the same batches in the same order in every run (no
    reshuffle that depends on how many epochs this process has seen).
    Metrics of the resumed epoch cover only the batches trained after the
    restart. Keras 3 `fit` has no initial step, so the skipping replaces
    `model.train_function` for those batches.

    With several workers every worker restores from `restore_dir` (the
    chief's directory, which must be on a filesystem all workers can read)
    and writes to its own `backup_dir`. Before resuming, the workers check
    with one all-reduce that they resume at the same point, and fail with an
    error instead of deadlocking if they do not.

    Args:
      backup_dir: where this process writes its backups.
      restore_dir: where to read backups from; default `backup_dir`.
      save_freq: "epoch", or an int N: back up every N batches and at the
        end of every epoch. With `steps_per_execution` K > 1, Keras reports
        batches K at a time; a multiple of K backs up every N batches.
      delete_on_end: remove `backup_dir` when `fit` completes.
      num_workers: training processes of the job (1 skips the agreement
        check).
      save_on_preemption: on SIGTERM to any worker, all workers agree (one
        small all-reduce per batch under several workers) to back up the
        current batch and exit with `tfmulti.exit_codes.PREEMPTED`.

    A batch whose (cross-replica) loss is NaN or inf raises
    `NonFiniteLossError` naming the epoch and batch, and no backup of
    non-finite weights is ever written.
    """

    def __init__(self, backup_dir, *, restore_dir=None, save_freq="epoch",
                 delete_on_end=True, num_workers=1,
                 save_on_preemption=True):
        super().__init__()
        if not backup_dir:
            raise ValueError(f"`backup_dir` should be a directory path, got "
                             f"{backup_dir!r}.")
        _check_freq("save_freq", save_freq)
        self.backup_dir = os.fspath(backup_dir)
        self.restore_dir = os.fspath(restore_dir or backup_dir)
        self.save_freq = save_freq
        self.delete_on_end = delete_on_end
        self.num_workers = num_workers
        self.restored = None
        self.save_on_preemption = save_on_preemption
        self._epoch = 0
        self._skipper = None
        self._watcher = None

    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                f"BackupAndRestore needs a built model, and {model.name} is "
                "not built. Build it (call it on a batch or give it an Input) "
                "before `fit`.")
        if model.optimizer is not None and not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        epoch, batch = self._restore()
        if self.num_workers > 1:
            _check_workers_agree(model.distribute_strategy, epoch, batch)
        self.restored = (epoch, batch) if (epoch, batch) != (0, 0) else None
        if epoch:
            compat.set_initial_epoch(model, epoch)
        self._epoch = epoch
        if batch:
            self._skipper = _SkipBatches(model, batch)
            model.train_function = self._skipper
        if self.save_on_preemption:
            self._watcher = preemption.PreemptionWatcher(
                model.distribute_strategy).__enter__()

    def _restore(self):
        failures = []
        for path in _state_dirs(self.restore_dir)[::-1]:
            try:
                with open(os.path.join(path, _METADATA)) as f:
                    state = json.load(f)
                self.model.load_weights(os.path.join(path, _WEIGHTS))
            except (OSError, ValueError, KeyError) as e:
                failures.append(f"{path}: {e}")
                continue
            return int(state["epoch"]), int(state["batch"])
        if failures:
            raise RuntimeError(
                f"No backup in {self.restore_dir} could be read: "
                f"{'; '.join(failures)}. Remove the directory to start "
                "training from scratch.")
        return 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if self._watcher is not None and self._watcher.agreed():
            self._stop_preempted(done)
        if self._skipper is not None:
            # Until the skipped batches are behind, the weights are still
            # the restored ones: nothing new to back up.
            if not self._skipper.remaining:
                self._unwrap()
            return
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            raise numerics.NonFiniteLossError(
                f"The training loss is {float(loss)} at epoch {self._epoch} "
                f"batch {done}; training stopped before backing up these "
                f"weights, so {self.restore_dir} still holds the last finite "
                "state. Usual fixes: a lower learning rate, clipping "
                "(`global_clipnorm`), or check the input for NaN/inf.",
                step=done)
        if (self.save_freq != "epoch" and done % self.save_freq == 0 and
                done != self.params.get("steps")):
            self._save(self._epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        self._unwrap()
        self._save(epoch + 1, 0)

    def _stop_preempted(self, done):
        if self._skipper is None:
            if done == self.params.get("steps"):
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, done)
        print(f"preempted: backed up epoch {self._epoch} batch {done}; "
              f"exiting with code {exit_codes.PREEMPTED}", flush=True)
        self._close_watcher()
        sys.exit(exit_codes.PREEMPTED)

    def _close_watcher(self):
        if self._watcher is not None:
            self._watcher.__exit__(None, None, None)
            self._watcher = None

    def on_train_end(self, logs=None):
        self._close_watcher()
        self._unwrap()
        # Keras never resets it: a second `fit` would start there too.
        compat.set_initial_epoch(self.model, None)
        if self.delete_on_end:
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    def _unwrap(self):
        if self._skipper is not None:
            if self.model.train_function is self._skipper:
                self.model.train_function = self._skipper.function
            self._skipper = None

    def _save(self, epoch, batch):
        variables = list(self.model.weights) + list(
            getattr(self.model.optimizer, "variables", None) or [])
        bad = numerics.nonfinite_variables(variables)
        if bad:
            raise ValueError(
                f"Refusing to back up epoch {epoch} batch {batch} to "
                f"`backup_dir` {self.backup_dir!r}: {len(bad)} variable(s) "
                f"hold NaN or inf (first: {bad[0]!r}). The existing backup is "
                "the last finite state; fix the divergence and resume.")
        os.makedirs(self.backup_dir, exist_ok=True)
        existing = _state_dirs(self.backup_dir)
        number = _state_number(existing[-1]) + 1 if existing else 0
        final = os.path.join(self.backup_dir, f"state-{number}")
        partial = tempfile.mkdtemp(prefix=f".state-{number}.",
                                   dir=self.backup_dir)
        self.model.save_weights(os.path.join(partial, _WEIGHTS))
        with open(os.path.join(partial, _METADATA), "w") as f:
            json.dump({"epoch": epoch, "batch": batch}, f)
        os.replace(partial, final)
        for old in existing[:len(existing) + 1 - _KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        for name in os.listdir(self.backup_dir):
            # Partial backups of a process that was killed while writing.
            if name.startswith(".state-"):
                shutil.rmtree(os.path.join(self.backup_dir, name),
                              ignore_errors=True)


def _check_freq(name, value):
    if value != "epoch" and (isinstance(value, bool) or
                             not isinstance(value, int) or value < 1):
        raise ValueError(
            f"`{name}` is {value!r}; use 'epoch' or a positive int number "
            "of batches between backups.")


class _SkipBatches:
    """Stands in for `model.train_function` while batches are skipped.

    Each call consumes what one real call would (`steps_per_execution`
    batches) from the iterator without training; other attributes are the
    real function's.
    """

    def __init__(self, model, count):
        self.function = model.train_function
        # Counted in batches: a step of a tfmulti.keras.distributed model
        # with gradient accumulation reads several.
        per_step = fit_lib.batches_per_step(model)
        self.remaining = count * per_step
        self._per_call = max(1, int(getattr(model, "steps_per_execution",
                                            1))) * per_step

    def __call__(self, iterator):
        for _ in range(min(self._per_call, self.remaining)):
            next(iterator)
            self.remaining -= 1
        return {}

    def __getattr__(self, name):
        return getattr(self.function, name)


def _state_number(path):
    return int(_STATE.match(os.path.basename(path)).group(1))


def _state_dirs(directory):
    """Complete backups in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    paths = [os.path.join(directory, n) for n in os.listdir(directory)
             if _STATE.match(n)]
    return sorted(paths, key=_state_number)


def _check_workers_agree(strategy, epoch, batch):
    # ReduceOp has no MIN/MAX: the positions agree iff their variance over
    # the replicas is zero, which every worker computes identically from the
    # sums. float64 keeps the squares exact.
    position = tf.constant([1, epoch, batch, epoch**2, batch**2], tf.float64)

    @tf.function
    def all_sums():
        return strategy.run(lambda: tf.distribute.get_replica_context(
        ).all_reduce(tf.distribute.ReduceOp.SUM, position))

    n, e, b, e2, b2 = strategy.experimental_local_results(
        all_sums())[0].numpy()
    if n * e2 != e * e or n * b2 != b * b:
        raise RuntimeError(
            f"This worker would resume at epoch {epoch}, batch {batch}, but "
            f"the {n:.0f} replicas average epoch {e / n:g}, batch {b / n:g}: "
            "the workers do not read the same backup. Put `model_dir` on a "
            "filesystem every worker can read (NFS, GCS, ...).")


def worker_temp_dir(model_dir, *, cluster=None, temp_root=None) -> str:
    """The temporary directory a non-chief worker writes instead of `model_dir`.

    The name depends only on `model_dir` and the worker's rank, so a run
    restarted after a crash finds and removes what the killed one left.
    """
    cluster = cluster or cluster_lib.cluster_config()
    digest = hashlib.sha256(os.path.abspath(
        os.fspath(model_dir)).encode()).hexdigest()[:12]
    return os.path.join(temp_root or tempfile.gettempdir(),
                        f"tfmulti-{digest}-worker{cluster.worker_rank}")


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
        result.append(BackupAndRestore(
            os.path.join(write_dir, BACKUP_DIR),
            restore_dir=os.path.join(model_dir, BACKUP_DIR),
            save_freq=backup_freq, num_workers=cluster.num_workers))
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
