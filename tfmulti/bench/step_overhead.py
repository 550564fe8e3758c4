"""Step overhead: Trainer vs a bare `tf.range` loop vs Keras `model.fit`.

    python -m tfmulti.bench.step_overhead [--replicas 4] [--steps 256]
        [--repeats 5] [--model mlp|cnn] [--no_xla] [--no_fit]
        [--budget_seconds S] [--ci_width 0.05] [--json]

(The Trainer against the bare loop to +-1%: `--no_fit --no_xla --repeats
200 --steps 128`, a few minutes.)

One process, N simulated CPU replicas (MirroredStrategy), an MLP with two
hidden layers of 64, global batch 64, Adam. Measures, in one run: a bare
loop of 32 steps per `tf.function` over `strategy.run` (the ceiling: the
faster of two structures, see `_bare_loop`), the
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
# Like for like: a whole `fit` call's rate against another whole call's, a
# steady rate (from the end of a call's first loop to the end of its last:
# no per-call costs, no first loop after another variant ran) against
# another steady rate.
RATIOS = (("trainer_32", "bare_loop_32", 0.95),
          ("trainer_32_steady", "bare_loop_32_steady", 0.95),
          ("tfmulti_fit_32_steady", "bare_loop_32_steady", 0.95),
          ("trainer_32", "keras_fit", 5),
          ("tfmulti_fit_32_steady", "trainer_32_steady", 0.9),
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


def _bare_loop(strategy, dataset, build, steps, *, reduce_once):
    """The bench's ceiling: 32 steps per `tf.function` over `strategy.run`,
    nothing else. Two structures, both timed every round, the faster one
    taken: Keras's `apply_gradients` in replica context (it reduces the
    gradients in its own merge call), or one explicit all-reduce of the
    gradients and an `apply` that does not reduce again (what `TrainStep`
    does)."""
    import keras
    import tensorflow as tf

    from tfmulti.training import gradients as gradients_lib

    model, optimizer = build()
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    if reduce_once:
        gradients_lib.disable_optimizer_reduction(optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction=None)
    batch = int(dataset.element_spec[0].shape[0])
    variables = model.trainable_variables

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(y, model(x, training=True)), global_batch_size=batch)
        grads = tape.gradient(loss, variables)
        if reduce_once:
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, grads)
            optimizer.apply(grads, variables)
        else:
            optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def loop(iterator, n):
        for _ in tf.range(n):
            strategy.run(replica_step, args=next(iterator))

    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    n = tf.constant(LOOP)
    loop(iterator, n)
    name = "bare_loop_reduce_once" if reduce_once else "bare_loop_keras"

    def timed():
        began = time.perf_counter()
        ends = []
        for _ in range(steps // LOOP):
            loop(iterator, n)
            ends.append(time.perf_counter())
        return {name: steps / (ends[-1] - began),
                f"{name}_steady": (len(ends) - 1) * LOOP / (ends[-1] - ends[0])}
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
    # `steps` is the total to reach: train `steps` more.
    return _timed(lambda clock: trainer.fit(
        data, steps=trainer.step + steps, verbose=0, callbacks=[clock]),
        name=name, steps=steps, steady=steps_per_loop == LOOP)


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
    return _timed(lambda clock: model.fit(
        dataset, epochs=1, steps_per_epoch=steps, verbose=0,
        callbacks=[clock]), name=name, steps=steps, steady=True)


def _timed(fit, *, name, steps, steady):
    """`timed()` -> {name: steps/s of the whole `fit(clock)` call, and with
    `steady`, name_steady: steps/s from the end of its first train-function
    call to its last (the rate of a long run)}."""
    import keras

    ends = []
    clock = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(
            (batch, time.perf_counter())))

    def timed():
        ends.clear()
        began = time.perf_counter()
        fit(clock)
        elapsed = time.perf_counter() - began
        figures = {name: steps / elapsed}
        if steady:
            (first, t0), (last, t1) = ends[0], ends[-1]
            figures[f"{name}_steady"] = (last - first) / (t1 - t0)
        return figures
    return timed


def run(*, replicas: int = 4, batch: int = 64, width: int = 64,
        steps: int = 256, repeats: int = 5, model: str = "mlp",
        xla: bool = True, steps_per_loop_1: bool = True, fit: bool = True,
        devices=None, budget_seconds: float | None = None,
        deadline: float | None = None, ci_width: float | None = None,
        min_rounds: int = 3, warmup: bool = True) -> dict:
    """Measures every variant in this process; returns the figures.

    Must run in a fresh process (it lays out `replicas` simulated devices),
    unless `devices` (logical devices already laid out, at least
    `replicas`) is given.
    One untimed round warms every variant up (unless not `warmup`: smoke
    runs, whose timings mean nothing); then rounds time every
    variant once each, in an order that alternates. Each figure is the
    median of its rounds; each ratio is judged paired: the geometric mean
    of its per-round ratios with a 95% interval (`stats.paired_ratio`), so
    a burst of load on a shared machine hits both sides of a ratio alike.

    Rounds: `repeats` of them; or, with `budget_seconds` or `ci_width`, at
    least `min_rounds` and at most `repeats`, stopping as soon as every
    goal ratio's interval is narrower than `ci_width` (relative:
    high/low - 1) or the next round would pass `budget_seconds` of timing
    or `deadline` (a `time.time()`; set-up and warm-up count against it).

    The ceiling, "bare_loop_32", is the faster (geometric mean over the
    rounds) of two bare loop structures (`_bare_loop`), both reported;
    "bare_loop_structure" names it.
    With `xla`, also the Trainer with `jit_compile=True`
    ("trainer_32_xla"), judged against the UNCOMPILED bare loop. Without
    `steps_per_loop_1`, no "trainer_1" (no goal is judged by it). Without
    `fit`, no Keras `fit` variants: the Trainer against the bare loops
    only, so that hundreds of rounds fit in minutes.

    Returns:
      {"bare_loop_32", "bare_loop_keras", "bare_loop_reduce_once",
      "trainer_32", "trainer_1", "keras_fit", "keras_fit_steady",
      "tfmulti_fit_32", "tfmulti_fit_32_steady", "trainer_32_xla"} in
      steps/s, the ratios "<a>_vs_<b>" of RATIOS and their "intervals"
      ({"ratio", "low", "high", "rounds"}), the raw "rounds", "timing_s"
      and the "load_average" before and after.
    """
    import statistics

    from tfmulti.bench import stats

    if model not in MODELS:
        raise ValueError(f"`model` is {model!r}; use one of {list(MODELS)}.")
    if steps < 2 * LOOP or steps % LOOP:
        # The steady rate is timed between the ends of the first and the
        # last call of LOOP steps: it needs two calls at least.
        raise ValueError(f"`steps` is {steps}; it should be a multiple of "
                         f"{LOOP} and at least {2 * LOOP}.")
    if repeats < 1 or min_rounds < 1:
        raise ValueError(f"`repeats` is {repeats} and `min_rounds` "
                         f"{min_rounds}; both should be at least 1.")
    load_before = os.getloadavg()
    strategy, dataset, build = _setup(replicas, batch, width, model,
                                      devices)
    variants = [
        _bare_loop(strategy, dataset, build, steps, reduce_once=False),
        _bare_loop(strategy, dataset, build, steps, reduce_once=True),
        _trainer(strategy, dataset, build, steps, LOOP, name="trainer_32"),
    ]
    if fit:
        variants += [
            _keras_fit(strategy, dataset, build, steps, name="keras_fit"),
            _keras_fit(strategy, dataset, build, steps,
                       name="tfmulti_fit_32", tfmulti_fit=True)]
    if steps_per_loop_1:
        variants.append(_trainer(strategy, dataset, build, steps, 1,
                                 name="trainer_1"))
    if xla:
        variants.append(_trainer(strategy, dataset, build, steps, LOOP,
                                 name="trainer_32_xla", jit_compile=True))
    for timed in variants if warmup else ():  # warm-up round, untimed
        timed()
    if deadline is not None:
        left = deadline - time.time()
        budget_seconds = left if budget_seconds is None else min(
            budget_seconds, left)
    adaptive = budget_seconds is not None or ci_width is not None
    rounds = {}
    intervals = {}
    began = time.monotonic()
    for index in range(repeats):
        round_began = time.monotonic()
        # Alternate the order, so that no variant always follows Keras fit.
        for timed in variants if index % 2 == 0 else variants[::-1]:
            for name, rate in timed().items():
                rounds.setdefault(name, []).append(rate)
        # The faster structure over all rounds so far, not the faster one
        # per round: a per-round maximum of two noisy rates of the same
        # loop would raise the ceiling by the noise.
        structure = max(("bare_loop_keras", "bare_loop_reduce_once"),
                        key=lambda k: stats.geometric_mean(rounds[k]))
        rounds["bare_loop_32"] = list(rounds[structure])
        rounds["bare_loop_32_steady"] = list(rounds[f"{structure}_steady"])
        intervals = {f"{name}_vs_{other}": stats.paired_ratio(
            rounds[name], rounds[other]) for name, other, _ in RATIOS
            if name in rounds and other in rounds}
        if not adaptive or index + 1 < min_rounds:
            continue
        now = time.monotonic()
        if ci_width is not None and all(
                stats.relative_width(i) < ci_width
                for i in intervals.values()):
            break
        if budget_seconds is not None and (
                now + (now - round_began) - began > budget_seconds):
            break
    figures = {name: statistics.median(r) for name, r in rounds.items()}
    for key, interval in intervals.items():
        figures[key] = interval["ratio"]
    figures["intervals"] = intervals
    figures["bare_loop_structure"] = structure
    figures["rounds"] = rounds
    figures.update(replicas=replicas, batch=batch, width=width, steps=steps,
                   repeats=repeats, model=model,
                   timing_s=time.monotonic() - began,
                   budget_seconds=budget_seconds, ci_width=ci_width,
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
    parser.add_argument("--budget_seconds", type=float, default=None,
                        help="stop timing rounds after about this long")
    parser.add_argument("--ci_width", type=float, default=None,
                        help="stop once every goal ratio's 95%% interval "
                        "is narrower than this (high/low - 1)")
    parser.add_argument("--no_xla", action="store_true",
                        help="skip the XLA-compiled Trainer variant")
    parser.add_argument("--no_fit", action="store_true",
                        help="skip the Keras fit variants and the "
                        "steps_per_loop=1 Trainer: the Trainer against the "
                        "bare loops only")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON line")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    figures = run(replicas=args.replicas, steps=args.steps,
                  repeats=args.repeats, model=args.model,
                  xla=not args.no_xla, fit=not args.no_fit,
                  steps_per_loop_1=not args.no_fit,
                  budget_seconds=args.budget_seconds,
                  ci_width=args.ci_width)
    if args.json:
        print(json.dumps(figures))
        return
    from tfmulti.bench import stats
    done = len(figures["rounds"]["bare_loop_32"])
    print(f"{args.replicas} simulated CPU replicas, {args.model}, global "
          f"batch 64, Adam, median of {done} rounds of {args.steps} "
          f"steps; load average {figures['load_average']}")
    for key, value in figures.items():
        if key in figures["rounds"]:
            print(f"  {key:<22} {value:8.1f} steps/s")
    for name, other, goal in RATIOS:
        interval = figures["intervals"].get(f"{name}_vs_{other}")
        if interval is not None:
            print(f"  {name} / {other}: {stats.format_interval(interval)} "
                  f"(goal >= {goal}) {stats.verdict(interval, goal)}")


if __name__ == "__main__":
    main()
