"""Who all-reduces what, and how many bytes it sent.

The train step hands its gradients to a reducer (called in replica context
where the one all-reduce per update is issued) and calls the reducer's
`after_update` in cross-replica context once the update is applied. The
synchronous reducer here is tfmulti's ordinary update; `local_sgd` and
`powersgd` provide the others. Every reducer counts, where it issues a
collective, the calls and the payload bytes this worker put on the wire, and
which of them crossed the link between workers.

Topology: replicas on one worker (GPUs over NVLink/PCIe, or simulated CPU
devices) are reduced with their own collective group
(`worker_all_reduce_fn`); only the reducers that need every worker issue the
strategy's global all-reduce.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfmulti import compat
from tfmulti.training import gradients as gradients_lib

# Group keys of the per-worker collective groups: far from the ranges
# MirroredStrategy (multiples of 100_000 in tfmulti.strategies) and
# MultiWorkerMirroredStrategy (from 1) use, one range per worker because a
# group key names ONE device set across the whole cluster.
_WORKER_GROUP_KEY_BASE = 1_000_000_000
_WORKER_GROUP_KEY_STRIDE = 1_000
# Worker-local groups made so far in this process: each reducer gets a group
# of its own. Reusing one would restart its instance keys at the first ones,
# which TensorFlow's collective executor still maps to the previous model's
# shapes ("Shape mismatch in the collective instance 100", measured with two
# local-SGD Trainers in one process).
_worker_groups_made = 0

TRAFFIC_KEYS = ("all_reduce_calls", "all_reduce_bytes", "inter_worker_calls",
                "inter_worker_bytes")


def num_workers(strategy) -> int:
    """Worker processes in `strategy`'s cluster (1 for in-process ones)."""
    # A ParameterServerStrategy coordinator has no worker devices of its
    # own (and no all-reduce), and the default strategy raises on the
    # attribute: count both as one.
    try:
        devices = len(strategy.extended.worker_devices or ())
    except (AttributeError, RuntimeError):
        devices = 0
    return strategy.num_replicas_in_sync // devices if devices else 1


def payload_bytes(tensors) -> int:
    """Bytes of `tensors` (static shapes) as one replica sends them."""
    # Keras variables give their dtype as a string.
    return sum(int(tf.TensorShape(t.shape).num_elements()) *
               tf.as_dtype(t.dtype).size for t in tensors if t is not None)


class Traffic:
    """Per-worker counters of all-reduce calls and payload bytes.

    Bytes are the payload one replica hands to the collective (what a ring
    all-reduce moves about twice of, per worker); `inter_worker_*` counts
    only the collectives whose group spans more than one worker. Not
    checkpointed: they record this process's communication.
    """

    def __init__(self):
        # Outside any strategy: plain per-process counters.
        with tf.init_scope():
            self._counters = {key: tf.Variable(0, dtype=tf.int64,
                                               trainable=False, name=key)
                              for key in TRAFFIC_KEYS}

    def add(self, calls, nbytes, *, inter_worker: bool):
        """Adds `calls` collectives of `nbytes` in total (cross-replica
        context; tensors or ints)."""
        calls = tf.cast(calls, tf.int64)
        nbytes = tf.cast(nbytes, tf.int64)
        self._counters["all_reduce_calls"].assign_add(calls)
        self._counters["all_reduce_bytes"].assign_add(nbytes)
        if inter_worker:
            self._counters["inter_worker_calls"].assign_add(calls)
            self._counters["inter_worker_bytes"].assign_add(nbytes)

    def result(self) -> dict:
        """{key: int} for metrics.json."""
        return {key: int(v.numpy()) for key, v in self._counters.items()}


def worker_all_reduce_fn(strategy, options=None):
    """`reduce(values) -> values`: SUM over THIS worker's replicas only.

    In replica context. One process (MirroredStrategy, OneDevice): the
    strategy's own all-reduce. Several workers: a `CollectiveAllReduce` over
    the worker's local devices in a collective group of its own, so the
    reduction never leaves the worker; with one replica per worker, the
    identity.
    """
    local_devices = tuple(strategy.extended.worker_devices)
    workers = num_workers(strategy)
    if workers == 1:
        def reduce_all(values):
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, values, options=options)
        return reduce_all
    if len(local_devices) == 1:
        return list
    global _worker_groups_made
    _worker_groups_made += 1
    if _worker_groups_made >= _WORKER_GROUP_KEY_STRIDE:
        raise RuntimeError(
            f"{_worker_groups_made} worker-local reducers made in one "
            "process; the collective group keys reserved for them are "
            "exhausted. Make one Trainer per process and reuse it.")
    task = strategy.cluster_resolver.task_id
    communication = options or tf.distribute.experimental.CommunicationOptions()
    ops = compat.local_collective_all_reduce(
        local_devices, communication,
        group_key_start=_WORKER_GROUP_KEY_BASE +
        _WORKER_GROUP_KEY_STRIDE * task + _worker_groups_made)

    def reduce_local(values):
        return compat.all_reduce_in_replica(ops, values, communication)
    return reduce_local


def global_all_reduce_fn(strategy, options=None):
    """`reduce(values) -> values`: SUM over every replica of every worker,
    usable inside a `tf.cond` in replica context.

    The replica context's `all_reduce` goes through `merge_call` under
    MultiWorkerMirroredStrategy, which a `tf.cond` branch cannot hold
    ("`merge_call` called while defining a new graph"); the strategy's own
    `CollectiveAllReduce` issues the same collective without it.
    """
    ops = compat.collective_all_reduce(strategy)
    communication = options or tf.distribute.experimental.CommunicationOptions()
    if num_workers(strategy) == 1 or ops is None:
        def reduce_all(values):
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, values, options=options)
        return reduce_all

    def reduce_collective(values):
        return compat.all_reduce_in_replica(ops, values, communication)
    return reduce_collective


class Reducer:
    """What every reducer offers the train step, with the defaults.

    `reduce(grads)` (replica context) replaces the one all-reduce of an
    update; `run_update`, `before_update` and `after_update` run in
    cross-replica context around the step's `strategy.run`; `traffic` counts
    what was sent.
    """

    def run_update(self, update):
        """Runs the step's update (`update()`, cross-replica context)."""
        return update()

    def before_update(self):
        """Nothing to do before an update."""
        return None

    def evaluation_weights(self):
        """Context in which evaluation reads the weights: the model's own
        (every worker holds the same ones)."""
        return contextlib.nullcontext()

    def trackables(self) -> dict:
        """Extra checkpoint state: none."""
        return {}

    def state_variables(self) -> list:
        """Per-worker state: none (every replica holds the same values)."""
        return []


class SynchronousReducer(Reducer):
    """tfmulti's ordinary update: one global all-reduce of the gradients.

    Args:
      strategy: the strategy.
      communication_options: for the all-reduce.
      allreduce_dtype: None or "float16"/"bfloat16" on the wire.
    """

    def __init__(self, strategy, *, communication_options=None,
                 allreduce_dtype=None):
        self._strategy = strategy
        self._options = communication_options
        self._dtype = allreduce_dtype
        self._inter_worker = num_workers(strategy) > 1
        self.traffic = Traffic()
        self._traced_bytes = 0

    def reduce(self, grads):
        """SUM across every replica (replica context)."""
        wire = tf.as_dtype(self._dtype) if self._dtype else None
        # A gradient of unknown static size (data whose shape only the run
        # knows, which the training-data checks then refuse by name) counts
        # 0 rather than failing the trace before that clear error.
        self._traced_bytes = sum(
            (g.shape.num_elements() or 0) * (
                wire.size if wire is not None and g.dtype.is_floating
                else g.dtype.size)
            for g in grads if g is not None)
        return gradients_lib.all_reduce_sum(grads, options=self._options,
                                            dtype=self._dtype)

    def reduce_scatter(self, grads, sharding):
        """ZeRO-2: this replica's shard of the summed gradients, through
        `sharding.scatter` (replica context); counted as the update's
        gradient collective, its payload the padded flat gradient."""
        self._traced_bytes = sharding.reduce_scatter.payload_bytes(
            sharding.dtype)
        return sharding.scatter(grads)

    def after_update(self):
        """Counts this update's all-reduce (cross-replica context)."""
        if self._traced_bytes and self._strategy.num_replicas_in_sync > 1:
            self.traffic.add(1, self._traced_bytes,
                             inter_worker=self._inter_worker)

