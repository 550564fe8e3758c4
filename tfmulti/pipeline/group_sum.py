"""Summing one stage's gradients across the data-parallel groups.

Each stage's gradients live on D devices (one per group). They are packed
into one flat vector per device and summed with TensorFlow's collective
all-reduce (`CollectiveReduce`, the op MirroredStrategy's and
MultiWorkerMirroredStrategy's collective implementations run), one group key
per stage, so the D copies of a stage stay equal without a parameter copy.

Measured: `CollectiveReduceV2` between logical CPU devices inside one
`tf.function` never completes on TF 2.21 without a collective launcher;
the V1 op does, so the V1 op is used.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

# Far above the keys tf.distribute hands out (from 1 upwards), so a strategy
# in the same process never shares a key with a pipeline.
_GROUP_KEYS = itertools.count(1_000_000)
_INSTANCE_KEYS = itertools.count(1_000_000)


class StageAllReduce:
    """All-reduce (sum) of one stage's gradients over its D devices."""

    def __init__(self, devices):
        self.devices = list(devices)
        self.group_key = next(_GROUP_KEYS)
        self.instance_key = next(_INSTANCE_KEYS)

    def __call__(self, per_device_grads):
        """per_device_grads[d]: a list of gradients on devices[d].

        Returns:
          The same structure, each gradient replaced by the sum over d.
        """
        if len(self.devices) == 1:
            return per_device_grads
        shapes = [g.shape for g in per_device_grads[0]]
        sizes = [int(s.num_elements()) for s in shapes]
        out = []
        for device, grads in zip(self.devices, per_device_grads):
            with tf.device(device):
                flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
                summed = tf.raw_ops.CollectiveReduce(
                    input=flat, group_size=len(self.devices),
                    group_key=self.group_key, instance_key=self.instance_key,
                    merge_op="Add", final_op="Id", subdiv_offsets=[0])
                parts = tf.split(summed, sizes)
                out.append([tf.reshape(p, s) for p, s in zip(parts, shapes)])
        return out
