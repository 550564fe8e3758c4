"""Trainer runs of local SGD, DiLoCo and PowerSGD for the numpy references
(tests/communication_reference.py, tests/test_communication_reference.py).

Usage: communication_reference.py MODE OUT_JSON.
MODE=multi_worker (under TF_CONFIG: 2 workers x 2 simulated CPU replicas) or
mirrored (4 simulated replicas in one process). Every case trains `STEPS`
updates on the same per-step, per-replica batches the reference feeds its
simulated replicas (replica g, worker-major, gets x[step, g]). Writes
{"layout", "placement", "initial", case: {"weights", "loss", ...}}.
"""

import dataclasses
import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import tfmulti  # noqa: E402
from tfmulti import strategies  # noqa: E402
from tfmulti.training import communication  # noqa: E402

MODE, OUT = sys.argv[1:3]
if MODE == "mirrored":
    strategy = tfmulti.create_strategy(
        "mirrored", devices=tfmulti.simulate_devices(4))
else:
    strategy = strategies.multi_worker_on_cpus(2)

import communication_reference as reference  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Shared with the test, which regenerates the data from them.
SETTINGS = dict(steps=24, replicas=4, batch=4, features=6, classes=3)
WIDTHS = (12, 10)
X, Y = reference.make_data(**SETTINGS)
STEPS = SETTINGS["steps"]
GLOBAL_BATCH = SETTINGS["replicas"] * SETTINGS["batch"]
WORKERS = communication.num_workers(strategy)
LOCAL = strategy.num_replicas_in_sync // WORKERS
WORKER = tfmulti.cluster_config().task_index if WORKERS > 1 else 0

MOMENTUM = lambda: keras.optimizers.SGD(  # noqa: E731
    0.05, momentum=0.9, nesterov=False)
ADAM = lambda: keras.optimizers.Adam(  # noqa: E731
    0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
DILOCO = tfmulti.OuterSGD(learning_rate=0.7, momentum=0.9, nesterov=True)


def powersgd(rank, start_iter):
    return tfmulti.PowerSGD(rank=rank, min_compression_rate=2.0,
                            warm_start=True, error_feedback=True, seed=0,
                            start_iter=start_iter)


# case -> (optimizer factory, Trainer keyword arguments). Every argument is
# explicit: the defaults may change. H=4. Each layout has rank 1 and 2,
# momentum and Adam, plain averaging and DiLoCo; the two layouts together
# have every algorithm with both inner optimizers. The cases with a 2-update
# warm-up end 2 updates after a synchronisation (on 2 workers: apart).
CASES = {
    "multi_worker": {
        "local_h4_momentum": (MOMENTUM, {"sync": tfmulti.LocalSGD(
            every=4, outer_optimizer=None, warmup_steps=0)}),
        "diloco_h4_adam_warmup2": (ADAM, {"sync": tfmulti.LocalSGD(
            every=4, outer_optimizer=DILOCO, warmup_steps=2)}),
        "powersgd_r1_momentum_start3": (MOMENTUM, {
            "compression": powersgd(1, 3)}),
        "powersgd_r2_adam": (ADAM, {"compression": powersgd(2, 0)}),
    },
    "mirrored": {
        "local_h4_adam_warmup2": (ADAM, {"sync": tfmulti.LocalSGD(
            every=4, outer_optimizer=None, warmup_steps=2)}),
        "diloco_h4_momentum_warmup2": (MOMENTUM, {"sync": tfmulti.LocalSGD(
            every=4, outer_optimizer=DILOCO, warmup_steps=2)}),
        "powersgd_r1_adam_start3": (ADAM, {"compression": powersgd(1, 3)}),
        "powersgd_r2_momentum": (MOMENTUM, {"compression": powersgd(2, 0)}),
    },
}[MODE]


def describe(optimizer, kwargs):
    """The case's settings, for the test to configure the reference."""
    config = optimizer.get_config()
    keys = (("learning_rate", "momentum", "nesterov")
            if isinstance(optimizer, keras.optimizers.SGD) else
            ("learning_rate", "beta_1", "beta_2", "epsilon"))
    out = {"optimizer": {"class": type(optimizer).__name__,
                         **{k: config[k] for k in keys}}}
    for key, value in kwargs.items():
        out[key] = dataclasses.asdict(value)
    return out


def build(make_optimizer):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((SETTINGS["features"],)),
            *[keras.layers.Dense(w, activation="tanh") for w in WIDTHS],
            keras.layers.Dense(SETTINGS["classes"])])
        return model, make_optimizer()


def dataset_fn(context):
    """This worker's per-replica batches, its local replicas in turn (the
    order a worker's input pipeline hands them to its devices)."""
    worker = context.input_pipeline_id
    local = context.num_replicas_in_sync // context.num_input_pipelines
    replicas = slice(worker * local, (worker + 1) * local)
    x = X[:, replicas].reshape((-1,) + X.shape[2:])
    y = Y[:, replicas].reshape((-1,) + Y.shape[2:])
    return tf.data.Dataset.from_tensor_slices((x, y))


def distributed_data():
    return strategy.distribute_datasets_from_function(dataset_fn)


def placement():
    """Whether replica g of this worker got x[step, g] on the first steps."""
    iterator = iter(distributed_data())
    for step in range(3):
        x, y = next(iterator)
        for local, (xr, yr) in enumerate(zip(
                strategy.experimental_local_results(x),
                strategy.experimental_local_results(y))):
            g = WORKER * LOCAL + local
            if not (np.array_equal(xr.numpy(), X[step, g])
                    and np.array_equal(yr.numpy(), Y[step, g])):
                return False
    return True


def powersgd_state(trainer):
    """(m, n, rank) of each compressed gradient and its initial Q."""
    reducer = trainer._reducer  # the Trainer's reducer, before any update
    q = [v.numpy().tolist() for v in reducer.state_variables()
         if "powersgd_q" in v.name]
    return {"compressed": [list(s) for s in reducer.compressed_shapes(
        trainer.model.trainable_variables)], "initial_q": q}


def run(make_optimizer, kwargs):
    model, optimizer = build(make_optimizer)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=STEPS,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        **kwargs)
    out = describe(optimizer, kwargs)
    if "compression" in kwargs:
        out.update(powersgd_state(trainer))
    history = trainer.fit(distributed_data(), steps=STEPS, verbose=0,
                          global_batch_size=GLOBAL_BATCH)
    replicas = [[r.numpy() for r in strategy.experimental_local_results(
        v.value)] for v in model.trainable_variables]
    out.update(
        loss=[float(v) for v in history["step_loss"]],
        weights=[w.tolist() for w in model.get_weights()],
        communication=trainer.communication,
        replicas_equal=all(np.array_equal(r[0], other)
                           for r in replicas for other in r[1:]))
    return out


model, _ = build(MOMENTUM)
results = {"layout": [WORKERS, strategy.num_replicas_in_sync],
           "settings": SETTINGS, "widths": WIDTHS,
           "placement": placement(),
           "initial": [w.tolist() for w in model.get_weights()]}
for name, case in CASES.items():
    gc.collect()
    results[name] = run(*case)
with open(OUT.format(index=WORKER), "w") as f:
    json.dump(results, f)
