"""`model.fit` through tfmulti.keras.distributed, for the golden tests.

Usage: keras_fit_distributed.py MODE OUT_JSON  ('{index}' in OUT_JSON becomes
the worker index)
MODE=local: 4 simulated CPU devices; every case runs with plain Keras on one
device (the golden run) and through `distributed` on 4 mirrored replicas.
MODE=multi_worker: TF_CONFIG from the environment, one replica per worker,
the cases in MULTI_WORKER_CASES.
Writes {layout: {case: {"loss": per-epoch losses, "weights": [...], ...}}}.
"""

import gc
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

from layouts import golden_layouts  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
layouts = golden_layouts(MODE, (4,))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from golden_data import (  # noqa: E402
    BATCH, X, X_EVAL, Y, Y_EVAL, padded_eval_dataset)

SPE = 8
# 12 steps an epoch with 8 steps per call: every epoch ends with a call of
# 4 steps, which Keras announces as steps 8..15.
STEPS_PER_EPOCH = 12
EPOCHS = 2


def train_dataset(batch):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        batch, drop_remainder=True).repeat()


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


# case -> (optimizer factory, distributed() options, golden optimizer
# factory, golden batch, updates per epoch). The golden run is plain Keras
# `fit` on one device.
CASES = {
    "sgd_momentum": (sgd, {}, sgd, BATCH, STEPS_PER_EPOCH),
    # Keras's own `global_clipnorm` acts on the reduced gradient too; 0.05
    # is far below the gradient norms here (about 1): every step clips.
    "adam_clipnorm": (
        lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05), {},
        lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05), BATCH,
        STEPS_PER_EPOCH),
    # tfmulti's options: 4 micro-batches of 32 per update, clipped, equal
    # one device at batch 128.
    "clip_accum": (sgd, {"clip_global_norm": 0.05, "grad_accum_steps": 4},
                   lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                                global_clipnorm=0.05),
                   4 * BATCH, 6),
    # clip_accum with the optimizer state sharded over the replicas (its
    # golden run is clip_accum's).
    "sharded_clip_accum": (sgd, {"clip_global_norm": 0.05,
                                 "grad_accum_steps": 4,
                                 "shard_optimizer_state": True},
                           None, 4 * BATCH, 6),
    # The same at ZeRO stage 2 (the gradient reduce-scattered).
    "sharded2_clip_accum": (sgd, {"clip_global_norm": 0.05,
                                  "grad_accum_steps": 4,
                                  "shard_optimizer_state": 2},
                            None, 4 * BATCH, 6),
}
# Distributed only: compared with another case's golden run.
NO_GOLDEN = ("sharded_clip_accum", "sharded2_clip_accum")
MULTI_WORKER_CASES = ("sgd_momentum", "clip_accum", "sharded_clip_accum",
                      "sharded2_clip_accum")


def build(strategy, make_optimizer, steps_per_execution):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        # The optimizer binds the strategy in scope at its creation.
        optimizer = make_optimizer()
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      weighted_metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    return model


def run_case(strategy, case, golden):
    make_opt, options, make_golden_opt, golden_batch, steps = CASES[case]
    if golden:
        # Keras's defaults: one step per call (with more, Keras's own loop
        # runs whole calls past `steps_per_epoch`).
        model = build(strategy, make_golden_opt, 1)
        batch = golden_batch
    else:
        model = tfmulti.keras.distributed(build(strategy, make_opt, SPE),
                                          **options)
        batch = BATCH
    began = time.perf_counter()
    history = model.fit(train_dataset(batch), epochs=EPOCHS,
                        steps_per_epoch=steps, verbose=0,
                        validation_data=padded_eval_dataset())
    result = {"loss": history.history["loss"],
              "accuracy": history.history["accuracy"],
              "val_loss": history.history["val_loss"],
              "iterations": int(model.optimizer.iterations.numpy()),
              "weights": [w.tolist() for w in model.get_weights()],
              # Sharded: what the end of fit gathered into it.
              "optimizer": [v.numpy().tolist()
                            for v in model.optimizer.variables],
              "fit_seconds": time.perf_counter() - began}
    sharding = tfmulti.keras.fit_state.sharding_of(model)
    if sharding is not None:
        result["bytes_per_device"] = sharding.state_bytes_per_device()
    if case == "sgd_momentum":
        result["eval"] = model.evaluate(padded_eval_dataset(), verbose=0,
                                        return_dict=True)
        # The user's one-device evaluation (a partial last batch) against
        # tfmulti's exact-once stream, padded differently per layout.
        stream = tf.data.Dataset.from_tensor_slices(
            (X_EVAL, Y_EVAL)).batch(BATCH) if golden else (
                tfmulti.distribute_dataset(
                    strategy, lambda _: tf.data.Dataset.from_tensor_slices(
                        (X_EVAL, Y_EVAL)), global_batch_size=BATCH,
                    training=False))
        result["eval_stream"] = model.evaluate(stream, verbose=0,
                                               return_dict=True)
        result["predict"] = model.predict(
            tf.data.Dataset.from_tensor_slices(X_EVAL[:96]).batch(BATCH),
            verbose=0).tolist()
    return result


results = {}
for name, strategy in layouts.items():
    golden = name == "one_device"
    cases = MULTI_WORKER_CASES if name == "multi_worker" else [
        c for c in CASES if not (golden and c in NO_GOLDEN)]
    results[name] = {case: run_case(strategy, case, golden)
                     for case in cases}
    # Long runs of TensorFlow graph building stall in the cyclic GC.
    gc.collect()
    gc.freeze()

with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump({"results": results,
               "is_chief": tfmulti.cluster_config().is_chief}, f)
