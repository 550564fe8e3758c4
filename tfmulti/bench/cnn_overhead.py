"""Step overhead on a small CNN: the `step_overhead` variants on images.

    python -m tfmulti.bench.parts cnn_overhead '{"replicas": 4}'

The same bare `tf.range` loop, Trainer (steps_per_loop 32 and 1) and Keras
default `fit` as `step_overhead` (its functions, not copies), on
`models.small_cnn` with 16x16x3 uint8 images: more compute per step than the
MLP, so a smaller share of each step is overhead.
"""

from __future__ import annotations

import statistics

from tfmulti.bench import step_overhead

IMAGE_SHAPE = (16, 16, 3)
CLASSES = 10


def _setup(replicas, batch):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti
    from tfmulti import models

    devices = tfmulti.simulate_devices(replicas)
    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(batch * 16, *IMAGE_SHAPE)).astype("uint8")
    y = rng.integers(0, CLASSES, size=(batch * 16,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).cache().repeat().prefetch(16)

    def build():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.small_cnn(IMAGE_SHAPE, CLASSES, batch_norm=False)
            optimizer = keras.optimizers.Adam(1e-3)
        return model, optimizer

    return strategy, dataset, build


def run(*, replicas: int = 4, batch: int = 32, steps: int = 64,
        repeats: int = 3) -> dict:
    """Measures every variant in this (fresh) process; returns the figures.

    Returns:
      {"bare_loop_32", "trainer_32", "trainer_1", "keras_fit"} in steps/s
      (medians over `repeats` interleaved rounds of `steps` steps, warm-up
      excluded), "trainer_32_vs_bare" and "trainer_32_vs_keras_fit" (medians
      of per-round ratios), the rounds and the settings.
    """
    strategy, dataset, build = _setup(replicas, batch)
    args = (strategy, dataset, build, steps)
    variants = {
        "bare_loop_32": step_overhead._bare_loop(*args),
        "trainer_32": step_overhead._trainer(*args, step_overhead.LOOP),
        "trainer_1": step_overhead._trainer(*args, 1),
        "keras_fit": step_overhead._keras_fit(*args),
    }
    rounds = {name: [] for name in variants}
    for index in range(repeats):
        order = list(variants) if index % 2 == 0 else list(variants)[::-1]
        for name in order:
            rounds[name].append(variants[name]())
    figures = {name: statistics.median(r) for name, r in rounds.items()}
    for name, other in (("bare", "bare_loop_32"), ("keras_fit", "keras_fit")):
        figures[f"trainer_32_vs_{name}"] = statistics.median(
            a / b for a, b in zip(rounds["trainer_32"], rounds[other]))
    figures["rounds"] = rounds
    figures.update(replicas=replicas, batch=batch, steps=steps,
                   repeats=repeats, model="small_cnn 16x16x3")
    return figures
