"""Trainer mixed precision, overflow skipping, checkpoint resume and
TensorBoard output on 2 simulated CPU replicas (one process).

Usage: trainer_features.py OUT_JSON WORK_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

devices = tfmulti.simulate_devices(2)
strategy = tfmulti.create_strategy("mirrored", devices=devices)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

OUT, WORK = sys.argv[1], sys.argv[2]
BATCH = 32
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 8)).astype("float32")
Y = rng.integers(0, 3, size=(256,)).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


def trainer_for(policy="float32", **kwargs):
    keras.mixed_precision.set_global_policy(policy)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(0.01)
    keras.mixed_precision.set_global_policy("float32")
    return tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                           metrics=["sparse_categorical_accuracy"], **kwargs)


def dataset(x=X, y=Y):
    return strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            BATCH, drop_remainder=True))


def per_replica(variables):
    return [[r.numpy() for r in strategy.experimental_local_results(v.value)]
            for v in variables]


results = {}

# float16: trains without NaN; an overflow on replica 1 only is skipped on
# both replicas. Global batch 4 of the 8 rows below is, for replica 1, rows
# 16..31: scaled by 1e6 they overflow float16 (max 65504).
for policy in ("mixed_float16", "mixed_bfloat16"):
    trainer = trainer_for(policy, mixed_precision=policy, steps_per_loop=4)
    history = trainer.fit(dataset(), steps=16, verbose=0)
    results[policy] = {
        "loss": history["step_loss"],
        "optimizer": type(trainer.optimizer).__name__,
        "compute_dtype": trainer.model.layers[0].compute_dtype}

trainer = trainer_for("mixed_float16", steps_per_loop=1)
x_bad = X.copy()
x_bad[3 * BATCH + BATCH // 2:4 * BATCH] *= 1e6
data = dataset(x_bad)
trainer.fit(data, steps=3, verbose=0)
before = per_replica(trainer.model.trainable_variables)
scale_before = float(trainer.optimizer.dynamic_scale.numpy())
iterations_before = int(trainer.optimizer.iterations.numpy())
history = trainer.fit(data, steps=4, verbose=0)
after = per_replica(trainer.model.trainable_variables)
trainer.fit(data, steps=5, verbose=0)
after_next = per_replica(trainer.model.trainable_variables)
results["overflow"] = {
    "overflow_loss_finite": bool(np.isfinite(history["step_loss"][-1])),
    "unchanged": all(np.array_equal(b, a) for vb, va in zip(before, after)
                     for b, a in zip(vb, va)),
    "replicas_equal_after": all(np.array_equal(v[0], v[1]) for v in after),
    "scale_before": scale_before,
    "scale_after": float(trainer.optimizer.dynamic_scale.numpy()),
    "iterations_before": iterations_before,
    "iterations_after": int(trainer.optimizer.iterations.numpy()),
    "next_step_trains": not all(
        np.array_equal(a[0], n[0]) for a, n in zip(after, after_next)),
    # Weights and every optimizer slot stay finite after the skipped step.
    "finite_after_next": all(
        np.isfinite(r).all() for v in after_next for r in v) and all(
            np.isfinite(np.asarray(v.numpy())).all()
            for v in trainer.optimizer.variables),
}

# Resume: 4 steps, a new process-state (fresh model, optimizer, Trainer and
# iterator) restored from model_dir, 4 more: same as 8 uninterrupted steps.
full_dir, resumed_dir = (os.path.join(WORK, d) for d in ("full", "resumed"))
full = trainer_for(steps_per_loop=2, model_dir=full_dir)
full_history = full.fit(
    dataset(), steps=8, verbose=0, eval_every=4,
    eval_data=tf.data.Dataset.from_tensor_slices((X[:64], Y[:64])).batch(
        BATCH))
first = trainer_for(steps_per_loop=2, model_dir=resumed_dir)
first.fit(dataset(), steps=4, verbose=0)
second = trainer_for(steps_per_loop=2, model_dir=resumed_dir)
second_history = second.fit(dataset(), steps=8, verbose=1)
results["resume"] = {
    "full_loss": full_history["step_loss"],
    "resumed_loss": second_history["step_loss"],
    "full_weights": [w.tolist() for w in full.model.get_weights()],
    "resumed_weights": [w.tolist() for w in second.model.get_weights()],
    "resumed_step": second.step,
    "checkpoints": sorted(os.listdir(resumed_dir)),
}

tags = {}
for root, _, files in os.walk(os.path.join(full_dir, "train")):
    for name in files:
        for event in tf.compat.v1.train.summary_iterator(
                os.path.join(root, name)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
results["summaries"] = tags

with open(OUT, "w") as f:
    json.dump(results, f)
