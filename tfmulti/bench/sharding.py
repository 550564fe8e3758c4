"""Bench part `sharding`: optimizer-state bytes per device and step time,
sharded (ZeRO-1, `Trainer(shard_optimizer_state=True)`) against unsharded.

    python -m tfmulti.bench --only sharding

One process per replica count N (simulated CPU devices, MirroredStrategy)
builds the same MLP twice with Adam, sharded and unsharded, and reports
the optimizer state each replica's device holds, read from where the
variables live (`optimizer_memory.state_bytes`), the host copy a sharded
run keeps for its checkpoints, and the steady step time of both, measured
in paired rounds (one loop of each in turn, the tracing loop left out).
Which collective ran: on CPU the gradient is all-reduced and then sliced
(the replica context has no reduce-scatter), and the updated shards are
all-gathered.
"""

from __future__ import annotations

import statistics


def measure(*, replicas: int, steps: int, rounds: int, width: int,
            global_batch_size: int) -> dict:
    """One N: bytes per device and steady seconds per step, both ways.

    Args:
      replicas: N simulated CPU replicas (this process's devices).
      steps: updates per timed loop.
      rounds: timed loops of each (alternating sharded and unsharded).
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
    from tfmulti.training import optimizer_memory

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, size=(4096,)).astype("int32")
    trainers, data, out = {}, {}, {}
    for name, sharded in (("unsharded", False), ("sharded", True)):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.mlp(64, width, 10)
            optimizer = keras.optimizers.Adam(1e-3)
        trainers[name] = tfmulti.Trainer(
            model, optimizer, strategy=strategy, steps_per_loop=steps,
            shard_optimizer_state=sharded,
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None))
        data[name] = tf.data.Dataset.from_tensor_slices((x, y)).repeat(
        ).batch(global_batch_size, drop_remainder=True)
        # The first loop traces.
        trainers[name].fit(data[name], steps=steps, verbose=0)
        per_device, host = optimizer_memory.state_bytes(
            strategy, optimizer, trainers[name].runner.sharding)
        out[name] = {"bytes_per_device": max(per_device.values()),
                     "devices": len(per_device), "host_bytes": host,
                     "seconds_per_step": []}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            history = trainer.fit(data[name], steps=trainer.step + steps,
                                  verbose=0)
            out[name]["seconds_per_step"].append(
                1.0 / history["steps_per_sec"][-1])
    for run in out.values():
        run["median_seconds_per_step"] = statistics.median(
            run["seconds_per_step"])
    params = sum(int(np.prod(v.shape))
                 for v in trainers["sharded"].model.trainable_variables)
    return {"replicas": replicas, "parameters": params, **out,
            "bytes_fraction": out["sharded"]["bytes_per_device"] /
            out["unsharded"]["bytes_per_device"],
            "step_time_ratio": out["sharded"]["median_seconds_per_step"] /
            out["unsharded"]["median_seconds_per_step"],
            "collective": "all-reduce, slice, all-gather (CPU)",
            "settings": {"steps": steps, "rounds": rounds, "width": width,
                         "global_batch_size": global_batch_size}}


def markdown(by_replicas: dict) -> list[str]:
    """The report section for {N (str): `measure` result}."""
    lines = ["", "## Sharded optimizer state (ZeRO-1, Adam, MLP, N "
             "simulated CPU replicas)", "",
             "| N | parameters | state bytes/device unsharded | sharded | "
             "fraction (goal <= 1/N + 0.05) | host copy (sharded) | "
             "s/step unsharded | sharded | ratio (goal <= 1.15 at N=4) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in by_replicas.items():
        u, s = r["unsharded"], r["sharded"]
        lines.append(
            f"| {n} | {r['parameters']} | {u['bytes_per_device']} | "
            f"{s['bytes_per_device']} | {r['bytes_fraction']:.3f} | "
            f"{s['host_bytes']} | {u['median_seconds_per_step']:.5f} | "
            f"{s['median_seconds_per_step']:.5f} | "
            f"{r['step_time_ratio']:.2f} |")
    lines += ["", f"Collectives: {next(iter(by_replicas.values()))['collective']}"
              " (no reduce-scatter in the replica context: stage 1 only)."]
    return lines
