"""One process of the exact-once evaluation test (or its golden run).

Usage: data_eval_worker.py OUT_JSON STRATEGY  ('{index}' in OUT_JSON becomes
the worker index). STRATEGY is `one_device` (golden: the 1001 examples in one
batch, no tfmulti pipeline), `mirrored3` (3 simulated replicas) or
`multi_worker` (TF_CONFIG from the environment).

Writes Keras `evaluate` results (weighted metrics), the sums of a custom
loop over the same distributed dataset (examples, correct, cross-entropy),
and the error for a global batch of 50.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

MODE = sys.argv[2]
if MODE == "mirrored3":
    tfmulti.simulate_devices(3)
strategy = tfmulti.create_strategy(
    {"mirrored3": "mirrored"}.get(MODE, MODE))
OUT = sys.argv[1].format(index=tfmulti.cluster_config().task_index)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_EXAMPLES, NUM_CLASSES, GLOBAL_BATCH = 1001, 4, 48
rng = np.random.default_rng(0)
x = rng.normal(size=(NUM_EXAMPLES, 8)).astype("float32")
y = rng.integers(0, NUM_CLASSES, size=(NUM_EXAMPLES,)).astype("int64")
# Fixed weights from numpy: the same model in every process, whatever the
# strategy does with Keras's RNG.
weights = [rng.normal(scale=0.5, size=s).astype("float32")
           for s in [(8, 16), (16,), (16, NUM_CLASSES), (NUM_CLASSES,)]]

with strategy.scope():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(NUM_CLASSES)])
    model.set_weights(weights)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[
            "accuracy",
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True,
                                                        name="xent")])


def dataset_fn(input_context):
    del input_context
    return tf.data.Dataset.from_tensor_slices((x, y))


def sums(features, label, weight):
    logits = model(features, training=False)
    xent = tf.keras.losses.sparse_categorical_crossentropy(
        label, logits, from_logits=True)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1), label), tf.float32)
    return tf.stack([tf.reduce_sum(weight), tf.reduce_sum(weight * correct),
                     tf.reduce_sum(weight * xent),
                     tf.cast(tf.shape(weight)[0], tf.float32)])


if MODE == "one_device":
    evaluation = model.evaluate(x, y, batch_size=NUM_EXAMPLES, verbose=0,
                                return_dict=True)
    totals = sums(x, y, tf.ones([NUM_EXAMPLES])).numpy()
    steps = 1
else:
    dist = tfmulti.distribute_dataset(strategy, dataset_fn,
                                      global_batch_size=GLOBAL_BATCH,
                                      training=False)
    evaluation = model.evaluate(dist, verbose=0, return_dict=True)

    @tf.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(sums, args=batch),
                               axis=None)

    totals, steps = np.zeros(4), 0
    for batch in dist:
        totals += step(batch).numpy()
        steps += 1

try:
    tfmulti.distribute_dataset(strategy, dataset_fn, global_batch_size=50)
    batch_error = None
except ValueError as e:
    batch_error = str(e)

with open(OUT, "w") as f:
    json.dump({"evaluate": evaluation, "examples": float(totals[0]),
               "accuracy": float(totals[1] / totals[0]),
               "xent": float(totals[2] / totals[0]),
               "rows": float(totals[3]), "steps": steps,
               "replicas": strategy.num_replicas_in_sync,
               "batch_error": batch_error}, f)
