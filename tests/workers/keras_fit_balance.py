"""Balanced Keras `fit` (tfmulti.keras.distributed(model, balance=...))
against an even split and one device.

Usage: keras_fit_balance.py MODE OUT_JSON  ('{index}' in OUT_JSON becomes the
worker index)
MODE=local: 4 simulated CPU devices; every case with plain Keras `fit` on one
device (golden), through `distributed` on 2 replicas with balance None (the
even split), [3, 1] and "auto", and on 4 with [3, 1, 1, 1].
MODE=multi_worker: TF_CONFIG from the environment, one replica per worker,
balance None, [3, 1] and "auto"; then plain Keras on this worker's own CPU
(the golden run).
Writes {layout: {case: {"loss", "weights", "val_loss", "eval", ...}}}.
"""

import gc
import inspect
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

from layouts import golden_layouts  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
layouts = golden_layouts(MODE, (2, 4))
if MODE == "multi_worker":
    import tensorflow as tf

    # The golden run on this worker's own CPU: no collectives, so each
    # worker runs it by itself (after the workers' runs).
    layouts["one_device"] = tf.distribute.OneDeviceStrategy(
        tf.config.list_logical_devices("CPU")[0].name)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from golden_data import BATCH, X, Y, padded_eval_dataset  # noqa: E402

# 20 updates: 2 epochs of 10, 5 per call of the train function (4 calls:
# "auto" may move the shares after the second and third).
EPOCHS, STEPS_PER_EPOCH, SPE = 2, 10, 5

# case -> (optimizer factory, distributed() options, mixed precision)
CASES = {
    "adam": (lambda: keras.optimizers.Adam(0.01), {}, None),
    # Keras's own global_clipnorm acts on the reduced gradient under
    # `distributed`; 0.05 is far below the gradient norms (about 1): every
    # step clips.
    "clip": (lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                          global_clipnorm=0.05), {}, None),
    "accum": (lambda: keras.optimizers.Adam(0.01), {"grad_accum_steps": 4},
              None),
    "mixed_float16": (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {},
                      "mixed_float16"),
}


class Calls(keras.callbacks.Callback):
    """Each train-function call's balance logs."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()
                          if k.startswith(("share_", "replica_seconds_",
                                           "idle_fraction"))})


def build(strategy, make_optimizer, precision, steps_per_execution):
    keras.mixed_precision.set_global_policy(precision or "float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        optimizer = make_optimizer()
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, dtype="float32")])
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      weighted_metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    return model


def traces(model):
    """Traces of the train loop `distributed`'s train function runs."""
    train = inspect.getclosurevars(model.train_function).nonlocals["train"]
    return train.traced.experimental_get_tracing_count()


def run_case(name, strategy, balance, golden, finite=False):
    make_optimizer, options, precision = CASES[name]
    k = options.get("grad_accum_steps", 1)
    calls = Calls()
    if golden:
        # Plain Keras on one device, one step per call; the K micro-batches
        # of an accumulated update are one batch of K*B.
        model = build(strategy, make_optimizer, precision, 1)
        batch = BATCH * k
    else:
        model = tfmulti.keras.distributed(
            build(strategy, make_optimizer, precision, SPE),
            balance=balance, **options)
        batch = BATCH
    train = tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        batch, drop_remainder=True)
    history = model.fit(train if finite else train.repeat(), epochs=EPOCHS,
                        steps_per_epoch=None if finite else STEPS_PER_EPOCH,
                        validation_data=padded_eval_dataset(), verbose=0,
                        callbacks=[calls])
    out = {"loss": history.history["loss"],
           "accuracy": history.history["accuracy"],
           "val_loss": history.history["val_loss"],
           "eval": model.evaluate(padded_eval_dataset(), verbose=0,
                                  return_dict=True),
           "iterations": int(model.optimizer.iterations.numpy()),
           "weights": [w.tolist() for w in model.get_weights()]}
    keras.mixed_precision.set_global_policy("float32")
    if not golden:
        replicas = [[r.numpy().tolist() for r in
                     strategy.experimental_local_results(v.value)]
                    for v in model.trainable_variables]
        out["replicas_equal"] = all(np.array_equal(r[0], other)
                                    for r in replicas for other in r[1:])
        out["traces"] = traces(model)
        out["calls"] = calls.logs
    return out


# Float32 only on workers: the float16 split rounding is the local test's.
MULTI_WORKER_CASES = ("adam", "clip", "accum")
RUNS = {"one_device": [None], "mirrored2": [None, [3, 1], "auto"],
        "mirrored4": [[3, 1, 1, 1]], "multi_worker": [None, [3, 1], "auto"]}

results = {}
for layout, strategy in layouts.items():
    for balance in RUNS[layout]:
        key = f"{layout}:{balance}"
        results[key] = {}
        for name in CASES if MODE == "local" else MULTI_WORKER_CASES:
            gc.collect()
            gc.freeze()
            results[key][name] = run_case(name, strategy, balance,
                                          golden=layout == "one_device")


class Interrupted(Exception):
    pass


class StopAt(keras.callbacks.Callback):
    """Raises before batch 5 of epoch 1, after the backup taken there."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (1, SPE):
            raise Interrupted()


def resumed(strategy, backup_dir):
    """Adam under "auto", stopped mid-epoch and resumed by a new model (a
    new process's state: a new balanced iterator at the stream's start)."""
    train = tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        BATCH, drop_remainder=True).repeat()
    make_optimizer = CASES["adam"][0]
    for stop in (True, False):
        model = tfmulti.keras.distributed(
            build(strategy, make_optimizer, None, SPE), balance="auto")
        backup = tfmulti.keras.BackupAndRestore(backup_dir, save_freq=SPE)
        try:
            model.fit(train, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                      verbose=0, callbacks=[backup] + [StopAt()] * stop)
        except Interrupted:
            continue
    return {"restored": list(backup.restored),
            "iterations": int(model.optimizer.iterations.numpy()),
            "weights": [w.tolist() for w in model.get_weights()]}


if MODE == "local":
    # A finite dataset, no steps_per_epoch: one pass (16 steps) per epoch.
    results["finite"] = {
        layout: run_case("adam", layouts[layout], balance,
                         golden=layout == "one_device", finite=True)
        for layout, balance in (("one_device", None), ("mirrored2", "auto"))}
    results["resumed"] = resumed(layouts["mirrored2"], os.path.join(
        os.path.dirname(OUT), "backup"))
with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump(results, f)
