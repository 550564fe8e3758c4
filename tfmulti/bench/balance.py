"""Bench part `balance`: an even split against `balance="auto"` on 2 workers,
one of them slowed by a real cause.

Each worker pins itself to its own core (`os.sched_setaffinity`, what
`taskset -c` does); a CPU-bound competing process is pinned to worker 1's
core, so the kernel gives worker 1 about half of that core. In one run each
worker trains the same MLP with balance=[1, 1] (even) and then with
"auto", and reports steps/s of the steady loops (the first loop of each,
which traces, left out), the barrier idle fraction per loop, the shares per
loop, and the heterogeneous efficiency: achieved examples/s over the sum of
each worker's own examples/s (its examples over its compute seconds, from
the step's per-replica timer, measured in the even run under the same
contention).

On a shared 2-core machine the two workers and the competing process
share the only 2 cores with whatever else runs, so the figures show the
mechanism and its direction; the size of the gain depends on the load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# The competing process: pure Python, CPU-bound, no I/O.
_HOG = "while True:\n    pass\n"


def worker_main(*, cores, steps: int, steps_per_loop: int,
                global_batch_size: int, width: int) -> dict:
    """One worker of the part (TF_CONFIG from the environment)."""
    import tfmulti
    index = tfmulti.cluster_config().task_index
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    strategy = tfmulti.create_strategy("multi_worker")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti import models

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, size=(4096,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        global_batch_size, drop_remainder=True)
    runs = {}
    for name, balance in (("even", [1, 1]), ("auto", "auto")):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.mlp(64, width, 10)
            optimizer = keras.optimizers.SGD(0.01)
        trainer = tfmulti.Trainer(
            model, optimizer, strategy=strategy, balance=balance,
            steps_per_loop=steps_per_loop,
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None))
        began = time.perf_counter()
        history = trainer.fit(data, steps=steps, verbose=0)
        loops = len(history["step"])
        seconds = [[history[f"replica_seconds_{r}"][i] for r in range(2)]
                   for i in range(loops)]
        shares = [[history[f"share_{r}"][i] for r in range(2)]
                  for i in range(loops)]
        # Steady loops: the first traced the step.
        rates = history["steps_per_sec"][1:]
        steady_seconds = steps_per_loop * sum(1 / r for r in rates)
        steps_per_sec = steps_per_loop * len(rates) / steady_seconds
        # Each worker alone: its examples over its compute seconds.
        alone = [sum(shares[i][r] * global_batch_size * steps_per_loop
                     for i in range(1, loops)) /
                 max(sum(seconds[i][r] * steps_per_loop
                         for i in range(1, loops)), 1e-12)
                 for r in range(2)]
        runs[name] = {
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * global_batch_size,
            "alone_examples_per_sec": alone,
            "idle_fraction": history["idle_fraction"],
            "shares": shares, "replica_seconds_per_step": seconds,
            "wall_seconds": time.perf_counter() - began,
        }
    even, auto = runs["even"], runs["auto"]
    # Efficiency against the workers' own speeds measured in the even run.
    capacity = sum(even["alone_examples_per_sec"])
    return {
        "worker": index, "core": core, "runs": runs,
        "speedup": auto["steps_per_sec"] / even["steps_per_sec"],
        "efficiency_even": even["examples_per_sec"] / capacity,
        "efficiency_auto": auto["examples_per_sec"] / capacity,
        "settings": {"steps": steps, "steps_per_loop": steps_per_loop,
                     "global_batch_size": global_batch_size,
                     "width": width, "cores": cores},
    }


def run(run_part, settings: dict, timeout: float) -> dict:
    """Runs the part: the competing process on `cores[1]`, 2 workers.

    Args:
      run_part: `tfmulti.bench.parts.run_part`.
      settings: `worker_main` keyword arguments but `cores`.
      timeout: seconds before every process is killed.
    """
    from tfmulti import cluster as cluster_lib
    available = sorted(os.sched_getaffinity(0))
    cores = available[:2] if len(available) >= 2 else available * 2
    hog = subprocess.Popen([sys.executable, "-c", _HOG],
                           start_new_session=True)
    try:
        os.sched_setaffinity(hog.pid, {cores[1]})
        configs = cluster_lib.local_cluster(2)
        workers = run_part("balance", dict(settings, cores=cores),
                           timeout=timeout,
                           envs=[{"TF_CONFIG": json.dumps(c)}
                                 for c in configs])
    finally:
        hog.kill()
        hog.wait()
    result = workers[0]
    result["slowed_worker"] = 1
    result["load_average"] = os.getloadavg()
    return result
