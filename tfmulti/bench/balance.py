"""Bench part `balance`: an even split against `balance="auto"` on 2 workers,
one of them slowed by a real cause.

Each worker pins itself to its own core (`os.sched_setaffinity`, what
`taskset -c` does) and trains a small conv net (compute dominates its step);
worker 1 gets only `slow_fraction` of its core from a CPU quota
(`throttle.py`: a cgroup, else a SIGSTOP/SIGCONT duty cycle). In one run
each worker keeps two Trainers, `balance=[1, 1]` (even) and `"auto"`, and
alternates rounds of the two (which goes first alternates too), so a
change of machine load meets both: the ratio auto/even is judged per
round (`stats.paired_ratio`). The first round of each is warm-up (tracing;
"auto" finding its shares) and left out.

Reported: steps/s of each and the ratio with its 95% interval; the barrier
idle fraction per loop; the fraction of the step outside the slower
replica's compute (what bounds the efficiency whatever the split); the
shares per loop over the whole run; and the
heterogeneous efficiency: achieved examples/s over the sum of each
worker's examples/s measured ALONE (no collectives, the same model and
quota, at its last "auto" share), measured after the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from tfmulti.bench import stats
from tfmulti.bench import throttle

SLOWED = 1


def _slow_down(settings) -> str:
    """Puts this worker under the quota the parent prepared; returns how."""
    if settings.get("cgroup"):
        throttle.join(settings["cgroup"])
        return f"cgroup cpu quota {settings['slow_fraction']} of a core"
    throttle.start_duty_cycle(os.getpid(), settings["slow_fraction"])
    return (f"SIGSTOP/SIGCONT duty cycle {settings['slow_fraction']} of "
            "each 20 ms")


class _Alone:
    """This worker training by itself: no strategy, no collectives (the
    same model, core and quota), for its examples/s at a given share."""

    def __init__(self, model_fn, x, y):
        import keras
        import tensorflow as tf
        keras.utils.set_random_seed(0)
        model = model_fn()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self._x, self._y = tf.constant(x), tf.constant(y)

        # One trace for every share: the batch dimension is unknown.
        @tf.function(input_signature=[
            tf.TensorSpec([None, *x.shape[1:]], tf.uint8),
            tf.TensorSpec([None], tf.int32)])
        def step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        self._step = step
        step(self._x[:1], self._y[:1]).numpy()

    def examples_per_sec(self, count: int, steps: int) -> float:
        images, labels = self._x[:count], self._y[:count]
        self._step(images, labels).numpy()  # the batch made, caches warm
        began = time.perf_counter()
        for _ in range(steps):
            loss = self._step(images, labels)
        loss.numpy()
        return count * steps / (time.perf_counter() - began)


def worker_main(*, cores, rounds: int, round_steps: int, steps_per_loop: int,
                global_batch_size: int, slow_fraction: float,
                cgroup: str | None = None, alone_steps: int = 5) -> dict:
    """One worker of the part (TF_CONFIG from the environment)."""
    import tfmulti
    index = tfmulti.cluster_config().task_index
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    slowdown = None
    if index == SLOWED:
        slowdown = _slow_down({"cgroup": cgroup,
                               "slow_fraction": slow_fraction})
    strategy = tfmulti.create_strategy("multi_worker")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfmulti import models

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(1024, 32, 32, 3)).astype("uint8")
    y = rng.integers(0, 10, size=(1024,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        global_batch_size, drop_remainder=True)

    def model_fn():
        return models.small_cnn(batch_norm=False)

    alone = _Alone(model_fn, x[:global_batch_size], y[:global_batch_size])
    trainers, rates, alone_rates = {}, {"even": [], "auto": []}, []
    idle = {"even": [], "auto": []}
    outside = {"even": [], "auto": []}
    for name, balance in (("even", [1, 1]), ("auto", "auto")):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = model_fn()
            optimizer = keras.optimizers.SGD(0.01)
        trainers[name] = tfmulti.Trainer(
            model, optimizer, strategy=strategy, balance=balance,
            steps_per_loop=steps_per_loop,
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None))
    began = time.perf_counter()
    for r in range(rounds + 1):
        order = ("even", "auto") if r % 2 == 0 else ("auto", "even")
        for name in order:
            # Each Trainer continues its own iterator over `data`.
            history = trainers[name].fit(data,
                                         steps=(r + 1) * round_steps,
                                         verbose=0)
            if r == 0:
                continue  # warm-up: tracing, "auto" finding its shares
            loop_rates = history["steps_per_sec"]
            # Steps over the loops' seconds: the round's steps/s.
            rates[name].append(len(loop_rates) * steps_per_loop / sum(
                steps_per_loop / v for v in loop_rates))
            idle[name].extend(history["idle_fraction"])
            # The share of the step no split can shorten: outside the
            # slower replica's compute (all-reduce, update, input).
            loops = trainers[name].balance_history[-len(loop_rates):]
            outside[name].append(1 - rates[name][-1] * statistics.fmean(
                max(h["seconds_per_step"]) for h in loops))
        if r:
            # In every round, at this worker's current "auto" share: a
            # change of load during the run meets both sides of the
            # efficiency.
            count = trainers["auto"].balance_history[-1]["counts"][index]
            alone_rates.append(alone.examples_per_sec(count, alone_steps))
    wall = time.perf_counter() - began
    shares = [{"step": h["step"], "shares": [c / global_batch_size
                                             for c in h["counts"]],
               "seconds_per_step": h["seconds_per_step"],
               "idle_fraction": h["idle_fraction"]}
              for h in trainers["auto"].balance_history]
    return {"worker": index, "core": core, "slowdown": slowdown,
            "rates": rates, "idle": idle, "outside": outside,
            "shares": shares,
            "even_seconds_per_step": [
                h["seconds_per_step"] for h in
                trainers["even"].balance_history],
            "alone_examples_per_sec": alone_rates, "wall_seconds": wall}


def summarize(workers, settings) -> dict:
    """The part's figures from both workers' results."""
    first = workers[0]
    even, auto = first["rates"]["even"], first["rates"]["auto"]
    batch = settings["global_batch_size"]
    # Per round: the sum of both workers' examples/s alone.
    capacity = [sum(pair) for pair in zip(
        *[w["alone_examples_per_sec"] for w in workers])]
    return {
        "slowed_worker": SLOWED,
        "slowdown": workers[SLOWED]["slowdown"],
        "even_steps_per_sec": statistics.median(even),
        "auto_steps_per_sec": statistics.median(auto),
        "rates": first["rates"],
        "intervals": {
            "auto_vs_even": stats.paired_ratio(auto, even),
            "efficiency_auto": stats.paired_ratio(
                [a * batch for a in auto], capacity),
            "efficiency_even": stats.paired_ratio(
                [e * batch for e in even], capacity)},
        "alone_examples_per_sec": [w["alone_examples_per_sec"]
                                   for w in workers],
        "idle_fraction_even": statistics.fmean(first["idle"]["even"]),
        "idle_fraction_auto": statistics.fmean(first["idle"]["auto"]),
        "outside_compute_even": statistics.fmean(first["outside"]["even"]),
        "outside_compute_auto": statistics.fmean(first["outside"]["auto"]),
        "shares": first["shares"],
        "even_seconds_per_step": first["even_seconds_per_step"],
        "wall_seconds": first["wall_seconds"],
        "settings": settings,
    }


def run(run_part, settings: dict, timeout: float) -> dict:
    """Runs the part: 2 workers, worker 1 under a CPU quota.

    Args:
      run_part: `tfmulti.bench.parts.run_part`.
      settings: `worker_main` keyword arguments but `cores` and `cgroup`.
      timeout: seconds before every process is killed.
    """
    from tfmulti import cluster as cluster_lib
    available = sorted(os.sched_getaffinity(0))
    cores = available[:2] if len(available) >= 2 else available * 2
    load_before = os.getloadavg()
    with throttle.cpu_quota(settings["slow_fraction"]) as cgroup:
        configs = cluster_lib.local_cluster(2)
        workers = run_part("balance", dict(settings, cores=cores,
                                           cgroup=cgroup),
                           timeout=timeout,
                           envs=[{"TF_CONFIG": json.dumps(c)}
                                 for c in configs])
    result = summarize(workers, dict(settings, cores=cores))
    result["load_average"] = {"before": load_before,
                              "after": os.getloadavg()}
    return result


def markdown(result: dict) -> list[str]:
    """The part's lines in results.md."""
    interval = result["intervals"]["auto_vs_even"]
    efficiency = result["intervals"]["efficiency_auto"]
    shares = result["shares"]
    return [
        "", "## Load balancing (2 workers, one slowed)", "",
        f"Worker {result['slowed_worker']} slowed by: {result['slowdown']}; "
        f"load average before {result['load_average']['before'][0]:.1f}, "
        f"after {result['load_average']['after'][0]:.1f}.", "",
        f"- steps/s even {result['even_steps_per_sec']:.2f}, auto "
        f"{result['auto_steps_per_sec']:.2f}; auto/even "
        f"{stats.format_interval(interval)} (goal >= 1.3: "
        f"{stats.verdict(interval, 1.3)})",
        "- heterogeneous efficiency (achieved examples/s over the sum of "
        "each worker's examples/s alone at its share, per round): auto "
        f"{stats.format_interval(result['intervals']['efficiency_auto'])}"
        f" (goal >= 0.9: {stats.verdict(efficiency, 0.9)}), even "
        f"{stats.format_interval(result['intervals']['efficiency_even'])}",
        f"- idle fraction even {result['idle_fraction_even']:.3f} -> auto "
        f"{result['idle_fraction_auto']:.3f}",
        "- fraction of the step outside the slower replica's compute "
        "(all-reduce, update, input; no split shortens it): even "
        f"{result['outside_compute_even']:.2f}, auto "
        f"{result['outside_compute_auto']:.2f}",
        "- worker 0's share under auto, per loop: " + ", ".join(
            f"{s['shares'][0]:.2f}" for s in shares),
    ]


def goals(result: dict) -> list[dict]:
    """The issue's goals, judged by their 95% intervals: auto/even steps/s
    >= 1.3 and heterogeneous efficiency >= 0.9."""
    found = []
    for key, goal, name in (
            ("auto_vs_even", 1.3, "balance: auto/even steps/s, worker 1 "
             "under a CPU quota"),
            ("efficiency_auto", 0.9, "balance: heterogeneous efficiency "
             "under auto")):
        interval = result["intervals"][key]
        status = stats.verdict(interval, goal)
        found.append({"name": name, "value": interval["ratio"],
                      "interval": [interval["low"], interval["high"]],
                      "rounds": interval["rounds"], "goal": f">= {goal}",
                      "met": status == "met", "status": status})
    return found


def plot(result: dict, out_dir: str) -> list[str]:
    """balance_shares.png: each worker's share per loop under "auto" ([]
    without matplotlib: the shares are in results.json)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    shares = result["shares"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in range(len(shares[0]["shares"])):
        ax.plot([s["step"] for s in shares], [s["shares"][r] for s in shares],
                marker=".", label=f"worker {r}" + (
                    " (slowed)" if r == result["slowed_worker"] else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("share of the global batch")
    ax.set_ylim(0, 1)
    ax.set_title('balance="auto": shares over time')
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "balance_shares.png"), dpi=80)
    plt.close(fig)
    return ["balance_shares.png"]
