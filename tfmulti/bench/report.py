"""The benchmark report: results.json, results.md and PNG plots.

`results.json` schema (`SCHEMA_VERSION`): {"schema_version", "machine",
"settings", "step_overhead": {model: {replicas (str): {method: steps/s,
..., "trainer_32_vs_bare_loop_32", "trainer_32_vs_keras_fit", ...}}},
"replica_overhead": {model: {method: {replicas (str): ratio}}},
"input_pipeline", "communication", "accumulation_memory", "soak": {entry:
{"samples", "growth", ...}} (full mode only), "goals": [{"name",
"value", "goal", "met", "status"}], "errors": {part: message}, "seconds",
"load_average": {"start", "end", "parts": {part: {"before", "after"}}}}.
The machine may be shared: every figure comes with the 1/5/15-minute load
averages around it (per step-overhead process too), and only ratios measured
inside one process are goals.
"""

from __future__ import annotations

import json
import os
import platform

from tfmulti.bench import communication_reduction
from tfmulti.bench import plots as plots_lib
from tfmulti.bench import stats
from tfmulti.bench import step_overhead

SCHEMA_VERSION = 1
# The communication configuration `strategies.DEFAULT_PACK_BYTES` gives.
DEFAULT_PACK_CONFIG = "pack_4MiB_float32"
TOP_LEVEL_KEYS = ("schema_version", "machine", "settings", "step_overhead",
                  "replica_overhead", "input_pipeline", "communication",
                  "accumulation_memory", "soak", "goals", "errors",
                  "seconds", "load_average")
# `python -m tfmulti.bench --quick` should take at most this long on an idle
# 2-core machine.
QUICK_SECONDS = 180
# Step-overhead keys that are settings or ratios, not methods' steps/s.
_NOT_METHODS = {"replicas", "batch", "width", "steps", "repeats", "model",
                "rounds", "load_average", "intervals", "timing_s",
                "budget_seconds", "ci_width", "min_rounds",
                "bare_loop_structure", "setup_s"}
LABELS = {"bare_loop_32": "bare tf.range loop (ceiling: the faster of the "
                          "two below)",
          "bare_loop_keras": "bare loop, Keras apply_gradients reduces",
          "bare_loop_reduce_once": "bare loop, one all-reduce + apply",
          "trainer_32": "tfmulti Trainer, steps_per_loop 32",
          "trainer_1": "tfmulti Trainer, steps_per_loop 1",
          "keras_fit": "Keras 3 default model.fit",
          "trainer_32_xla": "tfmulti Trainer, steps_per_loop 32, XLA"}


def methods(figures: dict) -> list[str]:
    """The methods in one step-overhead result, known ones first.

    Any other steps/s entry (e.g. a tfmulti-enabled `model.fit` variant the
    step-overhead benchmark adds) is a method too.
    """
    extra = sorted(k for k, v in figures.items()
                   if k not in _NOT_METHODS and k not in LABELS and
                   "_vs_" not in k and isinstance(v, (int, float)))
    return [k for k in LABELS if k in figures] + extra


def machine() -> dict:
    """Where the run happened."""
    import keras
    import tensorflow as tf
    return {"cpus": os.cpu_count(), "gpus": len(
        tf.config.list_physical_devices("GPU")),
        "platform": platform.platform(), "python": platform.python_version(),
        "tensorflow": tf.__version__, "keras": keras.__version__,
        "load_average_at_start": os.getloadavg()}


def replica_overhead(step_overhead: dict) -> dict:
    """examples/s at N replicas over examples/s at 1 replica, per method.

    The global batch is the same at every N, so the ratio of steps/s is the
    ratio of examples/s; 1.0 means the replicas cost nothing.
    """
    out = {}
    for model, by_n in step_overhead.items():
        if "1" not in by_n:
            continue
        base = by_n["1"]
        out[model] = {m: {n: figs[m] / base[m] for n, figs in by_n.items()
                          if m in figs}
                      for m in methods(base)}
    return out


def goals(results: dict) -> list[dict]:
    """The issue's goals, each with the measured value and met / MISSED."""
    found = []

    def add(name, value, goal, met):
        found.append({"name": name, "value": value, "goal": goal,
                      "met": bool(met),
                      "status": "met" if met else "MISSED"})

    def add_ratio(figures, key, goal, name):
        interval = figures.get("intervals", {}).get(key)
        if interval is not None:
            # Judged by the 95% interval of the paired per-round ratios.
            status = stats.verdict(interval, goal)
            found.append({"name": name, "value": interval["ratio"],
                          "interval": [interval["low"], interval["high"]],
                          "rounds": interval["rounds"], "goal": f">= {goal}",
                          "met": status == "met", "status": status})
        elif key in figures:
            add(name, figures[key], f">= {goal}", figures[key] >= goal)

    for model, by_n in results.get("step_overhead", {}).items():
        ns = sorted(by_n, key=int)
        for n in ns:
            add_ratio(by_n[n], "trainer_32_vs_bare_loop_32", 0.95,
                      f"{model}: Trainer/bare loop at N={n}")
            add_ratio(by_n[n], "trainer_32_steady_vs_bare_loop_32_steady",
                      0.95, f"{model}: Trainer/bare loop, steady, at N={n}")
            add_ratio(by_n[n], "tfmulti_fit_32_steady_vs_bare_loop_32_steady",
                      0.95, f"{model}: tfmulti fit/bare loop, steady, at N={n}")
        if not ns:
            continue
        top = by_n[ns[-1]]
        add_ratio(top, "trainer_32_vs_keras_fit", 5,
                  f"{model}: Trainer/Keras fit at N={ns[-1]}")
        if model == "cnn":
            for n in sorted({ns[0], ns[-1]}, key=int):
                add_ratio(by_n[n], "trainer_32_xla_vs_bare_loop_32", 1.3,
                          f"cnn: Trainer XLA / uncompiled bare loop at N={n}")
        if model == "mlp":
            add_ratio(top, "tfmulti_fit_32_vs_keras_fit", 3,
                      f"mlp: tfmulti fit / Keras fit, whole {top['steps']}-"
                      f"step call at N={ns[-1]}")
            add_ratio(top, "tfmulti_fit_32_steady_vs_trainer_32_steady", 0.9,
                      f"mlp: tfmulti fit / Trainer, steady, at N={ns[-1]}")
    pipe = results.get("input_pipeline")
    if pipe:
        add("input pipeline / in-memory (paired)", pipe["ratio_paired"],
            ">= 0.95", pipe["ratio_paired"] >= 0.95)
    comm = (results.get("communication") or {}).get("configs")
    if comm:
        f32, b16 = comm["one_pack_float32"], comm["one_pack_bfloat16"]
        bytes_ratio = b16["payload_bytes"] / f32["payload_bytes"]
        add("bfloat16 bytes / float32 bytes", bytes_ratio, "0.5",
            abs(bytes_ratio - 0.5) < 1e-9 and
            b16["wire_dtypes"] == ["bfloat16"])
        # Judged by time: a configuration is better only if its all-reduce
        # is faster, whatever its count of collectives; the default packing
        # also by the time of a whole training step.
        step = (results["communication"].get("train_step") or {}).get(
            "configs", {})
        for faster, slower, name, timed in (
                (DEFAULT_PACK_CONFIG, "one_pack_float32",
                 "all-reduce speed-up: default 4 MiB packs over one pack",
                 comm),
                ("pack_4MiB_bfloat16", DEFAULT_PACK_CONFIG,
                 "all-reduce speed-up: bfloat16 over float32 on the wire "
                 "(4 MiB packs; opt-in, lossy)", comm),
                (DEFAULT_PACK_CONFIG, "one_pack_float32",
                 "training-step speed-up: default 4 MiB packs over one "
                 "pack", step)):
            if faster in timed and slower in timed:
                interval = stats.paired_ratio(timed[slower]["rounds"],
                                              timed[faster]["rounds"])
                status = stats.verdict(interval, 1.0)
                found.append({
                    "name": name, "value": interval["ratio"],
                    "interval": [interval["low"], interval["high"]],
                    "rounds": interval["rounds"], "goal": "> 1",
                    "met": status == "met", "status": status})
    reduced = (results.get("communication_reduction") or {}).get("configs")
    if reduced:
        found.extend(communication_reduction.goals(reduced))
    recipe_rows = (results.get("recipes") or {}).get("rows")
    if recipe_rows:
        from tfmulti.bench import recipe_commands
        found.extend(recipe_commands.goals(recipe_rows))
    mem = results.get("accumulation_memory")
    if mem:
        add("peak memory: accumulate K x B / batch B", mem["accum_vs_batch"],
            "<= 1.2", mem["accum_vs_batch"] <= 1.2)
    if results.get("balance"):
        from tfmulti.bench import balance
        found.extend(balance.goals(results["balance"]))
    for entry, soak in (results.get("soak") or {}).items():
        # Flat: under 5% growth from the first sample after warm-up to the
        # last, for each resource a long job could exhaust.
        for key in ("threads", "rss_bytes", "fds"):
            ratio = soak["growth"][key]["ratio"]
            add(f"soak {entry} {soak['seconds']:.0f} s: {key} last/after "
                "warm-up", ratio, "< 1.05", ratio < 1.05)
    settings = results.get("settings", {})
    if settings.get("mode") == "quick" and "seconds" in results:
        load = results.get("load_average", {})
        add(f"--quick wall time, s (load average start "
            f"{format_load(load.get('start'))}, end "
            f"{format_load(load.get('end'))}; "
            "goal on an idle machine)", results["seconds"],
            f"< {QUICK_SECONDS}", results["seconds"] < QUICK_SECONDS)
    return found


def calibration(figures: dict) -> dict:
    """The calibration of a step-overhead layout: its bare loop's rate."""
    return {"name": f"bare loop, {figures['model']}, N={figures['replicas']}",
            "steps_per_s": figures["bare_loop_32"],
            "load_average": figures["load_average"]["before"]}


def calibration_lines(results: dict) -> list[str]:
    """The machine's calibration line (bare loop steps/s), if measured."""
    c = results.get("calibration")
    if not c:
        return []
    return [f"Calibration: {c['name']} {c['steps_per_s']:.0f} steps/s "
            f"(load average {format_load(c.get('load_average'))}); compare "
            "rates between machines through it.", ""]


def format_load(values):
    return "?" if not values else "/".join(f"{v:.1f}" for v in values)


def format_goal_value(goal: dict) -> str:
    """A goal's measured value, with its 95% interval and rounds if any."""
    interval = goal.get("interval")
    if not interval or interval[0] is None:
        return _fmt(goal["value"])
    return (f"{goal['value']:.3g} [{interval[0]:.3g}, {interval[1]:.3g}] "
            f"({goal['rounds']} rounds)")


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown(results: dict) -> str:
    """results.md: the machine, the goals and every table."""
    m = results["machine"]
    load = results.get("load_average", {})
    lines = ["# tfmulti benchmarks", "",
             f"Machine: {m['cpus']} CPU cores, {m['gpus']} GPU, "
             f"TensorFlow {m['tensorflow']}, Keras {m['keras']}, Python "
             f"{m['python']}, {m['platform']}; load average (1/5/15 min) "
             f"at start {format_load(load.get('start'))}, at end "
             f"{format_load(load.get('end'))}. Settings: "
             f"{results['settings']['mode']}; total "
             f"{results['seconds']:.0f} s.", "", *calibration_lines(results),
             "## Goals", "",
             "A ratio is judged by its 95% interval over paired rounds: "
             "met when the whole interval reaches the goal, MISSED when it "
             "lies below, not shown when it straddles the goal.", "",
             "| goal | measured | target | status |",
             "| --- | --- | --- | --- |"]
    for g in results["goals"]:
        lines.append(f"| {g['name']} | {format_goal_value(g)} | "
                     f"{g['goal']} | {g['status']} |")
    for part, around in load.get("parts", {}).items():
        lines.append(f"\nLoad average around {part}: before "
                     f"{format_load(around['before'])}, after "
                     f"{format_load(around['after'])}.")
    for model, by_n in results["step_overhead"].items():
        ns = sorted(by_n, key=int)
        lines += ["", f"## Step overhead: {model} (steps/s, median)", "",
                  "| method | " + " | ".join(f"N={n}" for n in ns) + " |",
                  "| --- |" + " --- |" * len(ns)]
        for method in methods(by_n[ns[0]]):
            lines.append(f"| {LABELS.get(method, method)} | " + " | ".join(
                _fmt(by_n[n].get(method, float("nan"))) for n in ns) + " |")
        for ratio in (f"{a}_vs_{b}" for a, b, _ in step_overhead.RATIOS):
            if any(ratio in by_n[n] for n in ns):
                lines.append(f"| ratio {ratio} | " + " | ".join(
                    _fmt(by_n[n].get(ratio, float("nan"))) for n in ns)
                    + " |")
        lines.append("| load average before / after | " + " | ".join(
            f"{format_load(by_n[n].get('load_average', {}).get('before'))} / "
            f"{format_load(by_n[n].get('load_average', {}).get('after'))}"
            for n in ns) + " |")
    for model, by_method in results["replica_overhead"].items():
        lines += ["", f"## Replica overhead: {model} (examples/s at N / at "
                  "1, same global batch, same cores; ideal 1.0)", "",
                  "| method | " + " | ".join(
                      f"N={n}" for n in sorted(next(iter(
                          by_method.values())), key=int)) + " |"]
        lines.append("| --- |" + " --- |" * len(next(iter(
            by_method.values()))))
        for method, by_n in by_method.items():
            lines.append(f"| {LABELS.get(method, method)} | " + " | ".join(
                _fmt(by_n[n]) for n in sorted(by_n, key=int)) + " |")
    pipe = results.get("input_pipeline")
    if pipe:
        lines += ["", f"## Input pipeline ({pipe['replicas']} replicas, "
                  f"batch {pipe['global_batch_size']})", "",
                  "| feed | steps/s (best round) | steps per CPU s |",
                  "| --- | --- | --- |"]
        for feed, rate in pipe["steps_per_s"].items():
            lines.append(f"| {feed} | {_fmt(rate)} | "
                         f"{_fmt(pipe['steps_per_cpu_s'][feed])} |")
        lines.append(f"\nPipeline / memory: {_fmt(pipe['ratio_paired'])} "
                     f"(median of per-round ratios), {_fmt(pipe['ratio'])} "
                     f"(best rounds), {_fmt(pipe['ratio_cpu'])} (per CPU s).")
    comm = results.get("communication")
    if comm:
        lines += ["", f"## Communication ({comm['workers']} worker processes"
                  f" on loopback, {comm['params']:,} parameters in "
                  f"{comm['gradient_tensors']} tensors)", "",
                  "| configuration | ms per all-reduce | collectives per step "
                  "| wire dtype | payload MB | ring MB per worker |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, c in comm["configs"].items():
            lines.append(
                f"| {name} | {c['seconds_per_step'] * 1e3:.1f} | "
                f"{c['collectives_per_step']} | {','.join(c['wire_dtypes'])}"
                f" | {c['payload_bytes'] / 1e6:.1f} | "
                f"{c['ring_bytes_per_worker'] / 1e6:.1f} |")
        lines.append(f"\nMaking the gradients without reducing them: "
                     f"{comm['fill_only_s'] * 1e3:.1f} ms per step.")
        step = comm.get("train_step")
        if step:
            lines.append(
                f"\nA whole training step of that MLP ({step['layers']} "
                f"dense layers, {step['batch']} examples per replica, SGD): "
                + ", ".join(f"{name} {c['seconds_per_step'] * 1e3:.1f} ms"
                            for name, c in step["configs"].items())
                + f"; without the all-reduce "
                f"{step['compute_only_s'] * 1e3:.1f} ms.")
    mem = results.get("accumulation_memory")
    if mem:
        lines += ["", "## Gradient accumulation memory (one device, "
                  "small_cnn 32x32x3)", "",
                  "| run | examples per update | peak RSS MB | added by "
                  "training MB |", "| --- | --- | --- | --- |"]
        for name in ("batch", "large_batch", "accumulated"):
            r = mem[name]
            lines.append(f"| {name} (batch {r['batch']}, K="
                         f"{r['grad_accum_steps']}) | "
                         f"{r['examples_per_update']} | "
                         f"{r['peak_rss_bytes'] / 1e6:.0f} | "
                         f"{r['training_bytes'] / 1e6:.0f} |")
        lines.append(f"\nPeak accumulated / batch B: "
                     f"{_fmt(mem['accum_vs_batch'])}; large batch / batch B:"
                     f" {_fmt(mem['large_vs_batch'])}; added by training, "
                     f"accumulated / batch B: "
                     f"{_fmt(mem['accum_vs_batch_training'])}.")
    if results.get("pipeline_bubble"):
        from tfmulti.bench import pipeline_bubble
        lines += pipeline_bubble.markdown(results["pipeline_bubble"])
    reduced = results.get("communication_reduction")
    if reduced:
        lines += ["", "## Less communication (2 workers x 2 replicas, "
                  f"small_cnn, {reduced['settings']['steps']} steps of "
                  f"{reduced['settings']['global_batch_size']})", ""]
        lines += communication_reduction.markdown(reduced)
    if results.get("sharding"):
        from tfmulti.bench import sharding
        lines += sharding.markdown(results["sharding"])
    if results.get("recipes"):
        from tfmulti.bench import recipe_commands
        lines += ["", "## The recipe's commands at their defaults", ""]
        lines += recipe_commands.markdown(results["recipes"])
    if results.get("data_service"):
        from tfmulti.bench import data_service
        lines += data_service.markdown(results["data_service"])
    if results.get("balance"):
        from tfmulti.bench import balance
        lines += balance.markdown(results["balance"])
    if results["errors"]:
        lines += ["", "## Errors", ""]
        lines += [f"- {part}: {msg.splitlines()[-1] if msg else ''}"
                  for part, msg in results["errors"].items()]
    plots = results.get("plots", [])
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: str) -> dict:
    """Completes `results` (derived figures, goals, plots) and writes all.

    Returns:
      {"json": path, "markdown": path, "plots": [paths]}.
    """
    os.makedirs(out_dir, exist_ok=True)
    results["replica_overhead"] = replica_overhead(results["step_overhead"])
    results["goals"] = goals(results)
    results["plots"] = plots_lib.plots(results, out_dir, labels=LABELS,
                                       methods=methods)
    if results.get("balance"):
        from tfmulti.bench import balance
        results["plots"] += balance.plot(results["balance"], out_dir)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w") as f:
        f.write(markdown(results))
    return {"json": json_path, "markdown": md_path,
            "plots": [os.path.join(out_dir, p) for p in results["plots"]]}
