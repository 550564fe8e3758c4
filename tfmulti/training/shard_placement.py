"""Where a sharded optimizer's variables live and how replicas find theirs.

The shards are plain variables, one per device, created outside the
strategy's variable creator (neither mirrored nor sync-on-read); a replica
finds its own by its static replica id. The unsharded optimizer a sharded
run checkpoints lives on the host, once per worker.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from tfmulti import compat


@contextlib.contextmanager
def device_local_variables():
    """Variables created inside are plain ones, also under a strategy's
    scope."""
    # Under a strategy scope every tf.Variable becomes distributed; the
    # shards must be plain variables on one device each.
    def creator(next_creator, **kwargs):
        del next_creator
        return compat.plain_variable(**kwargs)
    with tf.variable_creator_scope(creator):
        yield


def host_device(strategy) -> str:
    """The CPU of this worker's host (where its replicas' devices live)."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


@contextlib.contextmanager
def host_variables(strategy):
    """Variables created inside are plain ones on this worker's host CPU,
    also under `strategy`'s scope: the unsharded optimizer a sharded run
    checkpoints lives there once per worker, not once per replica."""
    with tf.device(host_device(strategy)), device_local_variables():
        yield


def assign(strategy, variable, value):
    """Writes a replica-identical `value` into `variable` (a merge_call's
    cross-replica context)."""
    # In cross-replica context (a merge_call): `value` holds the replicas'
    # equal values. A mirrored variable takes each replica's own copy; a
    # plain (host) variable the first.
    variable = tf_variable(variable)
    if isinstance(variable, tf.distribute.DistributedValues) and isinstance(
            value, tf.distribute.DistributedValues):
        strategy.extended.update(variable, lambda v, x: v.assign(x),
                                 args=(value,), group=False)
    else:
        # One local replica: merge_call passes the value itself, which
        # `update` would try to broadcast (MultiWorkerMirroredStrategy:
        # "destinations can not be empty").
        variable.assign(strategy.experimental_local_results(value)[0])


def tf_variable(variable):
    """A Keras variable's TensorFlow (distributed) variable."""
    # A Keras variable's TensorFlow (distributed) variable.
    return (variable.value if isinstance(variable, keras.Variable)
            else variable)


def canonical(device) -> str:
    """`device` as a canonical DeviceSpec string, for comparisons."""
    return tf.DeviceSpec.from_string(str(device)).to_string()


def static_replica_id(context) -> int:
    """The replica id as a Python int (a constant under MirroredStrategy
    and MultiWorkerMirroredStrategy)."""
    value = tf.get_static_value(context.replica_id_in_sync_group)
    if value is None:
        raise RuntimeError(
            "The replica id is not a constant in this strategy; "
            "shard_optimizer_state needs MirroredStrategy or "
            "MultiWorkerMirroredStrategy.")
    return int(value)
