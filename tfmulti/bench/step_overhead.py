"""Step overhead: Trainer vs a bare `tf.range` loop vs Keras `model.fit`.

    python -m tfmulti.bench.step_overhead [--replicas 4] [--steps 256]
        [--repeats 5] [--json]

One process, N simulated CPU replicas (MirroredStrategy), an MLP with two
hidden layers of 64, global batch 64, Adam. Measures, in one run: a bare
loop of 32 steps per `tf.function` over `strategy.run` (the floor), the
Trainer with steps_per_loop=32 and =1, Keras `fit` with its defaults, and
Keras `fit` through `tfmulti.keras.distributed` with steps_per_execution=32.
Prints steps/s and the ratios the Trainer and the tfmulti fit are judged by.
"""

from __future__ import annotations

import argparse
import json
import os
import time

LOOP = 32
FEATURES, CLASSES = 64, 10


def _setup(replicas, batch, width):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti

    devices = tfmulti.simulate_devices(replicas)
    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 64, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(batch * 64,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).cache().repeat().prefetch(16)

    def build():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((FEATURES,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(CLASSES)])
            optimizer = keras.optimizers.Adam(1e-3)
        return model, optimizer

    return strategy, dataset, build


def _bare_loop(strategy, dataset, build, steps):
    import keras
    import tensorflow as tf

    model, optimizer = build()
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction=None)
    batch = int(dataset.element_spec[0].shape[0])

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(y, model(x, training=True)), global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def loop(iterator, n):
        for _ in tf.range(n):
            strategy.run(replica_step, args=next(iterator))

    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    n = tf.constant(LOOP)
    loop(iterator, n)

    def timed():
        began = time.perf_counter()
        for _ in range(steps // LOOP):
            loop(iterator, n)
        return steps // LOOP * LOOP / (time.perf_counter() - began)
    return timed


def _trainer(strategy, dataset, build, steps, steps_per_loop):
    import keras

    import tfmulti

    model, optimizer = build()
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=steps_per_loop,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    data = strategy.experimental_distribute_dataset(dataset)
    trainer.fit(data, steps=LOOP, verbose=0)

    def timed():
        began = time.perf_counter()
        # `steps` is the total to reach: train `steps` more.
        trainer.fit(data, steps=trainer.step + steps, verbose=0)
        return steps / (time.perf_counter() - began)
    return timed


def _keras_fit(strategy, dataset, build, steps, *, tfmulti_fit=False):
    """Keras `fit` with its defaults, or through `tfmulti.keras.distributed`
    with steps_per_execution=32."""
    import keras

    import tfmulti

    model, optimizer = build()
    with strategy.scope():
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      steps_per_execution=LOOP if tfmulti_fit else 1)
    if tfmulti_fit:
        model = tfmulti.keras.distributed(model)
    model.fit(dataset, epochs=1, steps_per_epoch=LOOP, verbose=0)

    def timed():
        began = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        return steps / (time.perf_counter() - began)
    return timed


def run(*, replicas: int = 4, batch: int = 64, width: int = 64,
        steps: int = 256, repeats: int = 5) -> dict:
    """Measures every variant in this process; returns the figures.

    Must run in a fresh process (it lays out `replicas` simulated devices).
    The variants are timed in turn, `repeats` rounds; each figure is the
    median of its rounds and each ratio the median of per-round ratios, so
    a burst of load on a shared machine hits both sides of a ratio alike.

    Returns:
      {"bare_loop_32", "trainer_32", "trainer_1", "keras_fit",
      "tfmulti_fit_32"} in steps/s, and the ratios "trainer_32_vs_bare",
      "trainer_32_vs_keras_fit", "tfmulti_fit_32_vs_trainer_32" and
      "tfmulti_fit_32_vs_keras_fit".
    """
    import statistics

    strategy, dataset, build = _setup(replicas, batch, width)
    variants = {
        "bare_loop_32": _bare_loop(strategy, dataset, build, steps),
        "trainer_32": _trainer(strategy, dataset, build, steps, LOOP),
        "trainer_1": _trainer(strategy, dataset, build, steps, 1),
        "keras_fit": _keras_fit(strategy, dataset, build, steps),
        "tfmulti_fit_32": _keras_fit(strategy, dataset, build, steps,
                                     tfmulti_fit=True),
    }
    rounds = {name: [] for name in variants}
    for index in range(repeats):
        # Alternate the order, so that no variant always follows Keras fit.
        order = list(variants) if index % 2 == 0 else list(variants)[::-1]
        for name in order:
            rounds[name].append(variants[name]())
    figures = {name: statistics.median(r) for name, r in rounds.items()}
    # Ratios of figures timed back to back in the same round, then the
    # median: load from other processes shifts both sides of a pair alike.
    for name, other in (("trainer_32", "bare_loop_32"),
                        ("trainer_32", "keras_fit"),
                        ("tfmulti_fit_32", "trainer_32"),
                        ("tfmulti_fit_32", "keras_fit")):
        short = "bare" if other == "bare_loop_32" else other
        figures[f"{name}_vs_{short}"] = statistics.median(
            a / b for a, b in zip(rounds[name], rounds[other]))
    figures["rounds"] = rounds
    figures.update(replicas=replicas, batch=batch, width=width, steps=steps,
                   repeats=repeats)
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON line")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    figures = run(replicas=args.replicas, steps=args.steps,
                  repeats=args.repeats)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{args.replicas} simulated CPU replicas, MLP 2x64, global batch "
          f"64, Adam, median of {args.repeats} rounds of {args.steps} steps")
    for key in ("bare_loop_32", "trainer_32", "trainer_1", "keras_fit",
                "tfmulti_fit_32"):
        print(f"  {key:<14} {figures[key]:8.1f} steps/s")
    print(f"  Trainer(steps_per_loop=32) / bare loop: "
          f"{figures['trainer_32_vs_bare']:.2f}x (goal >= 0.95)")
    print(f"  Trainer(steps_per_loop=32) / Keras fit: "
          f"{figures['trainer_32_vs_keras_fit']:.2f}x (goal >= 5)")
    print(f"  tfmulti fit(steps_per_execution=32) / Trainer(32): "
          f"{figures['tfmulti_fit_32_vs_trainer_32']:.2f}x (goal >= 0.9)")
    print(f"  tfmulti fit(steps_per_execution=32) / Keras fit: "
          f"{figures['tfmulti_fit_32_vs_keras_fit']:.2f}x (goal >= 5)")


if __name__ == "__main__":
    main()
