"""Each replica's compute time per step, without the wait at the barrier.

The step's wall time is the slowest replica's: every replica waits at the
gradient all-reduce. To know each replica's own speed, the step records
`tf.timestamp()` when the replica's batch enters its forward pass and when
its local gradients exist, before the all-reduce; the differences and the
examples are summed per replica (sync-on-read variables, no communication
in the step) and gathered from every worker between loops, in one
all-reduce that every worker runs at the same loop boundary.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


class ReplicaTimer:
    """Sums each replica's compute seconds and examples.

    In replica context: `x = timer.start(x)` before the forward pass,
    `grads = timer.stop(grads, x)` after the local gradients. Between loops,
    in cross-replica context on every worker: `timer.gather()`.
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._replicas = strategy.num_replicas_in_sync
        with strategy.scope():
            self._totals = tf.Variable(
                tf.zeros([2], tf.float32), trainable=False,
                name="replica_compute_totals",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)
        self._began = None
        self._gather_fn = None

    def start(self, x, after=()):
        """`x`, available only after this replica's start time is taken,
        which is after the batch exists and after `after` (the variables
        the step reads) are read."""
        # After the batch exists: the wait for input is not compute. After
        # the variables are read: a batch prefetched during the previous
        # step's all-reduce must not start the clock while this replica
        # still waits there for the slowest (measured: the fast worker's
        # time then held the barrier wait, and the shares did not move).
        reads = [tf.convert_to_tensor(v) for v in after]
        with tf.control_dependencies(tf.nest.flatten(x) + reads):
            self._began = tf.timestamp()
        with tf.control_dependencies([self._began]):
            return tf.nest.map_structure(tf.identity, x)

    def stop(self, grads, x):
        """`grads`, available only after this replica's time is added."""
        present = [g for g in grads if g is not None]
        with tf.control_dependencies(present):
            seconds = tf.timestamp() - self._began
        examples = tf.shape(tf.nest.flatten(x)[0])[0]
        added = self._totals.assign_add(tf.stack([
            tf.cast(seconds, tf.float32), tf.cast(examples, tf.float32)]))
        with tf.control_dependencies([added]):
            return [None if g is None else tf.identity(g) for g in grads]

    def _gather_step(self):
        def per_replica():
            ctx = tf.distribute.get_replica_context()
            mine = tf.convert_to_tensor(self._totals)
            placed = tf.one_hot(ctx.replica_id_in_sync_group,
                                self._replicas)[:, None] * mine[None, :]
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, placed)
            with tf.control_dependencies([summed]):
                reset = self._totals.assign(tf.zeros([2], tf.float32))
            with tf.control_dependencies([reset]):
                return tf.identity(summed)
        return self._strategy.experimental_local_results(
            self._strategy.run(per_replica))[0]

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """Every replica's (seconds, examples) since the last gather, on
        every worker the same; resets the sums. A collective: every worker
        calls it at the same loop boundary."""
        if self._gather_fn is None:
            self._gather_fn = tf.function(self._gather_step)
        totals = self._gather_fn().numpy()
        return totals[:, 0].astype(float), totals[:, 1].astype(float)

