"""Trainer runs with local SGD / DiLoCo / PowerSGD for the golden tests.

Usage: communication_golden.py MODE OUT_JSON MODEL_DIR.
MODE=multi_worker (under TF_CONFIG, 2 simulated CPU replicas per worker: the
2 workers x 2 replicas topology): trains every case; the uninterrupted
8-update runs of the resume cases (Trainer local SGD, Trainer PowerSGD,
`tfmulti.keras.distributed` fit with BackupAndRestore), then their first 5
updates with a checkpoint after each in MODEL_DIR/<case>, and SIGKILLs
itself right after the 5th update's backup in `fit` (no clean shutdown).
MODE=resume (new processes): restores each MODEL_DIR/<case>, trains to 8.
MODE=mirrored (no TF_CONFIG; 4 simulated replicas in one process): the
equality cases under MirroredStrategy.
Writes {case: {"loss", "weights", "replicas_equal", "communication", ...}}.
"""

import dataclasses
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
if MODE == "mirrored":
    strategy = tfmulti.create_strategy(
        "mirrored", devices=tfmulti.simulate_devices(4))
else:
    strategy = strategies.multi_worker_on_cpus(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 32
STEPS = 8
EVAL = 100  # examples of the evaluation between synchronisations
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype("float32")
Y = rng.integers(0, 3, size=(512,)).astype("int32")
# Compress every matrix, even where a rank-r factorisation is larger, from
# the first update (not after the default dense warm-up).
FULL_RANK = tfmulti.PowerSGD(rank=16, min_compression_rate=0.01,
                             start_iter=0)
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
    # Dense warm-up (PyTorch's start_powerSGD_iter): 3 plain all-reduces,
    # then compressed with error feedback from zero.
    "powersgd_r1_start3": (ADAM, {"compression": tfmulti.PowerSGD(
        rank=1, start_iter=3)}),
    # BatchNorm: each replica's moving statistics are its own; the train
    # loop averages them over every replica at its end (local SGD sends
    # none at its synchronisations).
    "sync_sgd_bn": (SGD, {"batch_norm": True}),
    "local_path_h1_bn": (SGD, {"batch_norm": True, "sync": tfmulti.LocalSGD(
        every=1, outer_optimizer=tfmulti.OuterSGD(learning_rate=1.0,
                                                  momentum=0.0))}),
}


def build(make_optimizer, batch_norm=False):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            *([keras.layers.BatchNormalization(momentum=0.5)]
              if batch_norm else []),
            keras.layers.Dense(3)])
        return model, make_optimizer()


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        BATCH, drop_remainder=True)


def trainer_for(make_optimizer, kwargs, model_dir=None):
    kwargs = dict(kwargs)
    model, optimizer = build(make_optimizer, kwargs.pop("batch_norm", False))
    return model, tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=4,
        model_dir=model_dir,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        **kwargs)


def per_replica(variables):
    """Every local replica's value of every variable."""
    return [[r.numpy().tolist() for r in
             strategy.experimental_local_results(v.value)]
            for v in variables]


def result(model, trainer, history):
    replicas = per_replica(model.trainable_variables)
    return {"loss": history["step_loss"],
            "weights": [w.tolist() for w in model.get_weights()],
            "shapes": [list(v.shape) for v in model.trainable_variables],
            "replicas_equal": all(np.array_equal(r[0], other)
                                  for r in replicas for other in r[1:]),
            # BatchNorm moving statistics: one value per replica.
            "state": per_replica(model.non_trainable_variables),
            # Everything a resumed run must have restored, every replica.
            "all_replicas": per_replica(model.variables) + per_replica(
                trainer.optimizer.variables),
            "communication": trainer.communication}


def keras_fit(kwargs, evaluate=False):
    """`tfmulti.keras.distributed` fit with the same data and steps; with
    `evaluate`, then its `evaluate` on the evaluation examples."""
    model, optimizer = build(ADAM)
    with strategy.scope():
        model.compile(optimizer=optimizer, steps_per_execution=4,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    tfmulti.keras.distributed(model, **kwargs)
    model.fit(strategy.experimental_distribute_dataset(dataset()),
              epochs=1, steps_per_epoch=STEPS, verbose=0)
    out = {"weights": [w.tolist() for w in model.get_weights()],
           "loss": [0.0], "shapes": [list(v.shape)
                                     for v in model.trainable_variables],
           "communication": tfmulti.keras.communication(model)}
    if evaluate:
        out["evaluation"] = model.evaluate(
            evaluation_data(), verbose=0, return_dict=True)
        out["weights_after_evaluation"] = [w.tolist()
                                           for w in model.get_weights()]
        out["communication_after_evaluation"] = tfmulti.keras.communication(
            model)
    return out


def evaluation_data():
    """The first `EVAL` examples, each read once over all replicas."""
    return tfmulti.distribute_dataset(
        strategy, lambda _: tf.data.Dataset.from_tensor_slices(
            (X[:EVAL], Y[:EVAL])), global_batch_size=BATCH, training=False)


class KillAfter(keras.callbacks.Callback):
    """SIGKILLs this worker once `fit` has made `steps` updates (after the
    BackupAndRestore before it in the callback list saved them)."""

    def __init__(self, steps):
        super().__init__()
        self._steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self._steps:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def keras_resumable(backup_dir, *, kill_after=None):
    """Keras fit, local SGD H=3 after 1 warm-up step with DiLoCo outer
    momentum, inner SGD momentum, BatchNorm: 2 epochs of 4 batches, a
    backup after every batch."""
    model, optimizer = build(SGD, batch_norm=True)
    with strategy.scope():
        model.compile(optimizer=optimizer, steps_per_execution=1,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    tfmulti.keras.distributed(model, sync=RESUME_LOCAL[1]["sync"])
    callbacks = [tfmulti.keras.BackupAndRestore(backup_dir, save_freq=1)]
    if kill_after:
        callbacks.append(KillAfter(kill_after))
    # A finite dataset: every epoch reads the same 4 batches, so skipping
    # the restored epoch's done batches puts the data where it was.
    model.fit(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X[:4 * BATCH], Y[:4 * BATCH]))
        .batch(BATCH, drop_remainder=True)), epochs=2, verbose=0,
        callbacks=callbacks)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "loss": [0.0],
            "all_replicas": per_replica(model.variables) + per_replica(
                model.optimizer.variables)}


results = {"workers": communication.num_workers(strategy),
           "replicas": strategy.num_replicas_in_sync}
# Killed after update 5, which is NOT a synchronisation point (warm-up 1,
# H=3: the workers synchronise after updates 4 and 7): each worker's weights,
# inner momentum, BatchNorm statistics and anchors are its own.
RESUME_LOCAL = (SGD, {"batch_norm": True, "sync": tfmulti.LocalSGD(
    every=3, outer_optimizer=tfmulti.OuterSGD(), warmup_steps=1)})
# Every replica's error-feedback buffer is its own; compression starts after
# 2 dense updates, so a resume that lost the update count would send update
# 6 dense.
RESUME_POWERSGD = (ADAM, {"compression": tfmulti.PowerSGD(rank=1,
                                                          start_iter=2)})
RESUMED = {"resume_local": RESUME_LOCAL, "resume_powersgd": RESUME_POWERSGD}
FIRST_STEPS = 5


def checkpointed(model_dir):
    return sorted(name for name, _ in tf.train.list_variables(
        tf.train.latest_checkpoint(model_dir)) if "local_sgd" in name)


if MODE == "mirrored":
    # One worker, 4 replicas: no worker to average with, so local SGD is the
    # synchronous update; full-rank PowerSGD equals it too.
    # (LocalSGD(every=1) IS the synchronous reducer; compared under 2 x 2.)
    for name in ("sync", "local_path_h1", "sync_sgd"):
        gc.collect()
        model, trainer = trainer_for(*CASES[name])
        results[name] = result(model, trainer,
                               trainer.fit(dataset(), steps=STEPS, verbose=0))
    # Full rank after a dense warm-up of 3 updates: the switch under a
    # tf.cond around MirroredStrategy's merge_calls.
    model, trainer = trainer_for(ADAM, {"compression": dataclasses.replace(
        FULL_RANK, start_iter=3)})
    results["powersgd_full"] = result(
        model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
    # A warm-up as long as the run: never compressed.
    model, trainer = trainer_for(ADAM, {"compression": tfmulti.PowerSGD(
        rank=1, start_iter=STEPS)})
    results["powersgd_r1_dense"] = result(
        model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
    # The switch, golden: PowerSGD(start_iter=3) against its definition,
    # 3 synchronous updates, then PowerSGD from the first update (zero
    # error feedback, the initial Q) on the same model and optimizer.
    model, trainer = trainer_for(ADAM, {"compression": tfmulti.PowerSGD(
        rank=1, start_iter=3)})
    results["powersgd_r1_start3"] = result(
        model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
    model, trainer = trainer_for(ADAM, {})
    trainer.fit(dataset(), steps=3, verbose=0)
    trainer = tfmulti.Trainer(
        model, trainer.optimizer, strategy=strategy, steps_per_loop=5,
        compression=tfmulti.PowerSGD(rank=1, start_iter=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    results["powersgd_r1_after_3_sync"] = result(
        model, trainer, trainer.fit(dataset().skip(3), steps=STEPS - 3,
                                    verbose=0))
elif MODE == "multi_worker":
    for name, (make_optimizer, kwargs) in CASES.items():
        gc.collect()
        gc.freeze()
        model, trainer = trainer_for(make_optimizer, kwargs)
        results[name] = result(model, trainer,
                               trainer.fit(dataset(), steps=STEPS, verbose=0))
        if name == "diloco_h4":
            # Step 8 is between synchronisations (the last at 6):
            # evaluation reads the workers' mean weights, then puts this
            # worker's back.
            results[name]["evaluation"] = trainer.evaluate(
                evaluation_data())
            results[name]["weights_after_evaluation"] = [
                w.tolist() for w in model.get_weights()]
            results[name]["communication_after_evaluation"] = (
                trainer.communication)
    for name, kwargs in {
            "keras_sync": {},
            "keras_powersgd_full": {"compression": FULL_RANK},
            # The dense warm-up's tf.cond inside Keras's train function.
            "keras_powersgd_full_start3": {"compression": dataclasses.replace(
                FULL_RANK, start_iter=3)},
            "keras_local_h4": {"sync": tfmulti.LocalSGD(every=4)},
            "keras_diloco_h4": {"sync": CASES["diloco_h4"][1]["sync"]}
    }.items():
        gc.collect()
        gc.freeze()
        results[name] = keras_fit(kwargs, evaluate=name == "keras_diloco_h4")
    for name, case in RESUMED.items():
        model, trainer = trainer_for(*case)
        results["uninterrupted_" + name] = result(
            model, trainer, trainer.fit(dataset(), steps=STEPS, verbose=0))
    results["uninterrupted_keras"] = keras_resumable(
        os.path.join(MODEL_DIR, "keras_whole"))
    # The first halves: 5 updates, a checkpoint after each.
    for name, case in RESUMED.items():
        model, trainer = trainer_for(*case, model_dir=os.path.join(
            MODEL_DIR, name))
        results["first_" + name] = result(model, trainer, trainer.fit(
            dataset(), steps=FIRST_STEPS, checkpoint_every=1, verbose=0))
    results["checkpointed"] = checkpointed(os.path.join(MODEL_DIR,
                                                        "resume_local"))
    with open(OUT.format(index=tfmulti.cluster_config().task_index),
              "w") as f:
        json.dump(results, f)
    # A crash, not an exit: what the restart resumes from is only what the
    # checkpoints hold.
    keras_resumable(os.path.join(MODEL_DIR, "keras"),
                    kill_after=FIRST_STEPS)
    raise SystemExit("KillAfter did not kill this worker")
else:
    for name, case in RESUMED.items():
        model, trainer = trainer_for(*case, model_dir=os.path.join(
            MODEL_DIR, name))
        history = trainer.fit(dataset(), steps=STEPS, checkpoint_every=1,
                              verbose=0)
        results[name] = result(model, trainer, history)
        results[name]["start_step"] = history["step"][-1] - len(
            history["step_loss"])
    results["resume_keras"] = keras_resumable(os.path.join(MODEL_DIR,
                                                           "keras"))
index = 0 if MODE == "mirrored" else tfmulti.cluster_config().task_index
with open(OUT.format(index=index), "w") as f:
    json.dump(results, f)
