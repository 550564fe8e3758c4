"""XLA-compiled replica steps against uncompiled ones, in one process.

Usage: xla_golden.py OUT_JSON
4 simulated CPU devices. Writes {case: {"loss": [...], "weights": [...],
"iterations": int, "moved": float, ...}} for: the Trainer on one device
without XLA (the golden run) and with XLA, the Trainer with XLA on 4
mirrored replicas (with and without gradient accumulation), plain Keras
`fit` on one device (two epochs in one call), and two `fit` calls of one
epoch through `distributed` with XLA on 4 replicas (with the distributed
iterators made after each call).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

from layouts import golden_layouts  # noqa: E402

OUT = sys.argv[1]
layouts = golden_layouts("local", (4,))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import models  # noqa: E402

BATCH = 16
STEPS = 6
SHAPE = (8, 8, 3)
rng = np.random.default_rng(0)
X = rng.integers(0, 256, size=(BATCH * 4, *SHAPE)).astype("uint8")
Y = rng.integers(0, 4, size=(len(X),)).astype("int32")


def dataset(batch=BATCH):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        batch, drop_remainder=True).repeat()


def build(strategy, optimizer):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        # Convolutions, pooling, dense: the CNN the bench measures, smaller.
        model = models.small_cnn(SHAPE, 4, batch_norm=False)
        return model, optimizer()


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def moved(model, initial):
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(model.get_weights(), initial))


def trainer_run(strategy, *, jit_compile, **options):
    model, optimizer = build(strategy, sgd)
    initial = model.get_weights()
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=3,
        jit_compile=jit_compile,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        **options)
    k = options.get("grad_accum_steps", 1)
    history = trainer.fit(dataset(BATCH // k), steps=STEPS, verbose=0)
    return {"loss": [float(v) for v in history["step_loss"]],
            "weights": weights(model), "iterations": trainer.step,
            "moved": moved(model, initial)}


def fit_run(strategy, *, tfmulti_fit, jit_compile=False, calls=1):
    model, optimizer = build(strategy, sgd)
    initial = model.get_weights()
    with strategy.scope():
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      metrics=["accuracy"],
                      steps_per_execution=4 if tfmulti_fit else 1)
    if tfmulti_fit:
        model = tfmulti.keras.distributed(model, jit_compile=jit_compile)
    data = dataset()
    losses, made = [], []
    epochs = 2 // calls
    for _ in range(calls):
        history = model.fit(data, epochs=epochs, steps_per_epoch=STEPS // 2,
                            verbose=0)
        losses += history.history["loss"]
        if tfmulti_fit:
            made.append(model._tfmulti_fit.input.iterators_made)
    return {"loss": losses, "weights": weights(model),
            "iterations": int(model.optimizer.iterations.numpy()),
            "iterators_made": made, "moved": moved(model, initial)}


one, four = layouts["one_device"], layouts["mirrored4"]
CASES = {
    "trainer_one_device": lambda: trainer_run(one, jit_compile=False),
    "trainer_one_device_xla": lambda: trainer_run(one, jit_compile=True),
    "trainer_mirrored4_xla": lambda: trainer_run(four, jit_compile=True),
    # K=2 micro-batches of 8 per update: the same updates as batch 16.
    "trainer_mirrored4_xla_accum": lambda: trainer_run(
        four, jit_compile=True, grad_accum_steps=2),
    # PowerSGD's dense warm-up (a tf.cond around the step's strategy.run)
    # with XLA replica steps: at full rank (64 >= min(m, n) of every
    # matrix) it is the synchronous update.
    "trainer_mirrored4_xla_powersgd_full_start3": lambda: trainer_run(
        four, jit_compile=True, compression=tfmulti.PowerSGD(
            rank=64, min_compression_rate=0.01, start_iter=3)),
    "keras_one_device": lambda: fit_run(one, tfmulti_fit=False),
    # Two fit calls of one epoch on the same dataset: XLA, and the kept
    # iterator, against plain Keras fitting two epochs in one call.
    "fit_mirrored4_xla_two_calls": lambda: fit_run(
        four, tfmulti_fit=True, jit_compile=True, calls=2),
}
results = {}
for name, case in CASES.items():
    results[name] = case()
    print("case done:", name, flush=True)
with open(OUT, "w") as f:
    json.dump(results, f)
