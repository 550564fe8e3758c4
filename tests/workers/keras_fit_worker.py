"""One process of the multi-worker Keras fit test (or its golden run).

Usage: keras_fit_worker.py OUT_JSON STRATEGY  ('{index}' in OUT_JSON becomes
the worker index)
With STRATEGY=multi_worker, TF_CONFIG comes from the environment; with
STRATEGY=one_device it is the single-process golden run over the same
global batches.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

name = sys.argv[2]
strategy = tfmulti.create_strategy(name)
out = sys.argv[1].format(index=tfmulti.cluster_config().task_index)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
# uint8 features, as images come: the strategy must reduce a uint8 batch
# while Keras builds the model (collectives have no uint8 kernel).
x = rng.integers(0, 256, size=(256, 8)).astype("uint8")
y = rng.integers(0, 3, size=(256,)).astype("int32")

with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,), dtype="uint8"),
                              keras.layers.Rescaling(1 / 128.0, offset=-1.0),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"])

# Global batches; under multi_worker each worker takes its half of every
# batch, so one update sees the same 32 examples as the golden run.
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
history = model.fit(ds, epochs=3, verbose=0)
evaluation = model.evaluate(ds, verbose=0, return_dict=True)
cluster = tfmulti.cluster_config()
with open(out, "w") as f:
    json.dump({"loss": history.history["loss"],
               "accuracy": history.history["accuracy"],
               "eval": evaluation,
               "is_chief": cluster.is_chief,
               "weights": [w.tolist() for w in model.get_weights()]}, f)
