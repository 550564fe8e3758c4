"""Trainer runs with local SGD / DiLoCo / PowerSGD for the golden tests.

Usage: communication_golden.py MODE OUT_JSON MODEL_DIR, under TF_CONFIG, 2
simulated CPU replicas per worker (the 2 workers x 2 replicas topology).
MODE=multi_worker: trains every case, an uninterrupted 8-update local SGD
run, then 5 updates of it with checkpoints in MODEL_DIR, writes OUT_JSON and
SIGKILLs itself (no clean shutdown).
MODE=resume (new processes): restores MODEL_DIR and trains to 8 updates.
Writes {case: {"loss", "weights", "replicas_equal", "communication"}}.
"""

import gc
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402
from tfmulti import strategies  # noqa: E402
from tfmulti.training import communication  # noqa: E402

MODE, OUT, MODEL_DIR = sys.argv[1:4]
strategy = strategies.multi_worker_on_cpus(2)

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


results = {"workers": communication.num_workers(strategy),
           "replicas": strategy.num_replicas_in_sync}
# No inner momentum: each worker's inner optimizer state is its own and
# only the chief's is checkpointed (see BUILD_NOTES); the outer (DiLoCo)
# momentum is the same on every worker and is.
RESUME_CASE = (lambda: keras.optimizers.SGD(0.1),
               {"sync": tfmulti.LocalSGD(every=2, outer_optimizer=(
                   tfmulti.OuterSGD()), warmup_steps=1)})


def checkpointed():
    return sorted(name for name, _ in tf.train.list_variables(
        tf.train.latest_checkpoint(MODEL_DIR)) if "local_sgd" in name)


if MODE == "multi_worker":
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
    model, trainer = trainer_for(*RESUME_CASE)
    results["uninterrupted"] = result(
        model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
    # The first half of the resume test: 5 updates, a checkpoint at each.
    model, trainer = trainer_for(*RESUME_CASE, model_dir=MODEL_DIR)
    results["first"] = result(model, trainer, trainer.fit(
        dataset(), steps=5, checkpoint_every=1, verbose=0))
    results["checkpointed"] = checkpointed()
else:
    model, trainer = trainer_for(*RESUME_CASE, model_dir=MODEL_DIR)
    history = trainer.fit(dataset(), steps=STEPS, checkpoint_every=1,
                          verbose=0)
    results["resumed"] = result(model, trainer, history)
    results["resumed"]["start_step"] = history["step"][-1] - len(
        history["step_loss"])
with open(OUT.format(index=tfmulti.cluster_config().task_index), "w") as f:
    json.dump(results, f)
if MODE == "multi_worker":
    # A crash, not an exit: what the restart resumes from is only what the
    # checkpoint holds.
    # checkpoint holds. The all-reduce first: no peer is left waiting in a
    # collective of this worker's.
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
