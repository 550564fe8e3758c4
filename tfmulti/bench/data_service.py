"""Bench part `data_service`: an input-bound job with 0, 1 and 2 data workers.

One training process (a MirroredStrategy over `replicas` logical CPUs) trains
a small model on `tfmulti_shapes` whose per-element `map_fn` (decode, upscale,
blur, crop, colour jitter) costs more than the step. It alternates rounds of
`steps` timed steps (after a few untimed ones) between three feeds of the same `distribute_dataset` call:
`service=""` (the preprocessing in the training process), and the service of
`tfmulti-launch --data_workers 1` and of `--data_workers 2` (real dispatcher
and data worker processes, started by the launcher's own `DataService`).
Per feed it reports steps/s and CPU seconds per step of the training process
and of the data workers (read from /proc), medians over rounds.

What one machine can show: the data workers run on the same cores as the
trainer, so moving the preprocessing off the training process is measured
(its CPU per step), but a faster step needs cores the trainer does not use:
on a 2-core machine the service can only match the local pipeline when the
trainer already saturates both cores. The part says which it saw.
"""

from __future__ import annotations

import os
import statistics
import time

from tfmulti.bench import stats


def augment(image, label):
    """Heavier than the step: the image upscaled, blurred, cropped, jittered."""
    import tensorflow as tf
    image = tf.image.resize(tf.cast(image, tf.float32), (96, 96))
    kernel = tf.ones((5, 5, 3, 1)) / 25.0
    for _ in range(3):
        image = tf.nn.depthwise_conv2d(image[None], kernel, (1, 1, 1, 1),
                                       "SAME")[0]
    image = tf.image.random_crop(image, (80, 80, 3))
    image = tf.image.random_brightness(image, 20.0)
    image = tf.image.random_contrast(image, 0.8, 1.2)
    image = tf.image.resize(image, (32, 32))
    return tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8), label


def _cpu_seconds(pid) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 14 and 15 of proc(5); the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_main(*, services: dict, data_dir: str, replicas: int, steps: int,
                rounds: int, global_batch_size: int) -> dict:
    """The training process: {feed: figures} over alternating rounds.

    Args:
      services: {feed name: {"address": host:port, "pids": data-side
        process ids}}, "local" with address "" (no service).
      data_dir: TFDS data dir with `tfmulti_shapes` prepared.
    """
    import tfmulti
    devices = tfmulti.simulate_devices(replicas)
    import keras
    import tensorflow as tf
    from tfmulti.bench import input_pipeline
    from tfmulti.data import shapes

    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        # Light on purpose: the input, not the step, sets the pace.
        model = keras.Sequential([
            keras.Input((32, 32, 3), dtype="uint8"),
            keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
            keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    train = input_pipeline.train_loop(strategy, model, optimizer,
                                      global_batch_size)
    datasets = {name: tfmulti.distribute_dataset(
        strategy, tfmulti.tfds_dataset_fn(shapes.NAME, "train",
                                          data_dir=data_dir),
        global_batch_size=global_batch_size, map_fn=augment,
        # No cache: the service cannot cache either (a job per epoch), and
        # decoding is part of the input's cost.
        cache=False, service=spec["address"])
        for name, spec in services.items()}
    own_pid = os.getpid()
    figures = {name: {"seconds": [], "trainer_cpu": [], "data_cpu": []}
               for name in datasets}
    for _ in range(rounds):
        for name, dataset in datasets.items():
            # One feed at a time, each with a fresh iterator that is gone
            # before the next feed runs: an idle feed's background threads
            # (prefetch, parallel map, the service's buffers) would
            # otherwise fill up on the CPU another feed is timed on.
            iterator = iter(dataset)
            train(iterator, tf.constant(max(steps // 4, 2)))  # fill, trace
            data_pids = services[name]["pids"]
            cpu0 = _cpu_seconds(own_pid)
            data0 = sum(_cpu_seconds(p) for p in data_pids)
            began = time.perf_counter()
            train(iterator, tf.constant(steps))
            figures[name]["seconds"].append(time.perf_counter() - began)
            figures[name]["trainer_cpu"].append(_cpu_seconds(own_pid) - cpu0)
            figures[name]["data_cpu"].append(
                sum(_cpu_seconds(p) for p in data_pids) - data0)
            del iterator
    result = {}
    for name, f in figures.items():
        result[name] = {
            "steps_per_s": steps / statistics.median(f["seconds"]),
            "trainer_cpu_s_per_step": statistics.median(
                f["trainer_cpu"]) / steps,
            "data_workers_cpu_s_per_step": statistics.median(
                f["data_cpu"]) / steps,
            "data_workers": services[name]["data_workers"],
            "rounds": f}
    # Per round: the feeds ran one after another, so a round's ratio pairs
    # them under the same load.
    local = figures["local"]
    for name in datasets:
        if name != "local":
            f = figures[name]
            result[name]["speed_vs_local"] = stats.paired_ratio(
                local["seconds"], f["seconds"])
            result[name]["trainer_cpu_vs_local"] = stats.paired_ratio(
                [c or 1e-9 for c in f["trainer_cpu"]],
                [c or 1e-9 for c in local["trainer_cpu"]])
    return result


def run(run_part, settings: dict, timeout: float, data_dir: str) -> dict:
    """Starts the services (1 and 2 data workers) and the training process.

    Args:
      run_part: `tfmulti.bench.parts.run_part`.
      settings: `worker_main` keyword arguments but `services`, `data_dir`.
      timeout: seconds before every process is killed.
      data_dir: TFDS data dir with `tfmulti_shapes` prepared.
    """
    from tfmulti import launch, launch_processes
    reaper = launch_processes.Reaper(5)
    started = []
    try:
        services = {"local": {"address": "", "pids": [], "data_workers": 0}}
        for n in (1, 2):
            service = launch_processes.DataService(
                launch.LaunchOptions(workers=1, data_workers=n), reaper,
                lambda line: None)
            started.append(service)
            services[f"service_{n}"] = {
                "address": service.address,
                # The dispatcher's CPU counts as the data side's too.
                "pids": [p.pid for p in service.procs.values()],
                "data_workers": n}
        result = run_part("data_service", dict(
            settings, services=services, data_dir=data_dir),
            timeout=timeout)[0]
        result["restarts"] = sum(s.restarts for s in started)
    finally:
        for service in started:
            service.stop()
        reaper.close()
    result["settings"] = dict(settings, cpus=len(os.sched_getaffinity(0)))
    result["load_average"] = os.getloadavg()
    return result


def markdown(result: dict) -> list[str]:
    """The part's section of results.md."""
    s = result["settings"]
    lines = ["", f"## tf.data service (input-bound: {s['replicas']} "
             f"replicas, batch {s['global_batch_size']}, {s['rounds']} "
             f"rounds of {s['steps']} steps, {s['cpus']} CPUs)", "",
             "| feed | steps/s | vs local (95% interval) | trainer CPU "
             "s/step | vs local (95% interval) | data side CPU s/step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in ("local", "service_1", "service_2"):
        r = result[name]
        ratios = [stats.format_interval(r[key]) if key in r else "1"
                  for key in ("speed_vs_local", "trainer_cpu_vs_local")]
        lines.append(
            f"| {name} | {r['steps_per_s']:.2f} | {ratios[0]} | "
            f"{r['trainer_cpu_s_per_step']:.4f} | {ratios[1]} | "
            f"{r['data_workers_cpu_s_per_step']:.4f} |")
    lines.append(
        f"\nThe data workers share this machine's {s['cpus']} CPUs with the "
        "trainer: the CPU moved off the training process is what one "
        "machine shows; a faster step needs data workers on other cores.")
    return lines
