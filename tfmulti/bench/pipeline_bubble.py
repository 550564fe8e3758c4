"""The pipeline bubble, measured from a step trace, against theory.

    python -m tfmulti.bench.parts pipeline_bubble '{"stages": 2}'

Trains an MLP of S equal stages (`tfmulti.pipeline.PipelinedModel`, S
simulated CPU devices, one intra-op thread each) with M = 1, 2, 4, 8
micro-batches of the same global batch, and traces steps with TensorFlow's
profiler. Every op of a schedule action runs under the name scope
`pipe_g{group}_{F|B}{stage}_m{micro_batch}` (its gradient ops under
`gradient_tape/pipe_...` of the forward), so the trace says which stage each
executed op belongs to. A device's idle fraction is 1 - (the union of its
ops' intervals) / (the step's span, first op start to last op end). GPipe's
theory for equal stages is (S - 1) / (M + S - 1).

Timestamps taken inside the step (`tf.timestamp`) do not work for this:
the op is stateful, so `tf.function`'s automatic control dependencies chain
every timestamp in program order and serialise the stages (measured: idle
0.50-0.57 for every M on 2 stages).

Peak activation memory per device, GPipe vs 1F1B: the most micro-batches
whose activations a stage holds at once in the schedule the step runs
(`schedule.peak_live_micro_batches`), times the bytes of the stage's layer
outputs for one micro-batch (what its backward reads). It is derived from
the schedule and the shapes, not read from an allocator: the CPU allocator
has no per-device peak.
"""

from __future__ import annotations

import os
import re
import tempfile
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


_SCOPE = re.compile(r"pipe_g(\d+)_([FB])(\d+)_m(\d+)")


def _stage_intervals(logdir: str) -> dict[int, list[tuple[float, float]]]:
    """{stage: [(start_ns, end_ns)]} of the pipeline's ops in a trace."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                            recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    out: dict[int, list] = {}
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                match = _SCOPE.search(plane.event_metadata[
                    event.metadata_id].name)
                if match:
                    start = line.timestamp_ns + event.offset_ps / 1e3
                    out.setdefault(int(match.group(3)), []).append(
                        (start, start + event.duration_ps / 1e3))
    return out


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def idle_fractions(intervals: dict[int, list]) -> list[float]:
    """Per stage: 1 - busy / span of the whole traced step."""
    everything = [i for v in intervals.values() for i in v]
    span = max(b for _, b in everything) - min(a for a, _ in everything)
    return [1.0 - _union_length(intervals.get(s, [])) / span
            for s in range(max(intervals) + 1)]


def measure(*, stages: int = 2, micro_batches=(1, 2, 4, 8),
            global_batch: int = 256, width: int = 512,
            layers_per_stage: int = 4, steps: int = 3) -> dict:
    """Bubble per M and activation memory per stage; see the module doc.

    Returns:
      {"stages", "global_batch", "bubble": {M: {"theory", "measured" (mean
      over devices and traced steps), "per_device", "seconds_per_step"
      (untraced)}}, "activation_bytes": {schedule: [peak bytes per
      device]} at the largest M}.
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
        pipe.train_step(x, y)  # trace and warm up
        seconds = []
        for _ in range(steps):
            began = time.perf_counter()
            float(pipe.train_step(x, y))
            seconds.append(time.perf_counter() - began)
        idle = []
        for _ in range(steps):
            with tempfile.TemporaryDirectory() as logdir:
                tf.profiler.experimental.start(logdir)
                float(pipe.train_step(x, y))
                tf.profiler.experimental.stop()
                idle.append(idle_fractions(_stage_intervals(logdir)))
        per_device = [float(v) for v in np.mean(idle, axis=0)]
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
