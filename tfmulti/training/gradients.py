"""Cross-replica gradient reduction, clipping by the reduced norm, and the
Keras 3 optimizer that must not reduce again.

Keras 3's TensorFlow optimizer sums gradients across replicas by itself
(`TFOptimizer._backend_update_step` calls `_all_reduce_sum_gradients` in
replica context) after clipping each replica's LOCAL gradient. tfmulti
reduces explicitly, once, with the strategy's communication options, clips by
the norm of the reduced gradient, and gives the optimizer an identity in
place of its own reduction.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import compat

ALLREDUCE_DTYPES = ("float16", "bfloat16")
# Marks an optimizer whose own reduction tfmulti already replaced.
_MARK = "_tfmulti_reduces_gradients"


def reject_keras_accumulation(optimizer, *, instead: str) -> None:
    """Raises if `optimizer` (or a LossScaleOptimizer's inner one) uses
    Keras's `gradient_accumulation_steps`, which crashes under a strategy.

    Args:
      optimizer: a Keras 3 optimizer.
      instead: the fix to show, with "{steps}" for the number of steps.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    for opt in (optimizer, inner) if inner is not None else (optimizer,):
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"The optimizer has `gradient_accumulation_steps`={steps}, "
                "which crashes under a tf.distribute strategy (Keras puts the "
                "cross-replica reduction inside a cond). Create the optimizer "
                f"without it and {instead.format(steps=steps)} instead.")


def disable_optimizer_reduction(optimizer) -> None:
    """Makes `optimizer` apply gradients as given, without summing replicas.

    Replaces the optimizer INSTANCE's private `_all_reduce_sum_gradients`
    (Keras 3, TensorFlow backend) with an identity (see `tfmulti.compat`);
    for a `keras.optimizers.LossScaleOptimizer` the inner optimizer's too. Only the
    caller's reduction (`all_reduce_sum`) then sums gradients.

    Args:
      optimizer: a Keras 3 optimizer.

    Raises:
      ValueError: the optimizer uses Keras's `gradient_accumulation_steps`,
        which crashes under a strategy.
      RuntimeError: Keras is not 3.x, or the optimizer has no
        `_all_reduce_sum_gradients` (a Keras release that changed it).
    """
    reject_keras_accumulation(
        optimizer, instead="pass `grad_accum_steps={steps}` to "
        "tfmulti.Trainer")
    inner = getattr(optimizer, "inner_optimizer", None)
    for opt in (optimizer, inner) if inner is not None else (optimizer,):
        compat.replace_optimizer_reduction(opt)
        setattr(opt, _MARK, True)


def reduces_gradients(optimizer) -> bool:
    """Whether `disable_optimizer_reduction` was applied to `optimizer`."""
    return bool(getattr(optimizer, _MARK, False))


def all_reduce_sum(grads, *, options=None, dtype=None):
    """Sums `grads` across replicas in ONE batched all-reduce.

    Call in replica context. `None` entries stay `None`.

    Args:
      grads: list of gradients (tensors, IndexedSlices or None).
      options: `tf.distribute.experimental.CommunicationOptions`.
      dtype: None, or "float16"/"bfloat16": floating gradients are cast to it
        for the reduction (half the bytes on the wire) and back after.

    Returns:
      The list of summed gradients, in the input dtypes.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    values = [grads[i] for i in present]
    if dtype is not None:
        values = [tf.cast(tf.convert_to_tensor(g), dtype)
                  if g.dtype.is_floating else g for g in values]
    context = tf.distribute.get_replica_context()
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, values,
                                 options=options) if values else []
    out = list(grads)
    for i, g in zip(present, reduced):
        out[i] = tf.cast(g, grads[i].dtype) if dtype is not None else g
    return out


def clip_scaled(grads, optimizer, clip_norm):
    """Clips REDUCED gradients that still carry `optimizer`'s loss scale
    (a LossScaleOptimizer's, or `loss_scale_factor`) to the global norm
    `clip_norm` of the unscaled gradients: at scale * clip_norm, so the
    optimizer's own unscale in `apply` gives the clipped gradient. None:
    unchanged. The one clipping of every runner's update."""
    if clip_norm is None:
        return grads
    scale = tf.cast(optimizer.scale_loss(tf.constant(1.0)), tf.float32)
    return clip_by_global_norm(grads, clip_norm * scale)[0]


def clip_by_global_norm(grads, clip_norm):
    """Clips `grads` jointly so that their global norm is at most `clip_norm`.

    On reduced gradients this is the same on every replica and equal to
    clipping on one device.

    Returns:
      (clipped list, the global norm before clipping).
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    clipped, norm = tf.clip_by_global_norm([grads[i] for i in present],
                                           clip_norm)
    out = list(grads)
    for i, g in zip(present, clipped):
        out[i] = g
    return out, norm
