"""Is the input pipeline ever the bottleneck? Steps/s, files vs memory.

Trains the same small CNN on `tfmulti_shapes`, alternating feeds in one
process: the full tfmulti pipeline from the prepared TFDS files (read, decode
PNG, shard, shuffle, batch, prefetch); the same with a per-element `map_fn`
(a random flip); and batches already decoded and held in memory. Prints
steps/s of each and the ratios to memory; the goal is at least 0.95 for the
pipeline. The model takes uint8 images and rescales them itself: casting in
a per-element `map_fn` costs tf.data ~50 us per element on this CPU, which
the map variant shows.

    python -m tfmulti.bench.input_pipeline [--replicas 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from tfmulti import models
from tfmulti.data import pipeline, shapes, tfds_source


def random_flip(image, label):
    """A typical cheap per-element augmentation, as the map_fn variant."""
    return tf.image.random_flip_left_right(image), label


def _in_memory(strategy, builder, global_batch_size, num_batches):
    """`num_batches` decoded per-replica batches, cached, as the ceiling."""
    images, labels = next(iter(builder.as_dataset(
        split="train", as_supervised=True,
        batch_size=global_batch_size * num_batches)))
    per_replica = global_batch_size // strategy.num_replicas_in_sync

    def dataset_fn(input_context):
        del input_context
        # Batched before the cache: each step reads one cached tensor pair.
        return tf.data.Dataset.from_tensor_slices((images, labels)).batch(
            per_replica, drop_remainder=True).cache().repeat()

    return strategy.distribute_datasets_from_function(dataset_fn)


def train_loop(strategy, model, optimizer, global_batch_size):
    """`train(iterator, steps)`: a compiled `tf.range` loop of plain
    replica steps (the fastest plain loop), shared with the data_service
    part."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(labels, model(images, training=True)),
                global_batch_size=global_batch_size)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def train(iterator, steps):
        # Many steps per call, no tf.cond around the step: the fast path.
        for _ in tf.range(steps):
            strategy.run(step, args=next(iterator))

    return train


def measure(strategy: tf.distribute.Strategy, *, data_dir: str | None = None,
            global_batch_size: int = 128, steps: int = 20, rounds: int = 16,
            cache: bool | None = None) -> dict:
    """Training steps/s from TFDS files through tfmulti vs from memory.

    Args:
      strategy: where the model trains.
      data_dir: TFDS data dir holding (or to hold) `tfmulti_shapes`; None
        prepares it in a temporary directory.
      global_batch_size: examples per step.
      steps: steps timed per round and feed.
      rounds: rounds of `steps` steps per feed, feeds alternating.
      cache: `cache` of the file pipelines (None: the library default,
        which caches a small dataset such as tfmulti_shapes in memory).

    Returns:
      A dict with the best steps/s per feed (`pipeline`, `pipeline_map`,
      `memory`; other processes only ever slow a round down, so the best
      round is the closest to the feed's own speed), `ratio` and
      `ratio_map` (best over best memory), `ratio_paired` and
      `ratio_map_paired` (median over rounds of the ratio within a round),
      `steps_per_cpu_s`, `ratio_cpu` and `ratio_map_cpu` (steps per second
      of this process's CPU time), every round, `first_pass_seconds` (the
      untimed caching pass per file feed, before the rounds), the settings.
    """
    data_dir = data_dir or tempfile.mkdtemp(prefix="tfmulti_bench_")
    builder = shapes.prepare_default(data_dir)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = models.small_cnn(batch_norm=False)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    train = train_loop(strategy, model, optimizer, global_batch_size)
    def from_files(map_fn):
        return iter(pipeline.distribute_dataset(
            strategy, tfds_source.tfds_dataset_fn(shapes.NAME, "train",
                                                  data_dir=data_dir),
            global_batch_size=global_batch_size, map_fn=map_fn, cache=cache))

    feeds = {
        "pipeline": from_files(None),
        "pipeline_map": from_files(random_flip),
        "memory": iter(_in_memory(strategy, builder, global_batch_size, 20)),
    }
    # Warm-up: tracing, and filling the pipelines' shuffle buffers.
    for iterator in feeds.values():
        train(iterator, tf.constant(max(steps // 2, 10)))
    # Then one pass over the data without training, so that a caching
    # pipeline (the default for a dataset this size) is timed as every
    # epoch after the first sees it; the first epoch's decoding is what
    # `stage_cpu_seconds` accounts for. Without this the short --quick
    # rounds never left the first epoch (0.78 of memory, idle).
    first_pass = {}
    if cache is not False:
        epoch_steps = -(-builder.info.splits["train"].num_examples //
                        global_batch_size)
        for name in ("pipeline", "pipeline_map"):
            start = time.perf_counter()
            for _ in range(epoch_steps):
                next(feeds[name])
            first_pass[name] = time.perf_counter() - start
    rates = {name: [] for name in feeds}
    cpu_seconds = dict.fromkeys(feeds, 0.0)
    for _ in range(rounds):
        for name, iterator in feeds.items():
            start, cpu = time.perf_counter(), time.process_time()
            train(iterator, tf.constant(steps))
            rates[name].append(steps / (time.perf_counter() - start))
            cpu_seconds[name] += time.process_time() - cpu
    best = {name: max(r) for name, r in rates.items()}
    # CPU seconds of this process (all threads) per step: what the input
    # pipeline adds to training on a machine the step saturates, and much
    # less disturbed by other processes than wall time.
    per_cpu_s = {name: steps * rounds / cpu_seconds[name] for name in feeds}

    def paired(name):
        # Adjacent runs share the machine's load at that moment.
        return float(np.median(np.divide(rates[name], rates["memory"])))

    return {"steps_per_s": best,
            "ratio": best["pipeline"] / best["memory"],
            "ratio_map": best["pipeline_map"] / best["memory"],
            "ratio_paired": paired("pipeline"),
            "ratio_map_paired": paired("pipeline_map"),
            "steps_per_cpu_s": per_cpu_s,
            "ratio_cpu": per_cpu_s["pipeline"] / per_cpu_s["memory"],
            "ratio_map_cpu": per_cpu_s["pipeline_map"] / per_cpu_s["memory"],
            "first_pass_seconds": first_pass,
            "rounds": rates, "replicas": strategy.num_replicas_in_sync,
            "global_batch_size": global_batch_size, "steps": steps,
            "cache": cache}


def stage_cpu_seconds(*, data_dir: str | None = None,
                      global_batch_size: int = 128,
                      batches: int = 40) -> dict:
    """CPU seconds per batch of each input stage, without training.

    Each stage is iterated alone for `batches` batches (after a warm-up
    batch), on one input pipeline, and timed with this process's CPU time
    (all threads): reading and parsing the records with the image still
    encoded, decoding the PNGs too, the whole tfmulti pipeline (shuffle,
    batch, prefetch) from files, the same with `cache=True` after its first
    pass, and the cached in-memory batches. The
    differences say what each stage costs the cores the training step runs
    on; tf.data's threads (`threads`: its default private pool is one per
    core) take that CPU from the step.

    Returns:
      {"cpu_s_per_batch": {stage: s}, "wall_s_per_batch": {stage: s},
      "threads", "global_batch_size", "batches"}.
    """
    import os

    import tensorflow_datasets as tfds

    data_dir = data_dir or tempfile.mkdtemp(prefix="tfmulti_bench_")
    builder = shapes.prepare_default(data_dir)
    context = tf.distribute.InputContext()

    def records(decoders):
        return tfds_source.tfds_dataset_fn(
            shapes.NAME, "train", data_dir=data_dir,
            decoders=decoders).read(context).repeat().batch(
                global_batch_size)

    images, labels = next(iter(builder.as_dataset(
        split="train", as_supervised=True, batch_size=global_batch_size)))
    stages = {
        "read_parse": records({"image": tfds.decode.SkipDecoding()}),
        "read_parse_decode": records(None),
        "pipeline": pipeline.build_pipeline(
            tfds_source.tfds_dataset_fn(shapes.NAME, "train",
                                        data_dir=data_dir), context,
            options=pipeline.PipelineOptions(
                global_batch_size=global_batch_size)),
        # Decoded once, then shuffled and batched from memory.
        "pipeline_cached": pipeline.build_pipeline(
            tfds_source.tfds_dataset_fn(shapes.NAME, "train",
                                        data_dir=data_dir), context,
            options=pipeline.PipelineOptions(
                global_batch_size=global_batch_size, cache=True)),
        "memory": tf.data.Dataset.from_tensors(
            (images, labels)).cache().repeat(),
    }
    cpu, wall = {}, {}
    for name, dataset in stages.items():
        iterator = iter(dataset)
        # Warm-up; for the cached pipeline, its whole first (caching) pass.
        warm = 1 if name != "pipeline_cached" else -(
            -builder.info.splits["train"].num_examples // global_batch_size)
        for _ in range(warm):
            next(iterator)
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(iterator)
        cpu[name] = (time.process_time() - start_cpu) / batches
        wall[name] = (time.perf_counter() - start) / batches
    return {"cpu_s_per_batch": cpu, "wall_s_per_batch": wall,
            "threads": os.cpu_count(), "global_batch_size": global_batch_size,
            "batches": batches}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global_batch_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--cache", action="store_true", default=None,
                        help="force cache=True (default: the library's)")
    args = parser.parse_args(argv)
    import tfmulti  # Devices first: before any other TensorFlow work.
    tfmulti.simulate_devices(args.replicas)
    strategy = tfmulti.create_strategy("mirrored")
    result = measure(strategy, data_dir=args.data_dir,
                     global_batch_size=args.global_batch_size,
                     steps=args.steps, rounds=args.rounds, cache=args.cache)
    print(f"replicas {result['replicas']}, global batch "
          f"{result['global_batch_size']}, {result['steps']} steps x "
          f"{args.rounds} rounds, cache={args.cache}")
    rate = result["steps_per_s"]
    print(f"tfmulti pipeline from TFDS files:      {rate['pipeline']:.2f} "
          "steps/s")
    print(f"  the same + per-element map_fn:       {rate['pipeline_map']:.2f}"
          " steps/s")
    print(f"decoded batches in memory:             {rate['memory']:.2f} "
          "steps/s")
    print(f"ratio pipeline / memory: {result['ratio']:.3f} (goal >= 0.95); "
          f"with map_fn: {result['ratio_map']:.3f}")
    print(f"median of per-round ratios: {result['ratio_paired']:.3f}; with "
          f"map_fn: {result['ratio_map_paired']:.3f}")
    print(f"per CPU second: {result['ratio_cpu']:.3f}; with map_fn: "
          f"{result['ratio_map_cpu']:.3f} (steps per CPU s: " + ", ".join(
              f"{k} {v:.2f}" for k, v in result["steps_per_cpu_s"].items())
          + ")")
    print("rounds (steps/s): " + "; ".join(
        f"{k} {[round(r, 2) for r in v]}" for k, v in result["rounds"].items()))
    return result


if __name__ == "__main__":
    main()
