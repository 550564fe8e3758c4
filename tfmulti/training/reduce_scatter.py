"""Reduce-scatter of the flat gradient (ZeRO stage 2): each replica gets
only its shard of the summed gradient.

TensorFlow 2.21 has no CPU implementation of `CollectiveReduceScatterV2`
("CollectiveRegistry::Lookup did not find collective implementation undef").
Its all-to-all runs on CPU: every replica sends row j of its [N, shard]
gradient to replica j, and replica r sums the N rows it received, its shard
of the sum, with (N-1)/N of the gradient on the wire, half an all-reduce.
Where the strategy has no collective launchers to issue it from (another
cross-device implementation), the gradient is all-reduced and sliced: the
same numbers at an all-reduce's cost. `path` says which one runs.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import compat
from tfmulti.training import gradients as gradients_lib

ALL_TO_ALL = "all-to-all"
ALL_REDUCE_SLICE = "all-reduce+slice"


def path_for(strategy) -> str:
    """Which reduce-scatter `strategy` gets: ALL_TO_ALL or ALL_REDUCE_SLICE."""
    if strategy.num_replicas_in_sync > 1 and (
            compat.collective_all_reduce(strategy) is not None):
        return ALL_TO_ALL
    return ALL_REDUCE_SLICE


class ReduceScatter:
    """`scatter(grads, index)`: shard `index` of the flat sum of `grads`
    over every replica, from replica context.

    Args:
      strategy: MirroredStrategy or MultiWorkerMirroredStrategy.
      layout: the `flat_layout.FlatLayout` of the gradients.
      options: `tf.distribute.experimental.CommunicationOptions` or None.
      wire_dtype: None, "float16" or "bfloat16": the dtype sent; the
        received rows are summed in the gradients' dtype.
      path: force ALL_TO_ALL or ALL_REDUCE_SLICE (default: `path_for`).
    """

    def __init__(self, strategy, layout, *, options=None, wire_dtype=None,
                 path=None):
        self._layout = layout
        self._options = options
        self._wire = tf.as_dtype(wire_dtype) if wire_dtype else None
        self.path = path or path_for(strategy)
        self._ops = (compat.collective_all_reduce(strategy)
                     if self.path == ALL_TO_ALL else None)

    def payload_bytes(self, dtype) -> int:
        """Bytes one replica hands to the collective per call: the padded
        flat gradient, in the wire dtype."""
        size = (self._wire or tf.as_dtype(dtype)).size
        return self._layout.padded * size

    def __call__(self, grads, index: int):
        flat = self._layout.flatten(grads)
        dtype = flat.dtype
        if self._layout.num_shards == 1:
            return flat
        if self.path == ALL_REDUCE_SLICE:
            summed = gradients_lib.all_reduce_sum(
                [flat], options=self._options,
                dtype=None if self._wire is None else self._wire.name)[0]
            return self._layout.shard(summed, index)
        if self._wire is not None:
            flat = tf.cast(flat, self._wire)
        rows = tf.reshape(flat, [self._layout.num_shards,
                                 self._layout.shard_size])
        received = compat.all_to_all_in_replica(self._ops, rows,
                                                self._options)
        return tf.reduce_sum(tf.cast(received, dtype), axis=0)
