"""Keras 3 optimizers under tfmulti's own gradient reduction and sharded
state: their cross-replica sum replaced, updates on one device."""

from __future__ import annotations

import types

import keras

from tfmulti.compat.versions import SUPPORTED_KERAS_MAJOR, keras_major


# --- Keras 3 optimizers all-reduce gradients themselves ---------------------
# Symptom: `TFOptimizer._backend_update_step` sums gradients across replicas
# (`_all_reduce_sum_gradients`) whenever it runs in replica context, after
# clipping each replica's LOCAL gradient; a custom step that reduces first
# gets N-times gradients, and clipping happens before the sum. No public
# switch (Keras 3 dropped `experimental_aggregate_gradients`). Upstream:
# keras-team/keras#20585 family. Checked: Keras 3.15.1.
# Guards: test_compat.py (optimizer_sums_replicas),
# test_trainer_errors.py::test_keras_still_has_the_replaced_reduction.
OPTIMIZER_REDUCE_METHOD = "_all_reduce_sum_gradients"


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


def replace_optimizer_reduction(optimizer) -> None:
    """Gives `optimizer` (an INSTANCE) an identity in place of its own
    cross-replica sum. Raises RuntimeError if this Keras has none."""
    if keras_major() != SUPPORTED_KERAS_MAJOR:
        raise RuntimeError(
            f"tfmulti's gradient reduction supports Keras "
            f"{SUPPORTED_KERAS_MAJOR}.x; this is Keras {keras.__version__}. "
            "Install keras>=3.15,<4.")
    if not callable(getattr(type(optimizer), OPTIMIZER_REDUCE_METHOD, None)):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `{OPTIMIZER_REDUCE_METHOD}`: "
            f"this Keras ({keras.__version__}) changed how its TensorFlow "
            "optimizer reduces gradients, and tfmulti cannot stop it from "
            "reducing them a second time. Use keras 3.15.")
    setattr(optimizer, OPTIMIZER_REDUCE_METHOD, _already_reduced)



# --- A Keras 3 optimizer that updates one device's variables alone ----------
# Symptom: Keras 3's TFOptimizer routes `update_step` and weight decay through
# `maybe_merge_call` + `strategy.extended.update`, which under a
# MirroredStrategy asserts the variable is a DistributedVariable; a sharded
# optimizer updates a plain variable on ONE replica's device, from that
# replica's context. The backend-neutral BaseOptimizer versions loop over
# `update_step` / `assign_sub` directly, and build slots without the
# strategy's `colocate_vars_with` (which refuses a plain variable). Checked: Keras 3.15.1.
# Guard: test_optimizer_sharding.py (test_local_update_methods_exist).
LOCAL_UPDATE_METHODS = ("_backend_update_step", "_apply_weight_decay",
                        "add_variable_from_reference")


def make_optimizer_local(optimizer) -> None:
    """Makes `optimizer` (an INSTANCE) update its variables in place, with
    no cross-replica merge. Raises RuntimeError if this Keras changed."""
    from keras.src.optimizers import base_optimizer
    for name in LOCAL_UPDATE_METHODS:
        base = getattr(base_optimizer.BaseOptimizer, name, None)
        if not callable(base) or not callable(
                getattr(type(optimizer), name, None)):
            raise RuntimeError(
                f"{type(optimizer).__name__} or Keras's BaseOptimizer has no "
                f"`{name}`: this Keras ({keras.__version__}) changed how an "
                "optimizer applies updates, and tfmulti cannot shard its "
                "state. Use keras 3.15 or shard_optimizer_state=False.")
        setattr(optimizer, name, types.MethodType(base, optimizer))


def excludes_from_weight_decay(optimizer) -> bool:
    """Whether `optimizer` leaves variables out of weight decay by name
    (`exclude_from_weight_decay`, kept private by Keras 3)."""
    return bool(getattr(optimizer, "_exclude_from_weight_decay", None) or
                getattr(optimizer, "_exclude_from_weight_decay_pattern",
                        None))


def optimizer_built_variables(optimizer):
    """The variables a built Keras 3 optimizer updates, in build order."""
    variables = getattr(optimizer, "_trainable_variables", None)
    if variables is None or not getattr(optimizer, "built", False):
        raise RuntimeError(
            f"{type(optimizer).__name__} is not built (or this Keras "
            f"{keras.__version__} keeps no `_trainable_variables`); call "
            "optimizer.build(model.trainable_variables) first.")
    return list(variables)


def plain_variable(**kwargs):
    """A tf.Variable made without any variable creator (so not distributed
    even inside a strategy scope), placed by the enclosing `tf.device`.
    Keyword arguments are tf.Variable's; sync/aggregation are dropped, and
    what a strategy's `colocate_vars_with` (which Keras wraps around slot
    creation) adds: `use_resource` (a ResourceVariable is one) and
    `colocate_with` (the enclosing `tf.device` places it)."""
    from tensorflow.python.ops import resource_variable_ops
    for key in ("synchronization", "aggregation",
                "experimental_enable_variable_lifting", "use_resource",
                "colocate_with"):
        kwargs.pop(key, None)
    return resource_variable_ops.ResourceVariable(**kwargs)
