"""The one checkpoint format of tfmulti: weights, optimizer and position.

Both entry points (the Trainer and Keras `fit` through
`tfmulti.keras.callbacks`) save a `tf.train.Checkpoint` of the model, the
optimizer and a `Position` (updates made, epoch and batch for `fit`, the
global batch, replicas and workers, and the `extra` state of later features)
as `ckpt-<step>` in one directory, so a job resumes under either.

Rules, each tested:
- Chief-only writes: under MultiWorkerMirroredStrategy saving may run
  collectives, so every worker saves (saving only on the chief can
  deadlock); non-chief workers write to `worker_temp_dir` and remove it.
- Integrity: TensorFlow checksums every tensor; a checkpoint that does not
  read back (bit rot, truncation, a save killed midway) is skipped and the
  newest intact one restored. The `checkpoint` state file and the directory
  name are not trusted (TensorFlow's `latest_checkpoint` globs the path, so
  a `model_dir` with `[` `]` never resumed): the directory listing is.
- Never a non-finite state: weights holding NaN or inf are refused, and
  rotation never removes the newest checkpoint saved at a finite loss.
- One writer: the chief holds `model_dir_lock.Lock` while it writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti.rundir import worker_temp_dir
from tfmulti.training import model_dir_lock, numerics

FORMAT = 1
_BASENAME = "ckpt"
_KEEP = 3
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Position:
    """Where training stands, saved with the weights.

    Attributes:
      step: optimizer updates made.
      examples: training examples consumed (all workers).
      epoch: Keras `fit` only: the epoch being trained (0-based).
      batch: Keras `fit` only: steps of `epoch` done.
      global_batch_size: examples per micro-batch over all replicas.
      batches_per_step: micro-batches per update (gradient accumulation).
      num_replicas: replicas in sync when saved.
      num_workers: worker processes when saved.
      loss_finite: whether the last loss before the save was finite.
      extra: JSON-able state of other features (e.g. their counters).
    """

    step: int = 0
    examples: int = 0
    epoch: int | None = None
    batch: int | None = None
    global_batch_size: int | None = None
    batches_per_step: int = 1
    num_replicas: int | None = None
    num_workers: int | None = None
    loss_finite: bool = True
    extra: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> "Position":
        state = json.loads(text)
        state.pop("format", None)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})

    def changes_to(self, now: "Position") -> list[str]:
        """What differs in the topology between this saved position and
        `now`, in words (empty when nothing does)."""
        said = []
        for name, what in (("num_workers", "workers"),
                           ("num_replicas", "replicas")):
            before, after = getattr(self, name), getattr(now, name)
            if None not in (before, after) and before != after:
                said.append(f"{what} {before} -> {after}")
        if said and self.global_batch_size and self.num_replicas and (
                now.num_replicas):
            said.append(
                f"global batch {self.global_batch_size} kept, per-replica "
                f"batch {self.global_batch_size // self.num_replicas} -> "
                f"{self.global_batch_size // now.num_replicas}")
        return said


class _PositionState(tf.train.experimental.PythonState):
    """The `Position`, inside the checkpoint (checksummed with it)."""

    def __init__(self):
        self.position = Position()

    def serialize(self):
        return self.position.to_json()

    def deserialize(self, string_value):
        value = string_value.numpy() if hasattr(string_value, "numpy") else (
            string_value)
        self.position = Position.from_json(
            value.decode() if isinstance(value, bytes) else value)


def read_position(prefix: str) -> Position | None:
    """The `Position` saved in checkpoint `prefix`, without restoring it;
    None if the checkpoint has none or cannot be read."""
    try:
        with compat.readable_checkpoint(prefix) as readable:
            reader = tf.train.load_checkpoint(readable)
            key = next(k for k in reader.get_variable_to_shape_map()
                       if k.startswith("position/"))
            return Position.from_json(reader.get_tensor(key).decode())
    except (StopIteration, ValueError, tf.errors.OpError):
        return None


class Checkpointer:
    """Saves and restores the one checkpoint format in `model_dir`.

    Args:
      model_dir: the job's checkpoint directory (the chief writes it; every
        worker reads it, so it must be on storage all workers see).
      strategy: the strategy (decides who is chief).
      keep: checkpoints kept (plus the newest saved at a finite loss).
      optional: names of `trackables` a checkpoint may lack (restored when
        present; `.missing` lists those the restored one lacked), e.g. the
        Trainer's data iterator in a checkpoint Keras `fit` wrote.
      worker_state: a `worker_state.WorkerState` every worker also saves
        (its own per-replica values); a checkpoint is then restored only
        with every worker's state for its step, unless the number of
        workers changed (elastic resume: the chief's values only).
      before_save: called by every worker before each save, to bring the
        trackables up to date (a sharded optimizer gathers its shards into
        the unsharded optimizer there), or None.
      **trackables: what to save besides the position, e.g. model=,
        optimizer=; later features add their own.
    """

    def __init__(self, model_dir: str, strategy, *, keep: int = _KEEP,
                 optional: tuple[str, ...] = (), worker_state=None,
                 before_save=None, **trackables):
        self._model_dir = os.fspath(model_dir)
        self._before_save = before_save
        self._worker_state = worker_state
        self._cluster = cluster_lib.of_strategy(strategy)
        self._chief = self._cluster.is_chief
        self._keep = keep
        self._trackables = trackables
        self._optional = tuple(optional)
        self.missing = ()
        self._state = _PositionState()
        self.checkpoint = tf.train.Checkpoint(position=self._state,
                                              **trackables)
        # Created now so that `write` saves it and `restore` finds it.
        _ = self.checkpoint.save_counter
        self.last_saved_step = None
        self._lock = None
        if self._chief:
            check_writable(self._model_dir)
            self._lock = model_dir_lock.acquire(self._model_dir)

    def close(self) -> None:
        """Releases the `model_dir` lock (the chief's)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def model_dir(self) -> str:
        return self._model_dir

    @property
    def is_chief(self) -> bool:
        """Whether this process writes `model_dir`."""
        return self._chief

    def delete_all(self) -> None:
        """Removes every checkpoint and the state file (the chief's)."""
        for _, prefix in self.checkpoints():
            _remove_checkpoint(prefix)
        for name in ("checkpoint",):
            try:
                os.remove(os.path.join(self._model_dir, name))
            except FileNotFoundError:
                pass

    def delete_worker_state(self) -> None:
        """Removes this worker's own states (every worker calls it; the
        chief's `delete_all` cannot: another worker may still be writing)."""
        if self._worker_state is not None:
            self._worker_state.remove_own(self._model_dir)

    def checkpoints(self) -> list[tuple[int, str]]:
        """`(step, prefix)` of the complete checkpoints, oldest first."""
        return compat.checkpoint_prefixes(self._model_dir,
                                          basename=_BASENAME)

    def restore(self) -> Position | None:
        """Restores the newest checkpoint that reads back intact.

        Returns:
          Its `Position` (also in `.restored_path`), or None if there is no
          checkpoint.

        Raises:
          ValueError: no checkpoint matches this model and optimizer, or
            none reads back.
        """
        self.restored_path = None
        failures = []
        for step, path in reversed(self.checkpoints()):
            per_worker = self._uses_worker_state(step, path)
            if per_worker is None:
                continue
            try:
                with compat.readable_checkpoint(path) as readable:
                    self._checkpoint_for(readable).restore(
                        readable).assert_existing_objects_matched()
                if per_worker:
                    self._worker_state.restore(self._model_dir, step)
            except (AssertionError, ValueError, tf.errors.OpError) as e:
                failures.append((path, e))
                continue
            for bad, e in failures:
                _log.warning("tfmulti: checkpoint %s does not read back "
                             "(%s); resumed from the older %s", bad,
                             str(e).strip()[:200], path)
            self.restored_path = path
            return self._state.position
        if not failures:
            return None
        path, e = failures[0]
        if all(isinstance(f, (AssertionError, ValueError))
               for _, f in failures):
            raise ValueError(
                f"`model_dir` {self._model_dir!r} holds the checkpoint "
                f"{path!r}, which does not match this model and optimizer "
                "(another architecture, layer sizes or optimizer), so it "
                "cannot be restored. Use a new `model_dir` for a new model, "
                "or delete the old checkpoints to start over. TensorFlow "
                f"said: {str(e).strip()[:400]}") from e
        raise ValueError(
            f"None of the {len(failures)} checkpoint(s) in `model_dir` "
            f"{self._model_dir!r} reads back: "
            + "; ".join(f"{p}: {type(f).__name__}: {str(f).strip()[:150]}"
                        for p, f in failures)
            + ". They are damaged (storage fault or a copy cut short); "
            "restore them from a backup, or use a new `model_dir` to start "
            "over.") from e

    def _uses_worker_state(self, step, path):
        """True: restore `path` with the workers' states; False: without
        (none kept, or another number of workers); None: skip it (a
        worker's state for it is missing: killed mid-save)."""
        state = self._worker_state
        if state is None:
            return False
        saved = read_position(path)
        if saved is not None and saved.num_workers not in (
                None, state.num_workers):
            _log.warning("tfmulti: %s was saved by %s workers, this job has "
                         "%s: each worker's own state (local SGD weights "
                         "and optimizer slots, error feedback) is dropped; "
                         "all resume from the chief's", path,
                         saved.num_workers, state.num_workers)
            return False
        if state.complete(self._model_dir, step):
            return True
        _log.warning("tfmulti: %s lacks a worker's state (a save cut "
                     "short); resuming from an older checkpoint", path)
        return None

    def _checkpoint_for(self, readable):
        """The checkpoint object to restore `readable` into: without the
        optional trackables it lacks (listed in `.missing`)."""
        self.missing = ()
        if not self._optional:
            return self.checkpoint
        saved = {key.split("/", 1)[0] for key in tf.train.load_checkpoint(
            readable).get_variable_to_shape_map()}
        self.missing = tuple(n for n in self._optional
                             if n in self._trackables and n not in saved)
        if not self.missing:
            return self.checkpoint
        return tf.train.Checkpoint(position=self._state, **{
            k: v for k, v in self._trackables.items()
            if k not in self.missing})

    def restore_latest(self) -> str | None:
        """Restores the newest intact checkpoint; returns its path or None."""
        self.restore()
        return self.restored_path

    def _refuse_nonfinite(self, step):
        bad = [name for key in ("model", "optimizer")
               if key in self._trackables
               for name in numerics.nonfinite_variables(
                   self._trackables[key].variables)]
        if not bad:
            bad = numerics.nonfinite_variables(
                [v for key, t in self._trackables.items()
                 if key not in ("model", "optimizer")
                 for v in getattr(t, "variables", [t])
                 if isinstance(v, tf.Variable)])
        if bad:
            raise ValueError(
                f"Refusing to save checkpoint {step} to `model_dir` "
                f"{self._model_dir!r}: {len(bad)} variable(s) hold NaN or "
                f"inf (first: {bad[0]!r}). The latest checkpoint there is "
                "the last finite state; fix the divergence (learning rate, "
                "`clip_global_norm`, input) and resume from it.")

    def save(self, position: Position | int) -> str | None:
        """Saves `position` (or just a step number) with the weights.

        Every worker calls it; only the chief's files reach `model_dir`.
        TensorFlow writes the `.index` file last, so a process killed
        mid-save leaves an incomplete checkpoint that `restore` skips.

        Returns:
          The chief's checkpoint prefix; None on other workers.

        Raises:
          ValueError: a saved variable holds NaN or inf.
        """
        if not isinstance(position, Position):
            position = Position(step=int(position))
        if self._before_save is not None:
            self._before_save()
        self._refuse_nonfinite(position.step)
        self._state.position = position
        self.last_saved_step = position.step
        if not self._chief:
            directory = worker_temp_dir(self._model_dir,
                                        cluster=self._cluster)
            try:
                self.checkpoint.write(os.path.join(directory, _BASENAME))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            self._save_worker_state(position.step)
            return None
        prefix = os.path.join(self._model_dir,
                              f"{_BASENAME}-{position.step}")
        path = self.checkpoint.write(prefix)
        kept = self.checkpoints()
        self._rotate(kept)
        _write_state_file(self._model_dir, [p for _, p in kept[-self._keep:]])
        self._save_worker_state(position.step)
        return path

    def _save_worker_state(self, step):
        if self._worker_state is None:
            return
        self._worker_state.write(self._model_dir, step)
        self._worker_state.prune(self._model_dir, step,
                                 [s for s, _ in self.checkpoints()])

    def _rotate(self, kept):
        old = kept[:-self._keep]
        if not old:
            return
        newest_finite = next(
            (p for _, p in reversed(kept) if (read_position(p) or Position(
            )).loss_finite), None)
        for _, prefix in old:
            if prefix != newest_finite:
                _remove_checkpoint(prefix)


def _remove_checkpoint(prefix):
    directory, stem = os.path.split(prefix)
    # The index first: a half-removed checkpoint is never taken as whole.
    names = sorted((n for n in os.listdir(directory)
                    if n.startswith(stem + ".")),
                   key=lambda n: not n.endswith(".index"))
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def _write_state_file(model_dir, prefixes):
    """TensorFlow's `checkpoint` state file, for its tools
    (`tf.train.latest_checkpoint`, TensorBoard); tfmulti never reads it.
    Replaced atomically."""
    names = [os.path.basename(p) for p in prefixes]
    text = f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
        f'all_model_checkpoint_paths: "{n}"\n' for n in names)
    partial = os.path.join(model_dir, ".checkpoint.partial")
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, os.path.join(model_dir, "checkpoint"))


def latest_step(model_dir: str) -> int | None:
    """The step of the newest complete checkpoint in `model_dir` (from the
    listing, not read back), or None when there is none."""
    prefixes = compat.checkpoint_prefixes(model_dir, basename=_BASENAME)
    return prefixes[-1][0] if prefixes else None


def check_writable(model_dir: str) -> None:
    """Creates `model_dir` if needed; a clear ValueError if it is unusable."""
    try:
        os.makedirs(model_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=model_dir, prefix=".tfmulti_"):
            pass
    except OSError as e:
        raise ValueError(
            f"`model_dir` {model_dir!r} is not a writable directory "
            f"({e.strerror or e}). Pass a directory this process (the chief) "
            "can create and write, on storage every worker can read.") from e
