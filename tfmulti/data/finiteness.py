"""Whether a stream ends: refuse an endless one where a finite one is needed.

Evaluation reads until the data ends, and Keras `fit` without
`steps_per_epoch` waits for the end of an epoch; given the training stream
of `distribute_dataset` (repeated forever) both hang inside one
`tf.function`, where not even SIGALRM reaches them. A distributed dataset
does not expose its cardinality, so `distribute_dataset` marks its training
streams; a `tf.data.Dataset` says so itself.
"""

from __future__ import annotations

import tensorflow as tf

_MARK = "_tfmulti_endless"


def mark_endless(distributed_dataset):
    """Marks a distributed dataset as repeating forever; returns it."""
    setattr(distributed_dataset, _MARK, True)
    return distributed_dataset


def is_endless(data) -> bool:
    """True for a marked distributed dataset or an INFINITE tf.data one."""
    if getattr(data, _MARK, False):
        return True
    if isinstance(data, tf.data.Dataset):
        return int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    return False


def check_finite(data, *, arg: str, fix: str) -> None:
    """Raises ValueError naming `arg` if `data` never ends.

    Args:
      data: what the caller got.
      arg: the argument's name, e.g. "eval_data".
      fix: what to pass instead.
    """
    if is_endless(data):
        raise ValueError(
            f"`{arg}` is an endless stream ({type(data).__name__} that "
            "repeats forever, e.g. the training stream of "
            "tfmulti.distribute_dataset), so the pass over it would never "
            f"end. {fix}")
