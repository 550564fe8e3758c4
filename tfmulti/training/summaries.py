"""TensorBoard scalars in `model_dir`, written by the chief only."""

from __future__ import annotations

import os

import tensorflow as tf

from tfmulti import cluster as cluster_lib


class ScalarWriter:
    """Writes scalars to `model_dir/<subdir>` on the chief; a no-op elsewhere.

    Args:
      model_dir: the job's directory, or None for no summaries.
      strategy: the strategy (decides who is chief).
      subdir: "train" or "eval".
    """

    def __init__(self, model_dir: str | None, strategy, subdir: str):
        self._directory = os.path.join(model_dir, subdir) if (
            model_dir and cluster_lib.of_strategy(strategy).is_chief) else None
        self._writer = None

    @property
    def active(self) -> bool:
        """Whether this process writes (the chief, with a `model_dir`)."""
        return self._directory is not None

    def write(self, step: int, scalars: dict) -> None:
        """Writes each `name: value` of `scalars` at `step`."""
        if self._directory is None:
            return
        if self._writer is None:
            # Created on first use: no empty "eval" directory without eval.
            self._writer = tf.summary.create_file_writer(self._directory)
        with self._writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, float(value), step=step)
        self._writer.flush()
