"""The pipeline bubble, measured from a step trace, against theory.

    python -m tfmulti.bench.parts pipeline_bubble '{"stages": 2}'

Trains an MLP of S equal stages (`tfmulti.pipeline.PipelinedModel`, S
simulated CPU devices, one intra-op thread each) with M = 1, 2, 4, 8
micro-batches of the same global batch. Every forward and backward action of
the schedule records the device clock when it starts and ends
(`train_step(..., timestamps=True)`); a device's idle fraction is 1 - (its
busy time) / (the step's span, first start to last end). GPipe's theory for
equal stages is (S - 1) / (M + S - 1).

Peak activation memory per device, GPipe vs 1F1B: the most micro-batches
whose activations a stage holds at once in the schedule the step runs
(`schedule.peak_live_micro_batches`), times the bytes of the stage's layer
outputs for one micro-batch (what its backward reads). It is derived from
the schedule and the shapes, not read from an allocator: the CPU allocator
has no per-device peak.
"""

from __future__ import annotations

import time


def _model(stages: int, layers_per_stage: int, width: int):
    import keras
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    x = inputs
    cuts = []
    for s in range(stages):
        for i in range(layers_per_stage):
            name = f"s{s}_d{i}"
            x = keras.layers.Dense(width, activation="relu", name=name)(x)
        cuts.append(name)
    return keras.Model(inputs, x), cuts[:-1]


def measure(*, stages: int = 2, micro_batches=(1, 2, 4, 8),
            global_batch: int = 256, width: int = 512,
            layers_per_stage: int = 4, steps: int = 3) -> dict:
    """Bubble per M and activation memory per stage; see the module doc.

    Returns:
      {"stages", "global_batch", "bubble": {M: {"theory", "measured" (mean
      over devices and steps), "per_device", "seconds_per_step"}},
      "activation_bytes": {schedule: [peak bytes per device]} at the
      largest M}.
    """
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tfmulti
    devices = tfmulti.simulate_devices(stages)
    import keras
    import numpy as np

    from tfmulti import pipeline
    from tfmulti.pipeline import schedule

    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch, width)).astype("float32")
    y = rng.normal(size=(global_batch, width)).astype("float32")
    result = {"stages": stages, "global_batch": global_batch,
              "width": width, "layers_per_stage": layers_per_stage,
              "bubble": {}, "activation_bytes": {}}
    for m in micro_batches:
        model, cuts = _model(stages, layers_per_stage, width)
        pipe = pipeline.PipelinedModel(
            model, optimizer=keras.optimizers.SGD(1e-3),
            loss=keras.losses.MeanSquaredError(reduction=None),
            num_stages=stages, micro_batches=m, cuts=cuts, devices=devices,
            verbose=False)
        pipe.train_step(x, y, timestamps=True)  # trace and warm up
        idle = [[] for _ in range(stages)]
        seconds = []
        for _ in range(steps):
            began = time.perf_counter()
            _, times = pipe.train_step(x, y, timestamps=True)
            seconds.append(time.perf_counter() - began)
            first = min(t[0] for t in times.values())
            span = max(t[1] for t in times.values()) - first
            for s in range(stages):
                busy = sum(end - start for (_, _, stage, _), (start, end)
                           in times.items() if stage == s)
                idle[s].append(1.0 - busy / span)
        per_device = [float(np.mean(v)) for v in idle]
        result["bubble"][str(m)] = {
            "theory": schedule.theoretical_bubble(stages, m),
            "measured": float(np.mean(per_device)),
            "per_device": per_device,
            "seconds_per_step": float(np.median(seconds))}
    m = max(micro_batches)
    micro = global_batch // m
    for name in schedule.SCHEDULES:
        result["activation_bytes"][name] = [
            schedule.peak_live_micro_batches(name, stages, m, s) *
            layers_per_stage * micro * width * 4 for s in range(stages)]
    result["activation_micro_batches"] = m
    return result


def markdown(by_stages: dict) -> list[str]:
    """The report section for {S (str): `measure` result}."""
    lines = ["", "## Pipeline bubble (GPipe, S simulated CPU devices)", "",
             "| S | M | theory (S-1)/(M+S-1) | measured idle (mean) | "
             "idle per device | s/step |", "| --- | --- | --- | --- | --- "
             "| --- |"]
    for s, r in by_stages.items():
        for m, b in r["bubble"].items():
            lines.append(
                f"| {s} | {m} | {b['theory']:.3f} | {b['measured']:.3f} | "
                f"{', '.join(f'{v:.2f}' for v in b['per_device'])} | "
                f"{b['seconds_per_step']:.3f} |")
    lines += ["", "Peak activation bytes per device (from the schedule and "
              "the layer output shapes):", ""]
    for s, r in by_stages.items():
        for name, per_device in r["activation_bytes"].items():
            lines.append(f"- S={s}, M={r['activation_micro_batches']}, "
                         f"{name}: {[round(b / 1e6, 2) for b in per_device]}"
                         " MB")
    return lines
