"""Exact-once evaluation: every input pipeline padded (or, with
`drop_remainder`, truncated) to the same number of full steps, each example
weighted 1 and each padding element 0, so every replica runs the same steps
and every real example counts once (`distribute_dataset(training=False)`).
"""

from __future__ import annotations

import math

import tensorflow as tf


def _zeros_like(dataset):
    """One all-zeros element shaped like `dataset`'s elements."""
    spec = dataset.element_spec
    if all(s.shape.is_fully_defined() for s in tf.nest.flatten(spec)):
        return tf.data.Dataset.from_tensors(tf.nest.map_structure(
            lambda s: tf.zeros(s.shape, s.dtype), spec))
    # Shapes known only per element (e.g. images before a resizing map_fn
    # that the user left out): take them from the first element.
    return dataset.take(1).map(
        lambda *e: tf.nest.map_structure(tf.zeros_like, e))


def _with_weight(features, label):
    return features, label, tf.constant(1.0, tf.float32)


def pad_to_steps(dataset, sizes, *, pipeline_id, step_examples,
                  drop_remainder, like=None):
    """Pads (or truncates) this pipeline to the same number of full steps.

    `like` (default `dataset`) gives the padding's shapes: the local
    pipeline when `dataset` comes from the data service.
    """
    if drop_remainder:
        steps = min(sizes) // step_examples
        if steps == 0:
            raise ValueError(
                f"`drop_remainder`=True in evaluation leaves nothing: the "
                f"smallest input pipeline has {min(sizes)} examples, fewer "
                f"than one step of {step_examples} on its replicas. Use "
                "drop_remainder=None (pad and mask) or a smaller "
                "`global_batch_size`.")
        return dataset.take(steps * step_examples).map(_with_weight)
    steps = math.ceil(max(sizes) / step_examples)
    padding = steps * step_examples - sizes[pipeline_id]
    zeros = _zeros_like(dataset if like is None else like).map(
        lambda f, l: (f, l, tf.constant(0.0, tf.float32)))
    return dataset.map(_with_weight).concatenate(zeros.repeat(padding))


# Marks the evaluation stream of `distribute_dataset`, whose sample weights
# are the padding mask and not a user's weights.
_PADDING_MASK = "_tfmulti_padding_mask"


def mark(distributed) -> None:
    """Marks `distributed` as an evaluation stream of `distribute_dataset`."""
    setattr(distributed, _PADDING_MASK, True)


def has_padding_mask(data) -> bool:
    """Whether `data` is an evaluation stream of `distribute_dataset`: its
    sample weights are 1 for a real example and 0 for padding."""
    return getattr(data, _PADDING_MASK, False)
