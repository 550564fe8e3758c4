"""One process of the exact-once evaluation test (or its golden run).

Usage: data_eval_worker.py OUT_JSON STRATEGY [DATA_DIR]  ('{index}' in
OUT_JSON becomes the worker index). STRATEGY is `one_device` (golden: all
examples in one batch, no tfmulti pipeline), `mirrored3` (3 simulated
replicas) or `multi_worker` (TF_CONFIG from the environment).

Evaluates a fixed model on 1001 synthetic examples (`synthetic`) and, given
DATA_DIR, a fixed linear model on the prepared `tfmulti_shapes` test split
read through `tfds_dataset_fn` (`shapes`, sharded by file). Writes, per
dataset, Keras `evaluate` results (weighted metrics) and the sums of a custom
loop over the same distributed dataset (examples, correct, cross-entropy),
and the error for a global batch of 50.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

MODE = sys.argv[2]
DATA_DIR = sys.argv[3] if len(sys.argv) > 3 else None
if MODE == "mirrored3":
    tfmulti.simulate_devices(3)
strategy = tfmulti.create_strategy(
    {"mirrored3": "mirrored"}.get(MODE, MODE))
OUT = sys.argv[1].format(index=tfmulti.cluster_config().task_index)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from golden_data import compiled_eval_model  # noqa: E402

GLOBAL_BATCH = 48
rng = np.random.default_rng(0)


def compiled_model(input_shape, layers, weights):
    return compiled_eval_model(strategy, input_shape, layers, weights)


def evaluate(model, dataset_fn, x, y, map_fn=None):
    def sums(features, label, weight):
        logits = model(features, training=False)
        xent = tf.keras.losses.sparse_categorical_crossentropy(
            label, logits, from_logits=True)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1), label), tf.float32)
        return tf.stack([tf.reduce_sum(weight),
                         tf.reduce_sum(weight * correct),
                         tf.reduce_sum(weight * xent),
                         tf.cast(tf.shape(weight)[0], tf.float32)])

    if MODE == "one_device":
        evaluation = model.evaluate(x, y, batch_size=len(x), verbose=0,
                                    return_dict=True)
        totals, steps = sums(x, y, tf.ones([len(x)])).numpy(), 1
    else:
        dist = tfmulti.distribute_dataset(
            strategy, dataset_fn, global_batch_size=GLOBAL_BATCH,
            training=False, map_fn=map_fn)
        evaluation = model.evaluate(dist, verbose=0, return_dict=True)

        @tf.function
        def step(batch):
            return strategy.reduce("SUM", strategy.run(sums, args=batch),
                                   axis=None)

        totals, steps = np.zeros(4), 0
        for batch in dist:
            totals += step(batch).numpy()
            steps += 1
    return {"evaluate": evaluation, "examples": float(totals[0]),
            "accuracy": float(totals[1] / totals[0]),
            "xent": float(totals[2] / totals[0]),
            "rows": float(totals[3]), "steps": steps,
            "replicas": strategy.num_replicas_in_sync}


x = rng.normal(size=(1001, 8)).astype("float32")
y = rng.integers(0, 4, size=(1001,)).astype("int64")
synthetic_fn = lambda _: tf.data.Dataset.from_tensor_slices((x, y))  # noqa
model = compiled_model(
    (8,), [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)],
    [rng.normal(scale=0.5, size=s).astype("float32")
     for s in [(8, 16), (16,), (16, 4), (4,)]])
result = {"synthetic": evaluate(model, synthetic_fn, x, y)}

if DATA_DIR:
    shapes_fn = tfmulti.tfds_dataset_fn("tfmulti_shapes", "test",
                                        data_dir=DATA_DIR)
    images, labels = (np.stack(a) for a in zip(*shapes_fn.read(None)
                                              .as_numpy_iterator()))
    linear = compiled_model(
        (32, 32, 3), [keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
                      keras.layers.Dense(10)],
        [rng.normal(scale=0.05, size=s).astype("float32")
         for s in [(3072, 10), (10,)]])
    # float32, not uint8: Keras's first step all-reduces a batch to build
    # the model, and collectives have no uint8 kernel under multi_worker.
    result["shapes"] = evaluate(
        linear, shapes_fn, images.astype("float32"), labels,
        map_fn=lambda image, label: (tf.cast(image, tf.float32), label))

try:
    tfmulti.distribute_dataset(strategy, synthetic_fn, global_batch_size=50)
    result["batch_error"] = None
except ValueError as e:
    result["batch_error"] = str(e)

with open(OUT, "w") as f:
    json.dump(result, f)
