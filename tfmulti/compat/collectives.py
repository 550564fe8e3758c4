"""TensorFlow's collectives as tfmulti issues them: instance keys bound at
trace time, an all-reduce over one worker's devices or inside a `tf.cond`,
and aborting every pending collective."""

from __future__ import annotations

import logging

import tensorflow as tf


# --- Collective instance keys bound at call time (MirroredStrategy) --------
# Symptom: TensorFlow's "Custom training with tf.distribute.Strategy"
# tutorial (optimizer built by its first `apply_gradients` inside
# `tf.function(strategy.run(...))`) and plain Keras `fit` with
# `steps_per_execution > 1` fail under MirroredStrategy: "InvalidArgument
# Error: You must feed a value for placeholder tensor 'cond/else/_1/cond/
# Placeholder' with dtype int32". Cause: `distribute/cross_device_utils.py`
# `_next_instance_key` takes each collective's instance key from
# `capture_call_time_value`, a placeholder fed when the OUTER function is
# called; a collective inside a function called from a `tf.cond` branch
# (tf.function's `fn_with_cond` for variables made on the first call,
# Keras's `tf.while_loop`/`tf.cond` around each step) leaves it unfed.
# Call-time keys let workers that retrace at different times agree; one
# process has no such peers, so keys fixed at trace time are as safe (TF
# did that before 2.5). Set on the launchers of tfmulti's mirrored
# strategies only, never globally. Checked: TF 2.21.0, Keras 3.15.1.
# Guard: tests/conformance/test_conformance.py::test_stock_mirrored_
# tutorial_still_fails.
_log = logging.getLogger(__name__)


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


# --- Collective all-reduce outside `merge_call` ----------------------------
# TensorFlow's `CollectiveAllReduce` (distribute/cross_device_ops.py) is the
# object a MultiWorkerMirroredStrategy all-reduces with; its public
# `reduce`/`batch_reduce` need cross-replica context (a `merge_call`), which
# a `tf.cond` branch cannot hold ("`merge_call` called while defining a new
# graph"). Its private `_all_reduce(op, values, replica_id, options)` issues
# the same collective from replica context; `ReplicaContext._replica_id` is
# the replica's index on this worker, which it indexes by; `CollectiveKeys`
# gives a reducer over one worker's devices group keys of its own. Checked:
# TF 2.18.1, 2.21.0. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist (and the local SGD / PowerSGD
# golden tests, which run these collectives).
def collective_all_reduce(strategy):
    """The strategy's `CollectiveAllReduce`, or None (another kind)."""
    from tensorflow.python.distribute import cross_device_ops
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return ops if isinstance(ops, cross_device_ops.CollectiveAllReduce) \
        else None


def local_collective_all_reduce(devices, options, group_key_start: int):
    """A `CollectiveAllReduce` over `devices` (one worker's) whose group
    keys start at `group_key_start`."""
    from tensorflow.python.distribute import cross_device_ops
    from tensorflow.python.distribute import cross_device_utils
    return cross_device_ops.CollectiveAllReduce(
        devices=devices, group_size=len(devices), options=options,
        collective_keys=cross_device_utils.CollectiveKeys(
            group_key_start=group_key_start))


def all_reduce_in_replica(ops, values, options):
    """SUM of `values` over `ops`'s devices, from replica context."""
    context = tf.distribute.get_replica_context()
    return list(ops._all_reduce(tf.distribute.ReduceOp.SUM, list(values),
                                context._replica_id, options))


# --- All-to-all from replica context (reduce-scatter on CPU) ---------------
# ZeRO-2 reduce-scatters gradients; TF 2.21 has no CPU implementation of
# `CollectiveReduceScatterV2` ("CollectiveRegistry::Lookup did not find
# collective implementation undef") and `ReplicaContext` offers no
# reduce-scatter or all-to-all. `CollectiveAllToAllV2` runs on CPU; issued
# from the strategy's own `CollectiveReplicaLauncher` (private:
# `CollectiveAllReduce._launchers`; the launcher's `_group_key`,
# `_group_size`, `_device`, `_options`, `_next_instance_key`,
# `_get_ordering_token`) it joins the strategy's group, whose ranks are the
# replica ids (the order `all_gather` relies on too). Checked: TF 2.21.0.
# Guard: test_compat.py::test_private_names_tfmulti_reads_still_exist, and
# tests/test_optimizer_sharding.py::test_all_to_all_reduce_scatters.
def all_to_all_in_replica(ops, value, options=None):
    """Rank i of the group receives row i of `value` from every replica,
    stacked in rank order (row j from rank j); from replica context.

    Args:
      ops: the strategy's `CollectiveAllReduce` (`collective_all_reduce`).
      value: a tensor of shape [N, ...], N the group size (the kernel
        refuses any other first dimension: "input to all-to-all first
        dimension size (8) must be the same as the group size (4)").
      options: `tf.distribute.experimental.CommunicationOptions` or None.
    """
    from tensorflow.python.ops import collective_ops
    context = tf.distribute.get_replica_context()
    launcher = ops._launchers[context._replica_id]
    instance_key = launcher._next_instance_key()
    merged = launcher._options.merge(options)
    token = launcher._get_ordering_token()
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            value, launcher._group_size, launcher._group_key, instance_key,
            communication_hint=merged.implementation.value,
            timeout=merged.timeout_seconds, ordering_token=token)


# --- Aborting pending collectives -------------------------------------------
# A collective waiting for a peer that never comes blocks until TensorFlow's
# own timeout (none by default); `context.abort_collective_ops` (private:
# tensorflow/python/eager/context.py) fails every pending one with the given
# error, which is how tfmulti's watchdog ends a stalled call. Checked: TF
# 2.18.1, 2.21.0. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist; use: test_reliability_faults.py.
def abort_collectives(message: str) -> None:
    """Fails every pending collective with DEADLINE_EXCEEDED `message`."""
    from tensorflow.python.eager import context
    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED,
                                           message)
