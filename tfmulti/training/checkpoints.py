"""Checkpoints in `model_dir`, written by the chief only.

Under MultiWorkerMirroredStrategy saving may run collectives, so every
worker must save (saving only on the chief can deadlock); non-chief workers
save to a temporary directory of their own and remove it afterwards, so only
the chief's files reach `model_dir` and workers never clash
(`MergeV2Checkpoints` NotFoundError).
"""

from __future__ import annotations

import shutil
import tempfile

import tensorflow as tf

_MAX_TO_KEEP = 3


def task(strategy) -> tuple[str | None, int]:
    """(task type, task id) of this process; (None, 0) outside a cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return None, 0
    return resolver.task_type, int(resolver.task_id or 0)


def is_chief(strategy) -> bool:
    """Whether this process is the chief: the `chief` task, else worker 0."""
    task_type, task_id = task(strategy)
    if task_type is None:
        return True
    resolver = strategy.cluster_resolver
    if "chief" in resolver.cluster_spec().as_dict():
        return task_type == "chief"
    return task_type == "worker" and task_id == 0


class Checkpointer:
    """A `tf.train.CheckpointManager` over `model_dir` with the chief rule.

    Args:
      model_dir: the job's directory; the chief's checkpoints go here.
      strategy: the strategy (decides who is chief).
      **trackables: what to save, e.g. model=, optimizer=, step=.
    """

    def __init__(self, model_dir: str, strategy, **trackables):
        self._model_dir = model_dir
        self._chief = is_chief(strategy)
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
            self.checkpoint.restore(path).assert_existing_objects_matched()
        return path

    def save(self, step: int) -> str | None:
        """Saves as checkpoint number `step`; returns the chief's path."""
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
