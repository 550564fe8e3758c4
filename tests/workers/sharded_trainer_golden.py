"""Trainer(shard_optimizer_state=True) against the unsharded Trainer and one
device, in one process with 4 simulated CPU devices.

Usage: sharded_trainer_golden.py MODE OUT_JSON WORKDIR [CASE ...]
('{index}' in OUT_JSON becomes the worker index)

MODE=local, per optimizer case: the Trainer on one device (the golden run;
K micro-batches taken as one batch of K*B), on 4 mirrored replicas
unsharded, sharded at ZeRO stage 1 ("sharded") and stage 2 ("sharded2"),
with clipping by the global norm and accumulation. Then the elastic resumes
through `model_dir` (the unsharded checkpoint form): sharded (stage 1 and
2) on 4 replicas -> one device, and one device -> sharded on 4.
MODE=multi_worker: TF_CONFIG from the environment, 2 simulated CPU
replicas per worker; each case sharded at stages 1 and 2, saving
checkpoints into WORKDIR (every worker gathers the shards).
Writes {case: {run: {"loss", "weights", ...}}}.
"""

import gc
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402
from tfmulti import strategies  # noqa: E402
from tfmulti.training import reduce_scatter  # noqa: E402

from layouts import golden_layouts  # noqa: E402

MODE = sys.argv[1]
layouts = ({"multi_worker": strategies.multi_worker_on_cpus(2)}
           if MODE == "multi_worker" else golden_layouts("local", (4,)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from golden_data import BATCH, X, Y  # noqa: E402

STEPS = 50
RESUME_AT, RESUME_STEPS = 25, 50
CLIP = 0.5
# Rates that keep the trajectory contractive (PITFALLS.md: at 0.1 the
# cross-replica sum's reassociation alone moves weights by 1e-4).
CASES = {
    "adam": (lambda: keras.optimizers.Adam(0.01), {}),
    # A schedule too: the shards evaluate it on their own step counts.
    "adamw": (lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5),
        weight_decay=0.05), {}),
    "sgd_momentum": (lambda: keras.optimizers.SGD(0.05, momentum=0.9), {}),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.01, momentum=0.5), {}),
    # Dynamic loss scaling decided on the reduced gradient: at the initial
    # scale 2**24 the float16 gradients overflow, so the first updates are
    # skipped on every replica while the scale halves.
    "mixed_float16": (lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0**24),
                      {"mixed_precision": "mixed_float16"}),
    # bfloat16 on the wire; its one-device run is the float32 reference
    # (one device would round its gradient to bfloat16 too).
    "bf16_wire": (lambda: keras.optimizers.Adam(0.01),
                  {"allreduce_dtype": "bfloat16"}),
}
# Which runs a case gets: (label, layout, ZeRO stage).
RUNS = (("one_device", "one_device", 0), ("unsharded", "mirrored4", 0),
        ("sharded", "mirrored4", 1), ("sharded2", "mirrored4", 2))
ACCUM = 2
# Compared with the unsharded run on the same replicas only: one device's
# float16 gradient overflows at other steps than a replica's.
NO_ONE_DEVICE = ("mixed_float16",)


def build(strategy, make_optimizer, policy=None):
    keras.mixed_precision.set_global_policy(policy or "float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3)])
        return model, make_optimizer()


def trainer(strategy, make_optimizer, *, sharded, k, model_dir=None,
            **kwargs):
    model, optimizer = build(strategy, make_optimizer,
                             kwargs.get("mixed_precision"))
    return tfmulti.Trainer(
        model, optimizer, strategy=strategy, grad_accum_steps=k,
        clip_global_norm=CLIP, steps_per_loop=5, model_dir=model_dir,
        shard_optimizer_state=sharded,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        **kwargs)


def data(batch):
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        batch, drop_remainder=True)


def result(t, history):
    # "optimizer": the Trainer's (unsharded) optimizer; in a sharded run
    # what the last checkpoint save gathered into it.
    return {"loss": history["step_loss"],
            "weights": [w.tolist() for w in t.model.get_weights()],
            "optimizer": [np.asarray(v.numpy(), "float64").tolist()
                          for v in t.optimizer.variables],
            "iterations": int(t.optimizer.iterations.numpy()),
            "step": t.step}


def run(strategy, name, *, sharded, golden, path=None):
    make_optimizer, kwargs = CASES[name]
    # One device takes the K micro-batches as one batch of K*B.
    k = 1 if golden else ACCUM
    if golden:
        kwargs = {k: v for k, v in kwargs.items() if k != "allreduce_dtype"}
    t = trainer(strategy, make_optimizer, sharded=sharded, k=k, **kwargs)
    if path is not None:
        # Forced before the first fit traces the step: the fallback taken
        # where a strategy has no collective launchers.
        sharding = t.runner.sharding
        sharding.reduce_scatter = reduce_scatter.ReduceScatter(
            strategy, sharding.layout, path=path)
    history = t.fit(data(BATCH * ACCUM // k), steps=STEPS, verbose=0)
    out = result(t, history)
    if sharded:
        out.update(sharding_facts(t))
    return out


def sharding_facts(t):
    sharding = t.runner.sharding
    return {"bytes_per_device": sharding.state_bytes_per_device(),
            "path": sharding.reduce_scatter and sharding.reduce_scatter.path,
            "communication": t.communication}


def resume(first, second, model_dir):
    """RESUME_AT steps on layout `first`, then on `second` up to
    RESUME_STEPS, through checkpoints in `model_dir`; each (layout,
    sharded)."""
    make_optimizer, _ = CASES["adam"]
    losses = []
    for (layout, sharded), steps in ((first, RESUME_AT),
                                     (second, RESUME_STEPS)):
        t = trainer(layouts[layout], make_optimizer, sharded=sharded, k=1,
                    model_dir=model_dir)
        history = t.fit(data(BATCH), steps=steps, verbose=0)
        losses += history["step_loss"]
    return dict(result(t, history), loss=losses)


def multi_worker(out, workdir, names):
    strategy = layouts["multi_worker"]
    results = {}
    for name in names:
        make_optimizer, kwargs = CASES[name]
        results[name] = {}
        for label, stage in (("sharded", 1), ("sharded2", 2)):
            gc.collect()
            gc.freeze()
            t = trainer(strategy, make_optimizer, sharded=stage, k=ACCUM,
                        model_dir=os.path.join(workdir, f"{name}{stage}"),
                        **kwargs)
            history = t.fit(data(BATCH), steps=STEPS, checkpoint_every=25,
                            verbose=0)
            results[name][label] = dict(result(t, history),
                                        **sharding_facts(t))
    with open(out.format(index=tfmulti.cluster_config().task_index),
              "w") as f:
        json.dump(results, f)


def main(out, workdir, names):
    results = {}
    for name in names:
        case = {}
        for label, layout, sharded in RUNS:
            if label == "one_device" and name in NO_ONE_DEVICE:
                continue
            # Tracing in a process holding many traced functions stalls in
            # Python's collector (TF 2.21; see trainer_golden.py).
            gc.collect()
            gc.freeze()
            case[label] = run(layouts[layout], name, sharded=sharded,
                              golden=layout == "one_device")
        if name == "adam":
            gc.collect()
            gc.freeze()
            case["sharded2_slice"] = run(
                layouts["mirrored4"], name, sharded=2, golden=False,
                path=reduce_scatter.ALL_REDUCE_SLICE)
        results[name] = case
    if "adam" in names:
        gc.collect()
        gc.freeze()
        t = trainer(layouts["one_device"], CASES["adam"][0], sharded=False,
                    k=1)
        results["resume"] = {
            "one_device": result(t, t.fit(data(BATCH), steps=RESUME_STEPS,
                                          verbose=0)),
            "sharded_to_one_device": resume(
                ("mirrored4", True), ("one_device", False),
                os.path.join(workdir, "sharded_first")),
            "one_device_to_sharded": resume(
                ("one_device", False), ("mirrored4", True),
                os.path.join(workdir, "one_device_first")),
            "sharded2_to_one_device": resume(
                ("mirrored4", 2), ("one_device", False),
                os.path.join(workdir, "sharded2_first")),
            "one_device_to_sharded2": resume(
                ("one_device", False), ("mirrored4", 2),
                os.path.join(workdir, "one_device_first2")),
        }
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    (multi_worker if MODE == "multi_worker" else main)(
        sys.argv[2], sys.argv[3], sys.argv[4:] or list(CASES))
