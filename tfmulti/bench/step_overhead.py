"""Step overhead: Trainer vs a bare `tf.range` loop vs Keras `model.fit`.

    python -m tfmulti.bench.step_overhead [--replicas 4] [--steps 256]
        [--repeats 5] [--json]

One process, N simulated CPU replicas (MirroredStrategy), an MLP with two
hidden layers of 64, global batch 64, Adam. Measures, in one run: a bare
loop of 32 steps per `tf.function` over `strategy.run` (the floor), the
Trainer with steps_per_loop=32 and =1, Keras `fit` with its defaults, and
Keras `fit` through `tfmulti.keras.distributed` with steps_per_execution=32,
and the Trainer with `jit_compile=True` (XLA per replica). Prints steps/s and
the ratios the Trainer, XLA and the tfmulti fit are judged by.
"""

from __future__ import annotations

import argparse
import json
import os
import time

LOOP = 32
# (numerator, denominator) of the ratios reported, with their goals.
RATIOS = (("trainer_32", "bare_loop_32", 0.95), ("trainer_32", "keras_fit", 5),
          ("tfmulti_fit_32_steady", "trainer_32", 0.9),
          ("tfmulti_fit_32_steady", "keras_fit_steady", 5),
          ("tfmulti_fit_32", "keras_fit", 3),
          ("trainer_32_xla", "bare_loop_32", 1.3))
FEATURES, CLASSES = 64, 10
# The CNN variant: `models.small_cnn` on small uint8 images, more compute per
# step than the MLP, so a smaller share of each step is overhead.
IMAGE_SHAPE = (16, 16, 3)
MODELS = ("mlp", "cnn")


def _setup(replicas, batch, width, model, devices):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti
    from tfmulti import models

    if devices is None:
        devices = tfmulti.simulate_devices(replicas)
    strategy = tfmulti.create_strategy("mirrored",
                                       devices=devices[:replicas])
    rng = np.random.default_rng(0)
    if model == "cnn":
        x = rng.integers(0, 256, size=(batch * 16, *IMAGE_SHAPE)).astype(
            "uint8")
    else:
        x = rng.normal(size=(batch * 64, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(len(x),)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).cache().repeat().prefetch(16)

    def build():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            if model == "cnn":
                net = models.small_cnn(IMAGE_SHAPE, CLASSES, batch_norm=False)
            else:
                net = keras.Sequential([
                    keras.Input((FEATURES,)),
                    keras.layers.Dense(width, activation="relu"),
                    keras.layers.Dense(width, activation="relu"),
                    keras.layers.Dense(CLASSES)])
            optimizer = keras.optimizers.Adam(1e-3)
        return net, optimizer

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
        return {"bare_loop_32": steps // LOOP * LOOP / (
            time.perf_counter() - began)}
    return timed


def _trainer(strategy, dataset, build, steps, steps_per_loop, *, name,
             jit_compile=False):
    import keras

    import tfmulti

    model, optimizer = build()
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=steps_per_loop,
        jit_compile=jit_compile, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    data = strategy.experimental_distribute_dataset(dataset)
    trainer.fit(data, steps=LOOP, verbose=0)

    def timed():
        began = time.perf_counter()
        # `steps` is the total to reach: train `steps` more.
        trainer.fit(data, steps=trainer.step + steps, verbose=0)
        return {name: steps / (time.perf_counter() - began)}
    return timed


def _keras_fit(strategy, dataset, build, steps, *, name, tfmulti_fit=False):
    """Keras `fit` with its defaults, or through `tfmulti.keras.distributed`
    with steps_per_execution=32.

    Each round is one `fit` call, timed whole (`name`: it includes what
    every `fit` call pays once, e.g. two multi-device iterators) and from
    the end of its first call of the train function to its end
    (`name`_steady: the rate of a long run).
    """
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
    ends = []
    clock = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(
            (batch, time.perf_counter())))

    def timed():
        ends.clear()
        began = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0,
                  callbacks=[clock])
        elapsed = time.perf_counter() - began
        (first, t0), (last, t1) = ends[0], ends[-1]
        return {name: steps / elapsed,
                f"{name}_steady": (last - first) / (t1 - t0)}
    return timed


def run(*, replicas: int = 4, batch: int = 64, width: int = 64,
        steps: int = 256, repeats: int = 5, model: str = "mlp",
        xla: bool = True, steps_per_loop_1: bool = True,
        devices=None) -> dict:
    """Measures every variant in this process; returns the figures.

    Must run in a fresh process (it lays out `replicas` simulated devices),
    unless `devices` (logical devices already laid out, at least
    `replicas`) is given.
    The variants are timed in turn, `repeats` rounds; each figure is the
    median of its rounds and each ratio the median of per-round ratios, so
    a burst of load on a shared machine hits both sides of a ratio alike.

    With `xla`, also the Trainer with `jit_compile=True`
    ("trainer_32_xla"), judged against the UNCOMPILED bare loop. Without
    `steps_per_loop_1`, no "trainer_1" (no goal is judged by it).

    Returns:
      {"bare_loop_32", "trainer_32", "trainer_1", "keras_fit",
      "keras_fit_steady", "tfmulti_fit_32", "tfmulti_fit_32_steady",
      "trainer_32_xla"} in steps/s, the ratios "<a>_vs_<b>" of RATIOS, the
      raw "rounds" and the "load_average" before and after.
    """
    import statistics

    if model not in MODELS:
        raise ValueError(f"`model` is {model!r}; use one of {list(MODELS)}.")
    if steps < 2 * LOOP or steps % LOOP:
        # The steady rate is timed between the ends of the first and the
        # last call of LOOP steps: it needs two calls at least.
        raise ValueError(f"`steps` is {steps}; it should be a multiple of "
                         f"{LOOP} and at least {2 * LOOP}.")
    load_before = os.getloadavg()
    strategy, dataset, build = _setup(replicas, batch, width, model,
                                      devices)
    variants = [
        _bare_loop(strategy, dataset, build, steps),
        _trainer(strategy, dataset, build, steps, LOOP, name="trainer_32"),
        _keras_fit(strategy, dataset, build, steps, name="keras_fit"),
        _keras_fit(strategy, dataset, build, steps, name="tfmulti_fit_32",
                   tfmulti_fit=True),
    ]
    if steps_per_loop_1:
        variants.append(_trainer(strategy, dataset, build, steps, 1,
                                 name="trainer_1"))
    if xla:
        variants.append(_trainer(strategy, dataset, build, steps, LOOP,
                                 name="trainer_32_xla", jit_compile=True))
    rounds = {}
    for index in range(repeats):
        # Alternate the order, so that no variant always follows Keras fit.
        for timed in variants if index % 2 == 0 else variants[::-1]:
            for name, rate in timed().items():
                rounds.setdefault(name, []).append(rate)
    figures = {name: statistics.median(r) for name, r in rounds.items()}
    # Ratios of figures timed back to back in the same round, then the
    # median: load from other processes shifts both sides of a pair alike.
    for name, other, _ in RATIOS:
        if name in rounds and other in rounds:
            figures[f"{name}_vs_{other}"] = statistics.median(
                a / b for a, b in zip(rounds[name], rounds[other]))
    figures["rounds"] = rounds
    figures.update(replicas=replicas, batch=batch, width=width, steps=steps,
                   repeats=repeats, model=model,
                   load_average={"before": load_before,
                                 "after": os.getloadavg()})
    return figures


def run_layouts(*, replicas, models=MODELS, **kwargs) -> dict:
    """`run` for every model and replica count in ONE process.

    Cheaper than a process per layout (each costs seconds of start-up), but
    N=1 then runs with max(replicas) logical devices laid out: for tests
    and smoke runs, not for figures.

    Returns:
      {model: {str(replicas): figures}}.
    """
    import tfmulti

    devices = tfmulti.simulate_devices(max(replicas))
    return {model: {str(n): run(replicas=n, model=model, devices=devices,
                                **kwargs.get(model, {}))
                    for n in replicas}
            for model in models}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--no_xla", action="store_true",
                        help="skip the XLA-compiled Trainer variant")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON line")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    figures = run(replicas=args.replicas, steps=args.steps,
                  repeats=args.repeats, model=args.model,
                  xla=not args.no_xla)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"{args.replicas} simulated CPU replicas, {args.model}, global "
          f"batch 64, Adam, median of {args.repeats} rounds of {args.steps} "
          f"steps; load average {figures['load_average']}")
    for key, value in figures.items():
        if key in figures["rounds"]:
            print(f"  {key:<22} {value:8.1f} steps/s")
    for name, other, goal in RATIOS:
        ratio = figures.get(f"{name}_vs_{other}")
        if ratio is not None:
            print(f"  {name} / {other}: {ratio:.2f}x (goal >= {goal}) "
                  f"{'met' if ratio >= goal else 'MISSED'}")


if __name__ == "__main__":
    main()
