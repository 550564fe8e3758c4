"""All tfmulti benchmarks in one run: results.json, results.md and plots.

    python -m tfmulti.bench --quick --out docs/bench

Measures, on this machine and in this run: step overhead on 1, 2 and 4
simulated CPU replicas for an MLP and a CNN (bare `tf.range` loop, Trainer,
Keras default `fit`, and any other variant `step_overhead` reports), replica
overhead (examples/s at N over 1), the input pipeline vs in-memory batches,
the gradient all-reduce between 2 local worker processes (time, bytes,
collectives; packing and wire dtype) and the peak memory of gradient
accumulation vs a real large batch. Each device layout and each worker runs
in its own process, bounded by a timeout and killed at the end.
"""

from __future__ import annotations

import argparse
from concurrent import futures as concurrent_futures
import json
import os
import signal
import sys
import time
import traceback

from tfmulti import cluster as cluster_lib
from tfmulti import quiet_logging
from tfmulti.bench import parts, report

# Per mode: the settings of every part. --quick stays under 3 minutes on an
# idle 2-core machine (N=1 and N=4 only: the XLA and fit goals are judged
# there; the full run adds N=2); --tiny is for the schema test (timings
# meaningless).
MODES = {
    "full": {
        "replicas": (1, 2, 4),
        "mlp": {"steps": 256, "repeats": 5},
        "cnn": {"steps": 64, "repeats": 5},
        "input_pipeline": {"replicas": 2, "steps": 20, "rounds": 16},
        "communication": {"params": 10_000_000, "steps": 3, "repeats": 5},
        "memory": {"batch": 128, "grad_accum_steps": 4, "steps": 4},
        "soak": {"seconds": 300, "interval": 10},
        "pipeline_bubble": {"stages": (2, 4)},
        # Full bench only: eight trainings of 4 epochs on 2 workers x 2
        # replicas per seed (about 20 minutes per seed on 2 cores; --seeds
        # adds seeds).
        "communication_reduction": {"steps": 1248, "global_batch_size": 64},
        # The recipe's command lines at their defaults, run length too
        # (steps None: --epochs=3, 468 updates of 128), 2 workers: 3-8
        # minutes per row and seed on 2 shared cores.
        "recipes": {"steps": None, "seeds": (0, 1, 2, 3, 4),
                    "rows": ("sync", "parameter_server", "powersgd_r4",
                             "local_sgd_h8", "pipeline")},
        # 2 workers, one under a CPU quota: even vs "auto", alternating.
        "balance": {"rounds": 8, "round_steps": 40, "steps_per_loop": 10,
                    "global_batch_size": 256, "slow_fraction": 0.3},
        # An input-bound job with 0, 1 and 2 data workers, alternating.
        "data_service": {"replicas": 2, "steps": 40, "rounds": 5,
                         "global_batch_size": 64},
        "sharding": {"replicas": (2, 4), "steps": 50, "rounds": 12,
                     "width": 512, "global_batch_size": 64},
    },
    "quick": {
        "replicas": (1, 4),
        # A time budget, not a count of rounds: step-overhead layouts run
        # paired rounds until every goal ratio's 95% interval is narrower
        # than `ci_width` (high/low - 1) or their share of the budget is
        # spent. They run last; `reserve_seconds` is left for the report
        # and the last round that passes a layout's deadline. Only what a
        # goal is judged by: XLA on the CNN, no steps_per_loop=1 Trainer.
        "budget_seconds": 180,
        "reserve_seconds": 15,
        "mlp": {"steps": 128, "repeats": 40, "xla": False,
                "steps_per_loop_1": False, "ci_width": 0.05},
        "cnn": {"steps": 64, "repeats": 40, "steps_per_loop_1": False,
                "ci_width": 0.05},
        "input_pipeline": {"replicas": 2, "steps": 10, "rounds": 4},
        "communication": {"params": 10_000_000, "steps": 2, "repeats": 3},
        "memory": {"batch": 128, "grad_accum_steps": 4, "steps": 3},
    },
    "tiny": {
        "replicas": (1, 2),
        # Two calls of 32 steps: the steady fit rate is timed between them.
        # XLA on the CNN only (its goal): each compile costs seconds.
        "mlp": {"steps": 64, "repeats": 1, "xla": False, "warmup": False},
        "cnn": {"steps": 64, "repeats": 1, "batch": 8, "warmup": False},
        # Uncached: no untimed caching pass over 1250 batches of 16.
        "input_pipeline": {"replicas": 1, "steps": 2, "rounds": 1,
                           "global_batch_size": 16, "cache": False},
        "communication": {"params": 100_000, "steps": 1, "repeats": 1},
        "memory": {"batch": 16, "grad_accum_steps": 2, "steps": 1},
        "data_service": {"replicas": 1, "steps": 2, "rounds": 1,
                         "global_batch_size": 8},
        # Every process at once, every step-overhead layout in one process:
        # the timings mean nothing here anyway.
        "concurrent": True,
        "one_process": True,
    },
}
PART_NAMES = ("step_overhead", "input_pipeline", "communication",
              "accumulation_memory", "soak", "pipeline_bubble",
              "communication_reduction", "recipes", "balance",
              "data_service", "sharding")


def _in_turn(calls, concurrent):
    """{key: fn()} for `calls` {key: fn}, one after another or at once."""
    if not concurrent:
        return {key: fn() for key, fn in calls.items()}
    with concurrent_futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {key: pool.submit(fn) for key, fn in calls.items()}
        return {key: f.result() for key, f in futures.items()}


def _step_overhead(mode, timeout):
    if mode.get("one_process"):
        return parts.run_part("step_overhead_layouts", {
            "replicas": list(mode["replicas"]),
            **{model: mode[model] for model in ("mlp", "cnn")}},
            timeout=timeout)[0]

    # The longest set-ups first (most replicas; the CNN's XLA compile):
    # a set-up longer than its share is then made up by the layouts after
    # it, and the last, shortest one ends close to the deadline.
    layouts = [(model, n) for n in sorted(mode["replicas"], reverse=True)
               for model in ("cnn", "mlp")]
    # The machine's calibration: the MLP's bare loop on the fewest replicas.
    calibrating = ("mlp", min(mode["replicas"]))
    def layout(model, n):
        def call():
            kwargs = dict(mode[model], replicas=n, model=model)
            if "deadline" in mode:
                # An equal share of what is left, its set-up included: the
                # layout's process times rounds until its own deadline, so
                # a set-up longer than expected (4 replicas, an XLA
                # compile, load) shortens its rounds, not the budget.
                left = mode["deadline"] - mode["reserve_seconds"] - (
                    time.monotonic())
                layouts_left = len(layouts) - layouts.index((model, n))
                kwargs["deadline"] = time.time() + left / layouts_left
            began = time.monotonic()
            try:
                figures = parts.run_part("step_overhead", kwargs,
                                    timeout=timeout)[0]
            except Exception:  # one layout must not lose the others
                mode.setdefault("layout_errors", {})[
                    f"step_overhead {model} N={n}"] = traceback.format_exc()
                print(f"tfmulti.bench: step_overhead {model} N={n} FAILED:\n"
                      f"{traceback.format_exc()[-1000:]}", flush=True)
                return None
            figures["setup_s"] = (time.monotonic() - began -
                                  figures.get("timing_s", 0.0))
            if (model, n) == calibrating:
                # Compare rates between machines through it.
                calibration = report.calibration(figures)
                mode["calibration"] = calibration
                print(f"tfmulti.bench: calibration: {calibration['name']} "
                      f"{calibration['steps_per_s']:.0f} steps/s",
                      flush=True)
            return figures
        return call

    calls = {(model, str(n)): layout(model, n) for model, n in layouts}
    results = {"mlp": {}, "cnn": {}}
    for (model, n), figures in _in_turn(
            calls, mode.get("concurrent", False)).items():
        if figures is not None:
            results[model][n] = figures
    return {model: by_n for model, by_n in results.items() if by_n}


def _communication(mode, timeout):
    configs = cluster_lib.local_cluster(2)
    workers = parts.run_part("communication", mode["communication"],
                        timeout=timeout,
                        envs=[{"TF_CONFIG": json.dumps(c)} for c in configs])
    result = workers[0]
    # Collectives pair up, so the workers' times differ by little; the
    # chief's are reported, the other's kept for reference.
    result["other_worker_seconds_per_step"] = {
        k: v["seconds_per_step"] for k, v in workers[1]["configs"].items()}
    return result


def _accumulation_memory(mode, timeout):
    m = mode["memory"]
    k, b = m["grad_accum_steps"], m["batch"]
    runs = {"batch": {"batch": b}, "large_batch": {"batch": k * b},
            "accumulated": {"batch": b, "grad_accum_steps": k}}
    # Memory does not depend on speed: the three run at once.
    result = _in_turn({name: (lambda kw=kw: parts.run_part(
        "accumulation_memory", dict(kw, steps=m["steps"]),
        timeout=timeout)[0]) for name, kw in runs.items()}, True)

    def ratio(name, key):
        return result[name][key] / result["batch"][key]

    result.update(
        accum_vs_batch=ratio("accumulated", "peak_rss_bytes"),
        large_vs_batch=ratio("large_batch", "peak_rss_bytes"),
        accum_vs_batch_training=ratio("accumulated", "training_bytes"),
        large_vs_batch_training=ratio("large_batch", "training_bytes"))
    return result


def _input_pipeline(mode, timeout):
    kwargs = dict(mode["input_pipeline"])
    if mode.get("data_dir"):
        kwargs["data_dir"] = mode["data_dir"]
    return parts.run_part("input_pipeline", kwargs, timeout=timeout)[0]


def _two_clusters():
    """Two 2-worker loopback clusters on four distinct free ports."""
    ports = [int(a.rsplit(":", 1)[1]) for a in cluster_lib.local_cluster(
        4)[0]["cluster"]["worker"]]
    return [cluster_lib.local_cluster(2, ports=ports[:2]),
            cluster_lib.local_cluster(2, ports=ports[2:])]


def _soak(mode, timeout):
    # Minutes long by design: the full bench only.
    settings = mode["soak"]
    # The two jobs at once: threads, memory and files are per process, and
    # the part stays minutes long rather than twice that.
    return _in_turn({entry: (lambda entry=entry, configs=configs: parts.run_part(
        "soak", dict(settings, entry=entry),
        timeout=max(timeout, settings["seconds"] + 240),
        envs=[{"TF_CONFIG": json.dumps(c)} for c in configs])[0])
        for entry, configs in zip(("trainer", "fit"), _two_clusters())},
        True)
def _prepared_data_dir(mode):
    """`tfmulti_shapes` prepared once here, so the workers only read it."""
    import tempfile
    from tfmulti.data import shapes
    data_dir = mode.get("data_dir") or tempfile.mkdtemp(
        prefix="tfmulti_bench_")
    shapes.prepare_default(data_dir)
    return data_dir


def _communication_reduction(mode, timeout):
    data_dir = _prepared_data_dir(mode)
    configs = cluster_lib.local_cluster(2)
    return parts.run_part(
        "communication_reduction",
        dict(mode["communication_reduction"], data_dir=data_dir),
        # Minutes long by design: eight trainings per seed.
        timeout=max(timeout, 3600 * len(
            mode["communication_reduction"].get("seeds", (0,)))),
        envs=[{"TF_CONFIG": json.dumps(c)} for c in configs])[0]


def _pipeline_bubble(mode, timeout):
    # Full runs only: S stages need S cores to overlap, and the bubble is a
    # property of the schedule, not worth a minute of every --quick run.
    return {str(s): parts.run_part("pipeline_bubble", {"stages": s},
                              timeout=timeout)[0]
            for s in mode["pipeline_bubble"]["stages"]}


def _recipes(mode, timeout):
    from tfmulti.bench import recipe_commands
    data_dir = _prepared_data_dir(mode)
    settings = mode["recipes"]
    return recipe_commands.run(
        out=os.path.join(mode["out"], "recipes"), steps=settings["steps"],
        seeds=settings["seeds"], rows=settings["rows"], data_dir=data_dir,
        timeout=max(timeout, 1800))


def _balance(mode, timeout):
    # Full runs only (`--only balance`): minutes on 2 shared cores.
    from tfmulti.bench import balance
    return balance.run(parts.run_part, mode["balance"], timeout)


def _data_service(mode, timeout):
    # Not in --quick: three service processes and a minute of rounds.
    from tfmulti.bench import data_service
    return data_service.run(parts.run_part, mode["data_service"], timeout,
                            _prepared_data_dir(mode))


def _sharding(mode, timeout):
    # Full runs only (`--only sharding`): two processes, four Trainers.
    settings = dict(mode["sharding"])
    counts = settings.pop("replicas")
    return {str(n): parts.run_part("sharding", dict(settings, replicas=n),
                                   timeout=timeout)[0] for n in counts}


# Parts that run only where their mode names them (their settings key is
# their name): minutes long, or processes a quick run cannot afford.
OPTIONAL_PARTS = ("soak", "pipeline_bubble", "communication_reduction",
                  "recipes", "balance", "data_service", "sharding")
RUNNERS = {"step_overhead": _step_overhead, "input_pipeline": _input_pipeline,
           "communication": _communication,
           "accumulation_memory": _accumulation_memory, "soak": _soak,
           "pipeline_bubble": _pipeline_bubble,
           "communication_reduction": _communication_reduction,
           "recipes": _recipes, "balance": _balance,
           "data_service": _data_service, "sharding": _sharding}


def run(*, out: str, mode: str = "quick", only=PART_NAMES,
        timeout: float = 300.0, data_dir: str | None = None,
        seeds=None) -> dict:
    """Runs the benchmark parts, writes the report to `out`; returns it.

    Args:
      out: directory for results.json, results.md and the PNG plots.
      mode: "full", "quick" or "tiny" (see `MODES`).
      only: the parts to run (`PART_NAMES`).
      timeout: seconds each part may take before its processes are killed.
      data_dir: TFDS data dir holding (or to hold) `tfmulti_shapes` for the
        input-pipeline part; None prepares it in a temporary directory.
      seeds: seeds of the communication_reduction part (one training per
        configuration and seed); None: the mode's.

    A part that fails or times out is recorded under "errors" and the
    others still run.
    """
    if mode not in MODES:
        raise ValueError(f"`mode` is {mode!r}; use one of {list(MODES)}.")
    unknown = set(only) - set(PART_NAMES)
    if unknown:
        raise ValueError(f"`only` has unknown parts {sorted(unknown)}; "
                         f"choose from {list(PART_NAMES)}.")
    began = time.monotonic()
    load_start = os.getloadavg()
    settings = dict(MODES[mode], data_dir=data_dir, out=out)
    if "budget_seconds" in settings:
        settings["deadline"] = began + settings["budget_seconds"]
    for name in ("communication_reduction", "recipes"):
        if seeds is not None and name in settings:
            settings[name] = dict(settings[name], seeds=tuple(seeds))
    results = {"schema_version": report.SCHEMA_VERSION,
               "machine": report.machine(),
               "settings": dict({k: v for k, v in settings.items()
                                 if k != "deadline"}, mode=mode,
                                replicas=list(settings["replicas"])),
               "step_overhead": {}, "input_pipeline": None,
               "communication": None, "accumulation_memory": None,
               "soak": None, "pipeline_bubble": None,
               "communication_reduction": None, "recipes": None,
               "balance": None, "data_service": None, "sharding": None,
               "errors": {},
               "load_average": {"start": load_start, "parts": {}}}

    def one(name):
        part_began = time.monotonic()
        load_before = os.getloadavg()
        print(f"tfmulti.bench: {name} ... (load average "
              f"{report.format_load(load_before)})", flush=True)
        try:
            results[name] = RUNNERS[name](settings, timeout)
        except Exception:  # one broken part must not lose the others
            results["errors"][name] = traceback.format_exc()
            print(f"tfmulti.bench: {name} FAILED:\n"
                  f"{results['errors'][name][-2000:]}", flush=True)
        results["load_average"]["parts"][name] = {
            "before": load_before, "after": os.getloadavg()}
        print(f"tfmulti.bench: {name} took "
              f"{time.monotonic() - part_began:.0f} s", flush=True)

    # A part its mode does not name (the soak, the recipes, ... in
    # --quick) is skipped here, not reported as taking 0 s.
    names = [name for name in PART_NAMES if name in only and (
        name not in OPTIONAL_PARTS or name in settings)]
    skipped = [name for name in PART_NAMES
               if name in only and name not in names]
    if skipped:
        print(f"tfmulti.bench: not in --{mode}: {', '.join(skipped)}",
              flush=True)
    if "deadline" in settings and "step_overhead" in names:
        # To a budget: the fixed-length parts first, then the adaptive
        # step-overhead rounds until the deadline, so that the budget
        # covers the whole run (a fixed reserve for the parts after them
        # guessed their length, and the run ended 7% over).
        names.append(names.pop(names.index("step_overhead")))
    _in_turn({name: (lambda name=name: one(name)) for name in names},
             settings.get("concurrent", False))
    results["seconds"] = time.monotonic() - began
    results["errors"].update(settings.get("layout_errors", {}))
    mlp = results["step_overhead"].get("mlp") or {}
    results["calibration"] = settings.get("calibration") or (
        report.calibration(mlp[min(mlp, key=int)]) if mlp else None)
    results["load_average"]["end"] = os.getloadavg()
    written = report.write(results, out)
    print(f"tfmulti.bench: wrote {written['json']}, {written['markdown']}"
          + "".join(f", {p}" for p in written["plots"]), flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfmulti.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results",
                        help="directory for results.json, results.md, PNGs")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="N=1 and 4 only, to a time budget: paired "
                      "rounds until each goal ratio's 95%% interval is "
                      "narrower than 5%% or the budget is spent (< 3 min "
                      "on an idle 2-core machine)")
    size.add_argument("--tiny", action="store_true",
                      help="smallest configuration, for tests only")
    parser.add_argument("--only", nargs="+", choices=PART_NAMES,
                        default=list(PART_NAMES), help="parts to run")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each part may take")
    parser.add_argument("--data_dir", default=None,
                        help="TFDS data dir for tfmulti_shapes (default: "
                        "prepared in a temporary directory)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds of the communication_reduction and "
                        "recipes parts (one training per configuration and "
                        "seed; default: 0 only, and 0 1 2 for recipes)")
    args = parser.parse_args(argv)
    # SIGTERM (e.g. `timeout`) unwinds like an exception, so every part's
    # `finally` kills its process group instead of orphaning it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    # Before any part imports TensorFlow here: its start-up lines off.
    quiet_logging.quiet([])
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    results = run(out=args.out, mode=mode, only=args.only,
                  timeout=args.timeout, data_dir=args.data_dir,
                  seeds=args.seeds)
    print(f"tfmulti.bench: {results['seconds']:.0f} s; load average "
          f"{report.format_load(results['load_average']['start'])} at start, "
          f"{report.format_load(results['load_average']['end'])} at end")
    for line in report.calibration_lines(results)[:1]:
        print(f"  {line}")
    for goal in results["goals"]:
        print(f"  {goal['name']}: {report.format_goal_value(goal)} (goal "
              f"{goal['goal']}) {goal['status']}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
