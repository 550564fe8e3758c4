"""Bench part `sharding`: bytes per device, step time and bytes on the wire
of ZeRO stages 1 and 2 (`Trainer(shard_optimizer_state=1|2)`) against the
unsharded Trainer.

    python -m tfmulti.bench --only sharding

One process per replica count N (simulated CPU devices, MirroredStrategy)
builds the same MLP three times with Adam: unsharded, stage 1, stage 2. It
reports the optimizer state each replica's device holds, read from where
the variables live (`optimizer_memory.state_bytes`), plus at stage 2 the
reduced-gradient shard each device keeps (a tensor of the step, so counted
from its layout: the padded flat gradient / N; unsharded and stage 1 keep
the whole reduced gradient); the host copy a sharded run keeps for its
checkpoints; the steady step time of each, in paired rounds (one loop of
each in turn, the tracing loop left out), as ratios to unsharded with 95%
intervals; and the bytes each replica puts on the wire per update in the
ring model (an all-reduce of P bytes sends 2(N-1)/N P, an all-to-all or an
all-gather (N-1)/N P): stage 1 all-reduces and all-gathers, stage 2
reduce-scatters (all-to-all) and all-gathers, one all-reduce's worth. The
reduce-scatter path that ran is printed (all-to-all, or all-reduce+slice
where the strategy has no collective launchers).
"""

from __future__ import annotations

import statistics

RUNS = (("unsharded", 0), ("stage1", 1), ("stage2", 2))


def wire_bytes(stage: int, *, replicas: int, params: int, padded: int,
               dtype_size: int = 4) -> int:
    """Bytes one replica sends per update in the ring model (the clip and
    loss-scale scalars left out)."""
    share = (replicas - 1) / replicas
    if stage == 0:
        return round(2 * share * params * dtype_size)
    gather = share * padded * dtype_size
    if stage == 1:
        return round(2 * share * params * dtype_size + gather)
    return round(share * padded * dtype_size + gather)


def measure(*, replicas: int, steps: int, rounds: int, width: int,
            global_batch_size: int) -> dict:
    """One N: bytes per device, seconds per step and wire bytes, per run.

    Args:
      replicas: N simulated CPU replicas (this process's devices).
      steps: updates per timed loop.
      rounds: timed loops of each (the three runs in turn).
      width: units of the MLP's two hidden layers.
      global_batch_size: examples per update.
    """
    import tfmulti
    devices = tfmulti.simulate_devices(replicas)
    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti import models
    from tfmulti.bench import stats
    from tfmulti.training import flat_layout, optimizer_memory

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, size=(4096,)).astype("int32")
    trainers, data, out = {}, {}, {}
    for name, stage in RUNS:
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.mlp(64, width, 10)
            optimizer = keras.optimizers.Adam(1e-3)
        trainers[name] = tfmulti.Trainer(
            model, optimizer, strategy=strategy, steps_per_loop=steps,
            shard_optimizer_state=stage,
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None))
        data[name] = tf.data.Dataset.from_tensor_slices((x, y)).repeat(
        ).batch(global_batch_size, drop_remainder=True)
        # The first loop traces.
        trainers[name].fit(data[name], steps=steps, verbose=0)
        sharding = trainers[name].runner.sharding
        per_device, host = optimizer_memory.state_bytes(
            strategy, optimizer, sharding)
        layout = flat_layout.FlatLayout(
            [v.shape for v in model.trainable_variables], replicas)
        gradient = (layout.shard_size if stage == 2 else layout.total) * 4
        out[name] = {"bytes_per_device": max(per_device.values()),
                     "gradient_bytes_per_device": gradient,
                     "devices": len(per_device), "host_bytes": host,
                     "wire_bytes_per_step": wire_bytes(
                         stage, replicas=replicas, params=layout.total,
                         padded=layout.padded),
                     "path": (sharding.reduce_scatter.path if stage == 2
                              else "all-reduce+slice" if stage else None),
                     "seconds_per_step": []}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            history = trainer.fit(data[name], steps=trainer.step + steps,
                                  verbose=0)
            out[name]["seconds_per_step"].append(
                1.0 / history["steps_per_sec"][-1])
    for name, run in out.items():
        run["median_seconds_per_step"] = statistics.median(
            run["seconds_per_step"])
        # The traffic counter's payload (the gradient collective only).
        run["communication"] = trainers[name].communication
    unsharded = out["unsharded"]
    base = unsharded["bytes_per_device"]
    base_with_gradient = base + unsharded["gradient_bytes_per_device"]
    ratios = {}
    for name in ("stage1", "stage2"):
        run = out[name]
        run["bytes_fraction"] = run["bytes_per_device"] / base
        run["bytes_with_gradient_fraction"] = (
            run["bytes_per_device"] + run["gradient_bytes_per_device"]) / (
                base_with_gradient)
        run["wire_over_all_reduce"] = (run["wire_bytes_per_step"] /
                                       unsharded["wire_bytes_per_step"])
        ratios[name] = stats.paired_ratio(run["seconds_per_step"],
                                          unsharded["seconds_per_step"])
    return {"replicas": replicas,
            "parameters": layout.total, **out,
            "step_time_ratio": ratios,
            # Kept for older readers: stage 1's.
            "bytes_fraction": out["stage1"]["bytes_fraction"],
            "settings": {"steps": steps, "rounds": rounds, "width": width,
                         "global_batch_size": global_batch_size}}


def _time_verdict(interval: dict, goal: float) -> str:
    # A ratio that should stay at or below `goal`.
    if interval.get("low") is None:
        return "not shown"
    if interval["high"] <= goal:
        return "met"
    return "MISSED" if interval["low"] > goal else "not shown"


def markdown(by_replicas: dict) -> list[str]:
    """The report section for {N (str): `measure` result}."""
    from tfmulti.bench import stats
    lines = ["", "## Sharded optimizer state (ZeRO stages 1 and 2, Adam, "
             "MLP, N simulated CPU replicas)", "",
             "| N | parameters | run | state bytes/device (fraction, goal "
             "<= 1/N + 0.05) | + reduced gradient (fraction) | host copy | "
             "s/step | ratio to unsharded [95%] (goal <= 1.15 at N=4) | "
             "wire bytes/step (/ all-reduce) | reduce-scatter |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in by_replicas.items():
        for name, _ in RUNS:
            run = r[name]
            sharded = name != "unsharded"
            ratio = r["step_time_ratio"].get(name) if sharded else None
            fraction = (f" ({run['bytes_fraction']:.3f})" if sharded else "")
            with_gradient = run["bytes_per_device"] + run[
                "gradient_bytes_per_device"]
            lines.append(
                f"| {n} | {r['parameters']} | {name} | "
                f"{run['bytes_per_device']}{fraction} | {with_gradient}" +
                (f" ({run['bytes_with_gradient_fraction']:.3f})"
                 if sharded else "") + f" | {run['host_bytes']} | "
                f"{run['median_seconds_per_step']:.5f} | " +
                (f"{stats.format_interval(ratio)} "
                 f"{_time_verdict(ratio, 1.15) if n == '4' else ''}"
                 if ratio else "1") + f" | {run['wire_bytes_per_step']}" +
                (f" ({run['wire_over_all_reduce']:.2f})" if sharded else "")
                + f" | {run['path'] or '-'} |")
    lines += ["", "Wire bytes: ring model per replica and update (stage "
              "1: all-reduce + all-gather; stage 2: all-to-all "
              "reduce-scatter + all-gather), the clip / loss-scale scalars "
              "left out."]
    return lines
