"""Balanced Trainer runs against an even split and one device.

Usage: balance_golden.py MODE OUT_JSON  ('{index}' in OUT_JSON becomes the
worker index)
MODE=local: 4 simulated CPU devices; every case on one device (golden), on 2
mirrored replicas with balance=[1, 1] (even) and [3, 1], on 4 with
[3, 1, 1, 1], and "auto" on 2. MODE=multi_worker: TF_CONFIG from the
environment, one replica per worker, balance=[1, 1], [3, 1] and "auto".
Writes {layout: {case: {"loss", "weights", "accuracy", "eval", ...}}}.
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

from golden_data import (  # noqa: E402
    BATCH, X, X_EVAL, Y, Y_EVAL, padded_eval_dataset)

STEPS = 20

# case -> (optimizer factory, Trainer keyword arguments, mixed precision)
CASES = {
    "adam": (lambda: keras.optimizers.Adam(0.01), {}, None),
    # 0.05 is far below the gradient norms here (about 1): every step clips.
    "clip": (lambda: keras.optimizers.SGD(0.1, momentum=0.9),
             {"clip_global_norm": 0.05}, None),
    "accum": (lambda: keras.optimizers.Adam(0.01), {"grad_accum_steps": 4},
              None),
    "mixed_float16": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {},
                      "mixed_float16"),
}


def build(strategy, make_optimizer, precision):
    keras.mixed_precision.set_global_policy(precision or "float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, dtype="float32")])
        return model, make_optimizer(), [
            keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def run_case(name, strategy, balance):
    make_optimizer, kwargs, precision = CASES[name]
    model, optimizer, metrics = build(strategy, make_optimizer, precision)
    k = kwargs.get("grad_accum_steps", 1)
    golden = balance is None
    if golden:
        # One device takes the K micro-batches as one batch of K*B.
        kwargs = dict(kwargs, grad_accum_steps=1)
    batch = BATCH * k if golden else BATCH
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, balance=balance,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        metrics=metrics, steps_per_loop=5, **kwargs)
    train = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        batch, drop_remainder=True)
    history = trainer.fit(train, steps=STEPS, verbose=0)
    # Evaluation keeps the even split: a padded exact-once pass, as the
    # data layer's eval mode gives (a partial batch hangs across workers).
    eval_data = tf.data.Dataset.from_tensor_slices((X_EVAL, Y_EVAL)).batch(
        BATCH) if golden else strategy.experimental_distribute_dataset(
            padded_eval_dataset())
    keras.mixed_precision.set_global_policy("float32")
    replicas = [[r.numpy().tolist() for r in
                 strategy.experimental_local_results(v.value)]
                for v in model.trainable_variables]
    out = {"loss": history["step_loss"], "accuracy": history["accuracy"],
           "eval": trainer.evaluate(eval_data),
           "weights": [w.tolist() for w in model.get_weights()],
           "replicas_equal": all(np.array_equal(r[0], other)
                                 for r in replicas for other in r[1:]),
           "retraces": len(next(iter(trainer.runner.loops.values())).traced
                           ._list_all_concrete_functions())}
    if not golden:
        out["shares"] = [[history[f"share_{r}"][i] for r in range(
            strategy.num_replicas_in_sync)] for i in range(len(
                history["step"]))]
        out["idle_fraction"] = history["idle_fraction"]
        out["seconds"] = [[history[f"replica_seconds_{r}"][i] for r in range(
            strategy.num_replicas_in_sync)] for i in range(len(
                history["step"]))]
    return out


RUNS = {"one_device": [None], "mirrored2": [[1, 1], [3, 1], "auto"],
        "mirrored4": [[3, 1, 1, 1]], "multi_worker": [[1, 1], [3, 1], "auto"]}

results = {}
for layout, strategy in layouts.items():
    for balance in RUNS[layout]:
        key = f"{layout}:{balance}"
        results[key] = {}
        for name in CASES:
            gc.collect()
            gc.freeze()
            results[key][name] = run_case(name, strategy, balance)
with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump(results, f)
