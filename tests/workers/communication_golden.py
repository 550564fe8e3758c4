"""Trainer runs with local SGD / DiLoCo / PowerSGD for the golden tests.

Usage: communication_golden.py MODE OUT_JSON [MODEL_DIR]
MODE=local: 4 simulated CPU devices, MirroredStrategy over 4 replicas.
MODE=multi_worker: TF_CONFIG from the environment, 2 simulated CPU replicas
per worker (the 2 workers x 2 replicas topology); with MODEL_DIR it also
trains 5 updates of local SGD with checkpoints there and exits.
MODE=resume (multi_worker, new processes): restores MODEL_DIR, trains to 8
updates, and trains an uninterrupted twin to 8.
Writes {case: {"loss", "weights", "replicas_equal", "communication"}}.
"""

import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
if MODE in ("multi_worker", "resume"):
    strategy = tfmulti.strategies.multi_worker_on_cpus(2)
else:
    strategy = tfmulti.create_strategy(
        "mirrored", devices=tfmulti.simulate_devices(4))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 32
STEPS = 8
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype("float32")
Y = rng.integers(0, 3, size=(512,)).astype("int32")
# Compress every matrix, even where a rank-r factorisation is larger.
FULL_RANK = tfmulti.PowerSGD(rank=16, min_compression_rate=0.01)
SGD = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
ADAM = lambda: keras.optimizers.Adam(0.01)  # noqa: E731

# case -> (optimizer factory, Trainer keyword arguments)
CASES = {
    "sync": (ADAM, {}),
    "sync_sgd": (SGD, {}),
    "local_h1": (ADAM, {"sync": tfmulti.LocalSGD(every=1)}),
    # Not `synchronous` (an outer optimizer), so the local path runs; with
    # lr 1 and no momentum it is plain averaging, and for an optimizer
    # linear in the gradient H=1 averaging equals the synchronous update.
    "local_path_h1": (SGD, {"sync": tfmulti.LocalSGD(
        every=1, outer_optimizer=tfmulti.OuterSGD(learning_rate=1.0,
                                                  momentum=0.0))}),
    "local_h4": (SGD, {"sync": tfmulti.LocalSGD(every=4)}),
    "diloco_h4": (SGD, {"sync": tfmulti.LocalSGD(
        every=4, outer_optimizer=tfmulti.OuterSGD(), warmup_steps=2)}),
    "powersgd_full": (ADAM, {"compression": FULL_RANK}),
    "sync_clip_accum": (ADAM, {"clip_global_norm": 0.05,
                               "grad_accum_steps": 2}),
    "powersgd_full_clip_accum": (ADAM, {"compression": FULL_RANK,
                                        "clip_global_norm": 0.05,
                                        "grad_accum_steps": 2}),
    "powersgd_r1": (ADAM, {"compression": tfmulti.PowerSGD(rank=1)}),
}


def build(make_optimizer):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3)])
        return model, make_optimizer()


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        BATCH, drop_remainder=True)


def trainer_for(make_optimizer, kwargs, model_dir=None):
    model, optimizer = build(make_optimizer)
    return model, tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=4,
        model_dir=model_dir,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        **kwargs)


def result(model, trainer, history):
    replicas = [[r.numpy() for r in
                 strategy.experimental_local_results(v.value)]
                for v in model.trainable_variables]
    return {"loss": history["step_loss"],
            "weights": [w.tolist() for w in model.get_weights()],
            "shapes": [list(v.shape) for v in model.trainable_variables],
            "replicas_equal": all(np.array_equal(r[0], other)
                                  for r in replicas for other in r[1:]),
            "communication": trainer.communication}


def keras_fit(kwargs):
    """`tfmulti.keras.distributed` fit with the same data and steps."""
    model, optimizer = build(ADAM)
    with strategy.scope():
        model.compile(optimizer=optimizer, steps_per_execution=4,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    tfmulti.keras.distributed(model, **kwargs)
    model.fit(strategy.experimental_distribute_dataset(dataset()),
              epochs=1, steps_per_epoch=STEPS, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "loss": [0.0],
            "communication": tfmulti.keras.communication(model)}


results = {"workers": tfmulti.training.communication.num_workers(strategy),
           "replicas": strategy.num_replicas_in_sync}
if MODE == "multi_worker" or len(sys.argv) == 3:
    for name, (make_optimizer, kwargs) in CASES.items():
        gc.collect()
        gc.freeze()
        model, trainer = trainer_for(make_optimizer, kwargs)
        results[name] = result(model, trainer,
                               trainer.fit(dataset(), steps=STEPS, verbose=0))
    for name, kwargs in {"keras_sync": {}, "keras_powersgd_full": {
            "compression": FULL_RANK}, "keras_local_h4": {
                "sync": tfmulti.LocalSGD(every=4)}}.items():
        gc.collect()
        gc.freeze()
        results[name] = keras_fit(kwargs)
if len(sys.argv) > 3:
    model_dir = sys.argv[3]
    phase = "resume" if MODE == "resume" else "first"
    # No inner momentum: each worker's inner optimizer state is its own and
    # only the chief's is checkpointed (see BUILD_NOTES); the outer
    # (DiLoCo) momentum is the same on every worker and is.
    case = (lambda: keras.optimizers.SGD(0.1),
            {"sync": tfmulti.LocalSGD(every=2, outer_optimizer=(
                tfmulti.OuterSGD()), warmup_steps=1)})
    model, trainer = trainer_for(*case, model_dir=model_dir)
    history = trainer.fit(dataset(), steps=5 if phase == "first" else STEPS,
                          checkpoint_every=1, verbose=0)
    results["resumed"] = result(model, trainer, history)
    results["resumed"]["start_step"] = history["step"][-1] - len(
        history["step_loss"])
    results["checkpointed"] = sorted(
        name for name, _ in tf.train.list_variables(
            tf.train.latest_checkpoint(model_dir)) if "local_sgd" in name)
    if phase == "resume":
        model, trainer = trainer_for(*case)
        results["uninterrupted"] = result(
            model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump(results, f)
