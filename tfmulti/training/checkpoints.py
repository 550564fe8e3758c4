"""Checkpoints in `model_dir`, written by the chief only.

Under MultiWorkerMirroredStrategy saving may run collectives, so every
worker must save (saving only on the chief can deadlock); non-chief workers
save to a temporary directory of their own and remove it afterwards, so only
the chief's files reach `model_dir` and workers never clash
(`MergeV2Checkpoints` NotFoundError).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti.training import numerics

_MAX_TO_KEEP = 3


class Checkpointer:
    """A `tf.train.CheckpointManager` over `model_dir` with the chief rule.

    Args:
      model_dir: the job's directory; the chief's checkpoints go here.
      strategy: the strategy (decides who is chief).
      **trackables: what to save, e.g. model=, optimizer=, step=.
    """

    def __init__(self, model_dir: str, strategy, **trackables):
        self._model_dir = model_dir
        self._chief = cluster_lib.of_strategy(strategy).is_chief
        if self._chief:
            check_writable(model_dir)
        self._trackables = trackables
        self.last_saved_step = None
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self._manager = tf.train.CheckpointManager(
            self.checkpoint, model_dir, max_to_keep=_MAX_TO_KEEP
        ) if self._chief else None

    def restore_latest(self) -> str | None:
        """Restores the chief's latest checkpoint in `model_dir`, if any.

        Returns:
          The checkpoint path restored, or None.
        """
        path = tf.train.latest_checkpoint(self._model_dir)
        if path:
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.OpError) as e:
                raise ValueError(
                    f"`model_dir` {self._model_dir!r} holds the checkpoint "
                    f"{path!r}, which does not match this model and "
                    "optimizer (another architecture, layer sizes or "
                    "optimizer), so it cannot be restored. Use a new "
                    "`model_dir` for a new model, or delete the old "
                    "checkpoints to start over. TensorFlow said: "
                    f"{str(e).strip()[:400]}") from e
        return path

    def save(self, step: int) -> str | None:
        """Saves as checkpoint number `step`; returns the chief's path.

        Refuses (ValueError) to save NaN or inf weights, so the latest
        checkpoint is always one worth resuming from. TensorFlow writes the
        data files first and then replaces the `checkpoint` state file
        atomically, so a process killed mid-save leaves the previous
        checkpoint as the latest (tested).
        """
        bad = [name for key in ("model", "optimizer")
               if key in self._trackables
               for name in numerics.nonfinite_variables(
                   self._trackables[key].variables)]
        if bad:
            raise ValueError(
                f"Refusing to save checkpoint {step} to `model_dir` "
                f"{self._model_dir!r}: {len(bad)} variable(s) hold NaN or "
                f"inf (first: {bad[0]!r}). The latest checkpoint there is "
                "the last finite state; fix the divergence (learning rate, "
                "`clip_global_norm`, input) and resume from it.")
        self.last_saved_step = step
        if self._chief:
            return self._manager.save(checkpoint_number=step)
        directory = tempfile.mkdtemp(prefix="tfmulti_ckpt_worker_")
        try:
            tf.train.CheckpointManager(self.checkpoint, directory,
                                       max_to_keep=1).save(
                                           checkpoint_number=step)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return None


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
