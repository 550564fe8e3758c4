"""The flat, padded vector a sharded optimizer cuts into N equal shards.

The trainable variables are concatenated in order and padded to a multiple
of N, so any layer sizes split evenly; shard r is the r-th 1/N of it.
"""

from __future__ import annotations

import math

import tensorflow as tf


class FlatLayout:
    """Where each variable's elements sit in the flat, padded vector.

    Args:
      shapes: the variables' shapes.
      num_shards: N.
    """

    def __init__(self, shapes, num_shards: int):
        self.shapes = [tf.TensorShape(s) for s in shapes]
        self.sizes = [int(s.num_elements()) for s in self.shapes]
        self.total = sum(self.sizes)
        self.num_shards = int(num_shards)
        self.shard_size = max(1, math.ceil(self.total / self.num_shards))
        self.padded = self.shard_size * self.num_shards

    def flatten(self, tensors):
        """The tensors as one padded vector of length `padded`."""
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        return tf.pad(flat, [[0, self.padded - self.total]])

    def shard(self, flat, index: int):
        """Shard `index` of a flat vector."""
        start = index * self.shard_size
        return flat[start:start + self.shard_size]

    def shard_of(self, tensors, index: int):
        """`shard(flatten(tensors), index)`, built from the pieces of the
        tensors that overlap shard `index` only: 1/N of the copying, which
        a replica does for its gradient and parameters at every update."""
        start = index * self.shard_size
        stop = start + self.shard_size
        pieces, offset = [], 0
        for tensor, size in zip(tensors, self.sizes):
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                pieces.append(tf.reshape(tensor, [-1])[low - offset:
                                                       high - offset])
            offset += size
        padding = stop - max(start, min(stop, self.total))
        if padding:
            pieces.append(tf.zeros([padding], tensors[0].dtype))
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)

    def unflatten(self, flat):
        """The padded vector back as tensors of the variables' shapes."""
        parts = tf.split(flat[:self.total], self.sizes)
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]
