"""Version-guarded workarounds of Keras 3 / TensorFlow behaviour.

One section per workaround: the upstream symptom, where it comes from, the
versions it was checked on, and the guard test in
`tests/conformance/test_compat_guards.py` that fails once upstream fixes it
(then delete the section).
"""

from __future__ import annotations

import logging
import warnings

import keras
import tensorflow as tf

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Collective instance keys bound at call time (MirroredStrategy).
#
# Symptom: TensorFlow's "Custom training with tf.distribute.Strategy"
# tutorial (optimizer built lazily by its first `apply_gradients` inside
# `tf.function(strategy.run(...))`) and plain Keras `fit` with
# `steps_per_execution > 1` fail under MirroredStrategy with
# "InvalidArgumentError: You must feed a value for placeholder tensor
# 'cond/else/_1/cond/Placeholder' with dtype int32". Cause (TF 2.21,
# `distribute/cross_device_utils.py` `_next_instance_key`): every collective
# takes its instance key from `capture_call_time_value`, a placeholder fed
# when the OUTER function is called. A collective inside a function called
# from a `tf.cond` branch (tf.function's `fn_with_cond` for variables made on
# the first call; Keras's `tf.while_loop`/`tf.cond` around each step) leaves
# that placeholder unfed. Call-time keys exist so that workers that retrace
# at different times agree on keys; one process (MirroredStrategy) has no
# such peers, so keys fixed at trace time are as safe, and are what TF did
# before 2.5. Applied to the launchers of the strategies tfmulti creates,
# never globally.
# ---------------------------------------------------------------------------


def _trace_time_instance_keys():
    return False


def bind_collective_keys_at_trace_time(strategy) -> bool:
    """Makes `strategy`'s collectives take instance keys at trace time.

    Only for a single-process MirroredStrategy whose all-reduce is
    `CollectiveAllReduce` (TensorFlow's default on CPUs and GPUs).

    Returns:
      Whether the strategy was changed.
    """
    ops = getattr(strategy.extended, "_collective_ops", None)
    launchers = getattr(ops, "_launchers", None)
    if not launchers or not all(
            callable(getattr(l, "_use_unique_instance_key", None))
            for l in launchers):
        _log.warning(
            "tfmulti: this TensorFlow (%s) changed its collective launchers; "
            "a custom loop whose optimizer is built by its first step, and "
            "Keras fit with steps_per_execution > 1, may fail under "
            "MirroredStrategy. Call optimizer.build(model.trainable_variables)"
            " under strategy.scope() first, or use tfmulti.keras.distributed.",
            tf.__version__)
        return False
    for launcher in launchers:
        launcher._use_unique_instance_key = _trace_time_instance_keys
    return True


# ---------------------------------------------------------------------------
# Keras reduces the first batch to build the model (Keras 3.15).
#
# Symptom: a global batch not divisible by the replicas (64 on 3) crashes
# `fit` and `evaluate` before the first step: "Inputs to operation AddN ...
# must have the same size and shape [22,10] != [21,10]". Cause:
# `keras/src/backend/tensorflow/trainer.py` `_maybe_symbolic_build` calls
# `strategy.reduce("MEAN", first_batch, axis=None)` only to get a batch
# whose shapes build the model. A mean of tensors of different shapes has no
# meaning, so tfmulti's strategies answer that one caller with the first
# replica's batch and refuse everyone else with the shapes and the fix.
# ---------------------------------------------------------------------------

_KERAS_BUILD_CALLER = "_maybe_symbolic_build"


def called_by_keras_build() -> bool:
    """Whether the running `strategy.reduce` was called by Keras's build."""
    import sys
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == _KERAS_BUILD_CALLER:
            return True
        frame = frame.f_back
    return False


def local_batch_sizes(strategy, batch):
    """Static first dimension of the first tensor of `batch` per local
    replica (None where unknown), or None if `batch` is not per-replica."""
    leaves = [t for t in tf.nest.flatten(batch, expand_composites=False)
              if t is not None]
    if not leaves:
        return None
    local = strategy.experimental_local_results(leaves[0])
    sizes = []
    for t in local:
        shape = getattr(t, "shape", None)
        sizes.append(None if shape is None or shape.rank in (None, 0)
                     else shape[0])
    return sizes


def unequal_shapes_error(strategy, value) -> ValueError | None:
    """A clear error if `value`'s per-replica parts differ in shape."""
    for leaf in tf.nest.flatten(value):
        local = strategy.experimental_local_results(leaf)
        shapes = [tuple(getattr(t, "shape", ())) for t in local]
        if len(set(shapes)) > 1:
            n = strategy.num_replicas_in_sync
            total = sum(s[0] for s in shapes if s and s[0] is not None)
            return ValueError(
                f"The replicas hold values of different shapes {shapes}: the "
                f"global batch ({total}) is not divisible by the {n} "
                f"replicas. Use a global batch that is a multiple of {n} "
                f"(e.g. {total - total % n or n} or {total + n - total % n}).")
    return None


# ---------------------------------------------------------------------------
# Keras's train step weights each replica's loss by 1/replicas (Keras 3.15).
#
# Symptom: with a partial last batch (330 examples, batch 32: 10 examples
# split 3,3,2,2 over 4 replicas) or a global batch not divisible by the
# replicas, plain `fit` drifts from one device (4e-2 in two epochs, with
# sample weights). Cause: `keras/src/losses/loss.py` `reduce_values` takes
# each replica's mean and `scale_loss_for_distribution` multiplies it by
# 1/num_replicas whatever that replica's share of the batch (k#19891 reports
# loss that changes with the replica count). Keras cannot be told the shares
# without patching it; tfmulti warns once, at trace time, when a plain
# Keras train step sees per-replica batches that are unequal or of unknown
# size, and names the fix. `tfmulti.keras.distributed` weights exactly.
# ---------------------------------------------------------------------------

_warned_uneven = set()


def is_keras_train_step(fn) -> bool:
    """Whether `fn` is a Keras model's stock `train_step` (bound)."""
    model = getattr(fn, "__self__", None)
    return (getattr(fn, "__name__", None) == "train_step" and
            isinstance(model, keras.Model))


def warn_if_keras_step_uneven(strategy, fn, args) -> None:
    """Warns once per model if Keras's train step may get unequal shares."""
    n = strategy.num_replicas_in_sync
    if n < 2 or not args or not is_keras_train_step(fn):
        return
    model = fn.__self__
    sizes = local_batch_sizes(strategy, args[0])
    if sizes is None:
        return
    if None not in sizes and len(set(sizes)) == 1:
        return
    if id(model) in _warned_uneven:
        return
    _warned_uneven.add(id(model))
    what = ("unknown until run time (the last batch may be partial)"
            if None in sizes else f"{sizes}")
    warnings.warn(
        f"tfmulti: Keras `fit` weights each of the {n} replicas' mean loss "
        f"by 1/{n} whatever its share of the global batch, and the "
        f"per-replica batch sizes here are {what}: a partial or uneven "
        "batch gives a different update than one device. Batch the data "
        f"with drop_remainder=True and a global batch divisible by {n}, or "
        "call tfmulti.keras.distributed(model) after compile, which weights "
        "each replica by its real share.", UserWarning, stacklevel=3)
