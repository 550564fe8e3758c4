"""Trainer jobs for the elastic-resume tests: train to a step in a model_dir
(resuming whatever is there) on a given layout.

Usage: elastic_resume.py DEVICES JOBS_JSON
DEVICES: simulated CPU devices. JOBS_JSON: a list of [layout, model_dir,
steps, out_json] run in order in this process; layout: one_device,
mirrored2, mirrored4 or multi_worker (TF_CONFIG from the environment; then
every job of the process), '{index}' in out_json becomes the worker index. Each out_json gets the weights, the
per-example count of how often each example was trained on (a variable in
the model, saved and restored with it), the step reached, and the restore
line the Trainer printed.
"""

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

DEVICES, JOBS = int(sys.argv[1]), json.loads(sys.argv[2])
devices = tfmulti.simulate_devices(DEVICES) if DEVICES > 1 else None
cluster = tfmulti.cluster_config()
strategies = {}


def strategy_for(layout):
    if layout not in strategies:
        strategies[layout] = tfmulti.create_strategy(
            "mirrored", devices=devices[:int(layout[-1])]) if (
                layout.startswith("mirrored")) else tfmulti.create_strategy(
                    layout)
    return strategies[layout]


if JOBS[0][0] == "multi_worker":
    strategy_for("multi_worker")       # before any other TensorFlow op

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

EXAMPLES, GLOBAL_BATCH = 128, 16       # 8 steps per epoch
rng = np.random.default_rng(0)
X = rng.normal(size=(EXAMPLES, 8)).astype("float32")
Y = rng.integers(0, 3, size=(EXAMPLES,)).astype("int32")


def dataset_fn(input_context):
    del input_context        # distribute_dataset shards by element
    ids = np.arange(EXAMPLES, dtype="float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((np.hstack([X, ids]), Y))


class Seen(keras.layers.Layer):
    """Counts, per example id (the last feature), the training steps that
    used it; passes the other features on."""

    def build(self, input_shape):
        # Summed over replicas on read, split over them on restore.
        self.counts = tf.Variable(
            tf.zeros([EXAMPLES]), trainable=False, name="seen",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM)

    def call(self, x, training=False):
        if training:
            ids = tf.cast(x[:, -1], tf.int32)
            self.counts.assign_add(tf.math.bincount(
                ids, minlength=EXAMPLES, maxlength=EXAMPLES,
                dtype=tf.float32))
        return x[:, :-1]


def job(layout, model_dir, steps, out):
    strategy = strategy_for(layout)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        seen = Seen()
        model = keras.Sequential([
            keras.Input((9,)), seen, keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3)])
        # The rate depends on the step: the schedule must continue there.
        schedule = keras.optimizers.schedules.ExponentialDecay(
            0.1, decay_steps=4, decay_rate=0.5)
        optimizer = keras.optimizers.Adam(schedule)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=4,
        model_dir=model_dir,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None))
    data = tfmulti.distribute_dataset(strategy, dataset_fn,
                                      global_batch_size=GLOBAL_BATCH,
                                      shuffle_buffer=0)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        trainer.fit(data, steps=steps, verbose=1)
    with open(out.format(index=cluster.task_index), "w") as f:
        json.dump({
            "step": trainer.step,
            "iterations": int(optimizer.iterations.numpy()),
            "seen": seen.counts.numpy().tolist(),
            "said": said.getvalue(),
            "weights": [w.tolist() for w in model.get_weights()
                        if w.shape != (EXAMPLES,)],
            "slots": [v.numpy().tolist() for v in optimizer.variables
                      if v.shape.rank]}, f)


for spec in JOBS:
    job(*spec)
