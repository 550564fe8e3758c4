"""Sync batch norm on 4 simulated replicas against one device.

Usage: keras_sync_batchnorm.py OUT_JSON
Trains the same model (a BatchNormalization at the top level and one inside
a custom layer) three times over the same global batches: on one device, on
4 replicas with tfmulti.keras.sync_batchnorm, and on 4 replicas without it.
Writes the largest absolute weight difference of each 4-replica run from the
one-device run, and the one-device losses.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

devices = tfmulti.simulate_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmulti.keras  # noqa: E402

GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
# Uneven feature scales make per-slice moments differ from the batch's.
x = (rng.normal(size=(128, 6)) * [1, 2, 3, 4, 5, 6] + [0, 1, 2, 3, 4, 5]
     ).astype("float32")
y = rng.integers(0, 3, size=(128,)).astype("int32")


class Block(keras.layers.Layer):
    """A custom layer holding a BatchNormalization (found by the walk)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.BatchNormalization(momentum=0.5)

    def call(self, inputs, training=None):
        return keras.ops.relu(self.norm(self.dense(inputs),
                                         training=training))


def train(strategy, sync):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.BatchNormalization(momentum=0.5),
            Block(),
            keras.layers.Dense(3)])
        if sync:
            assert tfmulti.keras.sync_batchnorm(model) is model
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"]


golden, golden_loss = train(tfmulti.create_strategy("one_device"), False)
mirrored = tfmulti.create_strategy("mirrored", devices=devices)
assert mirrored.num_replicas_in_sync == 4
result = {"golden_loss": golden_loss}
for name, sync in (("sync", True), ("unsynced", False)):
    weights, loss = train(mirrored, sync)
    result[name] = max(float(np.max(np.abs(a - b)))
                       for a, b in zip(weights, golden))
    result[name + "_loss"] = loss
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
