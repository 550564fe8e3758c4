"""The recipe's command lines as users type them, against synchronous.

Each row is `tfmulti-launch --workers 2 [--ps 1] -- python -m
recipes.custom_loop --seed=K` plus the row's flags, every other flag at its
default (the run length too, unless `steps` is given), run once per seed;
the pipeline row is one process, as a pipeline runs. The figures come from
each run's metrics.json: test accuracy (the chief's final evaluation) and
the bytes this worker sent to the other
(`communication.inter_worker_bytes`). A row
is compared with the synchronous row of the same seed (same initial weights
and, for the synchronous loops, the same examples): the mean of the paired
differences with its 95% confidence interval (Student's t over the seeds).
A goal is met only when the interval's far end is within it, MISSED when
the whole interval is beyond it, otherwise not shown. Full bench only:
`python -m tfmulti.bench --only recipes [--seeds 0 1 2 3 4]`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from tfmulti.bench import stats

# name: (recipe flags, tfmulti-launch flags or None for one process, goal
# in points below sync). A pipeline runs in one process (it refuses a
# cluster): its two stages on two logical CPUs, not two workers.
ROWS = {
    "sync": ((), (), None),
    "local_sgd_h8": (("--sync_every=8",), (), 1.0),
    "powersgd_r4": (("--compression=powersgd", "--powersgd_rank=4"), (),
                    1.0),
    "parameter_server": (("--strategy=parameter_server",), ("--ps", "1"),
                         2.0),
    "pipeline": (("--cpu_replicas=2", "--pipeline_stages=2",
                  "--micro_batches=4"), None, None),
    # Synchronous training as long as a parameter-server run's default
    # (experiment_config.ASYNC_DEFAULT_EPOCHS): its reference.
    "sync_9_epochs": (("--epochs=9",), (), None),
}
# The synchronous row each row is compared with (else "sync"): the same
# run length at the defaults.
REFERENCE = {"parameter_server": "sync_9_epochs"}
REFERENCES = {"sync", *REFERENCE.values()}


def command(row: str, *, seed: int, steps: int | None, model_dir: str,
            data_dir: str | None, workers: int = 2,
            timeout: float = 1800) -> list[str]:
    """The command line of `row` for one seed, as a user types it (plus
    where the run goes and, when given, the data); `steps` None leaves the
    run length at the recipe's default (--epochs)."""
    recipe_flags, launch_flags, _ = ROWS[row]
    launch = [] if launch_flags is None else [
        "tfmulti-launch", "--workers", str(workers), *launch_flags,
        "--timeout", str(int(timeout)), "--"]
    return [*launch, sys.executable, "-m", "recipes.custom_loop",
            *recipe_flags,
            *([f"--steps={steps}"] if steps else []), f"--seed={seed}",
            f"--model_dir={model_dir}",
            *([f"--data_dir={data_dir}"] if data_dir else [])]


def interval(values) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t interval of the mean of `values`."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, -math.inf, math.inf
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t95(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def judge(low: float, high: float, goal: float) -> str:
    """"met" when the interval's far end is within `goal`, "MISSED" when
    its near end is beyond it, else "not shown"."""
    if high <= goal:
        return "met"
    if low > goal:
        return "MISSED"
    return "not shown"


def summarize(runs: dict) -> dict:
    """Per row: accuracies by seed, the paired gap below sync (points) with
    its interval, bytes between workers, wall times.

    Args:
      runs: {row: {seed (str): {"accuracy", "inter_worker_bytes",
        "seconds"} or {"error"}}}.
    """
    rows = {}
    for row, by_seed in runs.items():
        sync = runs.get(REFERENCE.get(row, "sync"), {})
        ok = {s: r for s, r in by_seed.items() if "error" not in r}
        entry = {"command_flags": list(ROWS[row][0]),
                 "launch_flags": (["(one process)"] if ROWS[row][1] is None
                                  else list(ROWS[row][1])),
                 "seeds": sorted(ok, key=int),
                 "errors": {s: r["error"] for s, r in by_seed.items()
                            if "error" in r},
                 "accuracy": {s: r["accuracy"] for s, r in ok.items()},
                 "seconds": {s: r["seconds"] for s, r in ok.items()},
                 "inter_worker_bytes": {s: r.get("inter_worker_bytes")
                                        for s, r in ok.items()}}
        paired = [100 * (sync[s]["accuracy"] - r["accuracy"])
                  for s, r in ok.items() if s in sync and
                  "error" not in sync[s]]
        reference = row in REFERENCES
        if not reference and paired:
            mean, low, high = interval(paired)
            entry.update(gap_points=paired, gap_mean=mean, gap_low=low,
                         gap_high=high, paired_seeds=len(paired))
        sync_bytes = [sync[s].get("inter_worker_bytes") for s in ok
                      if s in sync and "error" not in sync[s]]
        own = [r.get("inter_worker_bytes") for r in ok.values()]
        if not reference and sync_bytes and all(own) and all(sync_bytes):
            entry["fewer_bytes_than_sync"] = (sum(sync_bytes) / len(
                sync_bytes)) / (sum(own) / len(own))
        rows[row] = entry
    return rows


def goals(rows: dict) -> list[dict]:
    """The issue's goals on the paired gaps (report format)."""
    found = []
    for row, (_, _, goal) in ROWS.items():
        entry = rows.get(row)
        if goal is None or not entry or "gap_mean" not in entry:
            continue
        status = judge(entry["gap_low"], entry["gap_high"], goal)
        found.append({
            "name": f"recipe {' '.join(entry['command_flags'])}: accuracy "
                    f"below sync, points (mean, 95% CI over "
                    f"{entry['paired_seeds']} seeds)",
            "value": f"{entry['gap_mean']:+.2f} [{entry['gap_low']:+.2f}, "
                     f"{entry['gap_high']:+.2f}]",
            "goal": f"<= {goal:g}", "met": status == "met",
            "status": status})
    return found


def markdown(result: dict) -> list[str]:
    """The table of results.md."""
    s = result["settings"]
    length = f" --steps={s['steps']}" if s.get("steps") else ""
    lines = [f"`tfmulti-launch --workers {s['workers']} -- python -m "
             f"recipes.custom_loop{length} --seed=K` plus each row's flags, "
             "every other flag at its default"
             f"{'' if length else ' (the run length too)'}; gap = sync "
             "minus the row, paired by seed, 95% t interval.", "",
             "| row | flags | seeds | test accuracy, mean | below sync, "
             "mean [95% CI] (points) | fewer bytes between workers | wall "
             "time, mean (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row, e in result["rows"].items():
        accs = list(e["accuracy"].values())
        mean = f"{100 * sum(accs) / len(accs):.2f}%" if accs else "-"
        gap = (f"{e['gap_mean']:+.2f} [{e['gap_low']:+.2f}, "
               f"{e['gap_high']:+.2f}]" if "gap_mean" in e else "-")
        fewer = (f"{e['fewer_bytes_than_sync']:.1f}x"
                 if "fewer_bytes_than_sync" in e else
                 "1.0x" if row in REFERENCES else "n/a")
        secs = list(e["seconds"].values())
        wall = f"{sum(secs) / len(secs):.0f}" if secs else "-"
        flags = " ".join(e["launch_flags"] + e["command_flags"]) or "(none)"
        seeds = ",".join(e["seeds"]) or "-"
        if e["errors"]:
            seeds += f" (failed: {','.join(sorted(e['errors']))})"
        lines.append(f"| {row} | `{flags}` | {seeds} | {mean} | {gap} | "
                     f"{fewer} | {wall} |")
    return lines


def _one(row, seed, *, steps, out, data_dir, timeout):
    model_dir = os.path.join(out, f"{row}-seed{seed}")
    cmd = command(row, seed=seed, steps=steps, model_dir=model_dir,
                  data_dir=data_dir, timeout=timeout)
    began = time.monotonic()
    log = os.path.join(out, f"{row}-seed{seed}.log")
    # This tfmulti and its recipes, whichever is installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with open(log, "w") as f:
        # tfmulti-launch stops its workers at --timeout; this bound is for
        # the launcher itself (and for a one-process row).
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout + 120, env=env, cwd=out)
    seconds = time.monotonic() - began
    metrics = os.path.join(model_dir, "metrics.json")
    if proc.returncode != 0 or not os.path.exists(metrics):
        with open(log) as f:
            tail = f.read()[-1500:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    with open(metrics) as f:
        m = json.load(f)
    return {"accuracy": m["eval"]["accuracy"], "seconds": seconds,
            "inter_worker_bytes": (m.get("communication") or {}).get(
                "inter_worker_bytes")}


def run(*, out: str, steps: int | None = None, seeds=(0, 1, 2),
        rows=tuple(ROWS), data_dir: str | None = None, timeout: float = 1800,
        log=print) -> dict:
    """Runs every row for every seed (one after another), returns the
    summary; keeps each run's directory and log under `out`."""
    os.makedirs(out, exist_ok=True)
    raw_path = os.path.join(out, "recipes_runs.json")
    runs = {}
    if os.path.exists(raw_path):  # an interrupted bench goes on
        with open(raw_path) as f:
            runs = json.load(f)
    for seed in seeds:
        for row in rows:
            if str(seed) in runs.get(row, {}):
                continue
            log(f"tfmulti.bench: recipes {row} seed {seed} ...")
            try:
                result = _one(row, seed, steps=steps, out=out,
                              data_dir=data_dir, timeout=timeout)
            except subprocess.TimeoutExpired:
                result = {"error": f"ran past {timeout + 120:.0f} s"}
            log(f"tfmulti.bench: recipes {row} seed {seed}: {result}"[:400])
            runs.setdefault(row, {})[str(seed)] = result
            with open(raw_path, "w") as f:
                json.dump(runs, f, indent=1)
    return {"settings": {"steps": steps, "seeds": list(seeds), "workers": 2,
                         "rows": list(rows)},
            "rows": summarize(runs)}
