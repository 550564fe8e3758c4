"""Trainer runs for the golden-equivalence tests, one process per layout set.

Usage: trainer_golden.py MODE OUT_JSON [MODEL_DIR]  ('{index}' in OUT_JSON
becomes the worker index)
MODE=local: 4 simulated CPU devices; every case runs on one device (the
golden run), 2 and 4 mirrored replicas. MODE=multi_worker: TF_CONFIG from
the environment, one replica per worker; also counts the gradient
all-reduces in the traced loop for K=1 and K=4, and with MODEL_DIR saves
checkpoints from every worker into it.
Writes {layout: {case: {"loss": per-step losses, "weights": [...], ...}}}.
"""

import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

from layouts import golden_layouts  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
layouts = golden_layouts(MODE, (2, 4))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.bench import communication  # noqa: E402

from golden_data import (  # noqa: E402
    BATCH, X, X_EVAL, Y, Y_EVAL, padded_eval_dataset)

STEPS = 8


# case -> (optimizer factory, Trainer keyword arguments, regularised model)
CASES = {
    "sgd_momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {},
                     False),
    "adam": (lambda: keras.optimizers.Adam(0.01), {}, False),
    # A norm of 0.05 is far below the gradient norms here (about 1), so
    # every step clips.
    "clip": (lambda: keras.optimizers.SGD(0.1, momentum=0.9),
             {"clip_global_norm": 0.05}, False),
    "keras_global_clipnorm": (
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
        {}, False),
    "accum": (lambda: keras.optimizers.Adam(0.01), {"grad_accum_steps": 4},
              False),
    "regularized": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {},
                    True),
    "bfloat16_allreduce": (lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                           {"allreduce_dtype": "bfloat16"}, False),
}


def build(strategy, make_optimizer, regularized):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        reg = keras.regularizers.L2(0.05) if regularized else None
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=reg),
            keras.layers.Dense(3, kernel_regularizer=reg)])
        return model, make_optimizer(), [
            keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def run_case(name, strategy, golden):
    make_optimizer, kwargs, regularized = CASES[name]
    model, optimizer, metrics = build(strategy, make_optimizer, regularized)
    k = kwargs.get("grad_accum_steps", 1)
    if golden:
        # One device takes the K micro-batches as one batch of K*B.
        kwargs = dict(kwargs, grad_accum_steps=1)
    batch = BATCH * k if golden else BATCH
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        metrics=metrics,
        steps_per_loop=4, **kwargs)
    train = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        batch, drop_remainder=True)
    history = trainer.fit(strategy.experimental_distribute_dataset(train),
                          steps=STEPS, verbose=0)
    eval_data = (tf.data.Dataset.from_tensor_slices((X_EVAL, Y_EVAL)).batch(
        BATCH) if golden else strategy.experimental_distribute_dataset(
            padded_eval_dataset()))
    replicas = [[r.numpy().tolist() for r in
                 strategy.experimental_local_results(v.value)]
                for v in model.trainable_variables]
    return {"loss": history["step_loss"], "accuracy": history["accuracy"],
            "eval": trainer.evaluate(eval_data),
            "weights": [w.tolist() for w in model.get_weights()],
            "replicas_equal": all(np.array_equal(r[0], other)
                                  for r in replicas for other in r[1:])}


def count_gradient_all_reduces(strategy, k):
    """CollectiveReduceV2 ops inside the traced loop's while body."""
    model, optimizer, _ = build(strategy, CASES["adam"][0], False)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, grad_accum_steps=k,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    train = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        BATCH, drop_remainder=True)
    trainer.fit(train, steps=1, verbose=0)
    loop = next(iter(trainer.runner.loops.values())).traced
    graph = loop.get_concrete_function(
        trainer.runner.iterator, tf.constant(1)).graph.as_graph_def()
    return communication.count_ops(graph, "CollectiveReduceV2",
                                   within="while_body")


results = {}
for layout, strategy in layouts.items():
    results[layout] = {}
    for name in CASES:
        # Tracing under MirroredStrategy in a process that holds many traced
        # functions stalled for minutes in Python's garbage collector (TF
        # 2.21); freezing what exists keeps each collection small.
        gc.collect()
        gc.freeze()
        results[layout][name] = run_case(name, strategy,
                                         layout == "one_device")
# The last layout: mirrored4, or the one multi_worker replica per worker.
gc.collect()
gc.freeze()
results["all_reduces_per_update"] = {
    str(k): count_gradient_all_reduces(strategy, k) for k in (1, 4)}
results["local_replicas"] = len(strategy.extended.worker_devices)
results["is_chief"] = tfmulti.cluster_config().is_chief
if len(sys.argv) > 3:
    # Every worker saves; only the chief's files may reach MODEL_DIR.
    model_dir = sys.argv[3]
    model, optimizer, _ = build(strategy, CASES["sgd_momentum"][0], False)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=2,
        model_dir=model_dir,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    train = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        BATCH, drop_remainder=True)
    trainer.fit(train, steps=4, checkpoint_every=2, verbose=0)
    # Read by the chief only: it wrote the files before its fit returned,
    # while worker 1 may get here before the chief's last save lands.
    if tfmulti.cluster_config().is_chief:
        from tfmulti.training import checkpoints
        results["checkpoint_step"] = checkpoints.read_position(
            tf.train.latest_checkpoint(model_dir)).step
with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump(results, f)
