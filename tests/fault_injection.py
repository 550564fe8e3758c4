"""Fault injection: kill a worker of a 2-worker Trainer job, R times in a row.

    python tests/fault_injection.py [--runs 5] [--signals KILL] [--seed S]

Runs tests/workers/reliability_job.py (24 steps, a checkpoint every 4) under
`tfmulti-launch --workers 2 --max_restarts 2` once uninterrupted (the
reference), then R times with a fault: on the first attempt a random worker
sends itself SIGKILL (or SIGTERM: `--signals KILL TERM` alternates) after a
random step. After each run it checks that the job finished, that the restart
resumed from the last checkpoint (SIGKILL: at most one checkpoint interval (4) of
steps repeated; SIGTERM: none, the preemption checkpoint is of the signalled
step) and that both workers' final weights equal the reference's (max
absolute difference <= 1e-6). Prints `survived X/R runs, steps lost ...`.
Every launcher run is bounded (--timeout and a subprocess timeout). Exits 1
if any run failed a check.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "workers", "reliability_job.py")
STEPS = 24
CHECKPOINT_EVERY = 4
TOLERANCE = 1e-6
RUN_TIMEOUT = 240


def run_job(work_dir, fault=None):
    """One launcher run; returns (returncode, worker output, launcher log)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TFMULTI_FAULT", None)
    if fault:
        env["TFMULTI_FAULT"] = fault
    cmd = [sys.executable, "-m", "tfmulti.launch", "--workers", "2",
           "--max_restarts", "2", "--timeout", str(RUN_TIMEOUT - 20), "--",
           sys.executable, JOB, os.path.join(work_dir, "model"), work_dir,
           "--steps", str(STEPS), "--checkpoint_every",
           str(CHECKPOINT_EVERY)]
    # The launcher kills its workers on --timeout; this bounds the launcher.
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=RUN_TIMEOUT)
    return result.returncode, result.stdout, result.stderr


def final_weights(work_dir):
    out = []
    for index in (0, 1):
        with np.load(os.path.join(work_dir, f"weights-{index}.npz")) as f:
            out.append([f[k] for k in sorted(f.files,
                                             key=lambda k: int(k[4:]))])
    return out


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def check_run(work_dir, reference, signame, fault_step):
    """Runs one faulty job; returns (problems, steps repeated)."""
    worker = random.randrange(2)
    code, out, log = run_job(work_dir, f"{worker}:{fault_step}:{signame}")
    problems = []
    if code != 0:
        problems.append(f"launcher exited {code}: {log[-1500:]}")
    if f"FAULT SIG{signame} at step {fault_step}" not in out:
        problems.append("the fault did not fire")
    if signame == "TERM" and "was preempted (SIGTERM)" not in log:
        problems.append("the launcher did not report the preemption exit")
    starts = [int(s) for s in re.findall(
        r"\[w0\] START step=(\d+) attempt=1", out)]
    repeated = None
    if not starts:
        problems.append("no restarted attempt found")
    else:
        repeated = fault_step - starts[0]
        allowed = CHECKPOINT_EVERY if signame == "KILL" else 0
        if not 0 <= repeated <= allowed:
            problems.append(f"resumed at step {starts[0]} after a fault at "
                            f"step {fault_step}: {repeated} steps repeated, "
                            f"allowed {allowed}")
    if not code:
        for index, weights in enumerate(final_weights(work_dir)):
            diff = max_difference(weights, reference)
            if diff > TOLERANCE:
                problems.append(f"worker {index}'s final weights differ from "
                                f"the uninterrupted run by {diff:.3g}")
    print(f"SIG{signame} to worker {worker} after step {fault_step}: "
          f"{'ok' if not problems else 'FAILED'}, {repeated} step(s) "
          f"repeated", flush=True)
    for problem in problems:
        print("  " + problem, flush=True)
    return problems, repeated


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--signals", nargs="+", default=["KILL"],
                        choices=["KILL", "TERM"])
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"`--runs` should be >= 1, got {args.runs}")
    random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="tfmulti_faults_") as root:
        reference_dir = os.path.join(root, "reference")
        os.makedirs(reference_dir)
        code, _, log = run_job(reference_dir)
        if code != 0:
            print(f"the uninterrupted run failed ({code}): {log[-1500:]}")
            return 1
        reference = final_weights(reference_dir)[0]
        survived, lost = 0, []
        for run in range(args.runs):
            work_dir = os.path.join(root, f"run{run}")
            os.makedirs(work_dir)
            signame = args.signals[run % len(args.signals)]
            problems, repeated = check_run(
                work_dir, reference, signame,
                fault_step=random.randint(2, STEPS - 2))
            survived += not problems
            if repeated is not None:
                lost.append(repeated)
    print(f"survived {survived}/{args.runs} runs, steps lost (repeated) "
          f"per run {lost}, total {sum(lost)} (checkpoint every "
          f"{CHECKPOINT_EVERY} steps)", flush=True)
    return 0 if survived == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
