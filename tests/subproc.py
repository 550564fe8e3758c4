"""Running TensorFlow in fresh processes, bounded in time, nothing left over.

TensorFlow fixes its device layout and collective configuration once per
process, so tests that need N simulated devices or N workers run them here.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tfmulti import cluster as cluster_lib
from tfmulti import launch_processes


def _start(argv, env, cwd=None):
    # faulthandler prints every thread's Python stack on SIGABRT: a process
    # that runs past its bound says where it was (see _stacks).
    env = dict(env, PYTHONFAULTHANDLER="1")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=cwd)


# The launcher's own: SIGKILL the process group, reap it.
_kill = launch_processes.kill_group


def _stacks(proc) -> str:
    """Ends an overdue `proc` with SIGABRT and returns the end of its output,
    which then holds faulthandler's stacks of every thread."""
    try:
        proc.send_signal(signal.SIGABRT)
        out, _ = proc.communicate(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        return "(no stacks: the process did not answer SIGABRT)"
    return (out or "")[-6000:]


class Stalled(AssertionError):
    """The process used no CPU for `stall_seconds` (see run_python)."""


def _cpu_seconds(pid) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(proc, timeout, stall_seconds):
    """proc.communicate(), bounded by `timeout` and, if given, by
    `stall_seconds` without CPU use."""
    deadline = time.monotonic() + timeout
    cpu, since = -1.0, time.monotonic()
    while True:
        now = time.monotonic()
        try:
            return proc.communicate(timeout=max(0.1, min(5.0, deadline - now)))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        if stall_seconds is None:
            continue
        try:
            used = _cpu_seconds(proc.pid)
        except (OSError, IndexError):
            continue
        if used != cpu:
            cpu, since = used, time.monotonic()
        elif time.monotonic() - since >= stall_seconds:
            raise Stalled(f"stalled: no CPU used for {stall_seconds}s")


def run_python(args, *, timeout=300, env=None, check=True, cwd=None,
               stall_seconds=None):
    """Runs `python ARGS` (in `cwd`) and returns (returncode, output).

    With `stall_seconds`, a process that uses no CPU that long is ended too
    and raises `Stalled` (with its threads' stacks).
    """
    proc = _start([sys.executable, *args], dict(os.environ, **(env or {})),
                  cwd=cwd)
    try:
        out, _ = _wait(proc, timeout, stall_seconds)
    except Stalled as stalled:
        stacks = _stacks(proc)
        _kill(proc)
        raise Stalled(f"python {args} {stalled}; its end:\n{stacks}")
    except subprocess.TimeoutExpired:
        stacks = _stacks(proc)
        _kill(proc)
        raise AssertionError(f"python {args} ran past {timeout}s; its end:\n"
                             f"{stacks}")
    finally:
        _kill(proc)
    if check and proc.returncode != 0:
        raise AssertionError(f"python {args} exited {proc.returncode}:\n"
                             f"{out[-4000:]}")
    return proc.returncode, out


def run_workers(args, num_workers, *, timeout=300, env=None, check=True,
                worker_env=None):
    """Runs `python ARGS` as `num_workers` workers of a loopback cluster.

    Each worker gets its own TF_CONFIG on free ports, or, with
    `worker_env(index) -> dict`, whatever environment describes the cluster
    (SLURM's variables, say). Returns a list of (returncode, output) in
    worker order. All workers are killed on timeout.
    """
    if worker_env is None:
        configs = cluster_lib.local_cluster(num_workers)

        def worker_env(index):
            return {"TF_CONFIG": json.dumps(configs[index])}

    procs = []
    try:
        for index in range(num_workers):
            procs.append(_start(
                [sys.executable, *args],
                dict(os.environ, **(env or {}), **worker_env(index))))
        results = []
        for i, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"worker {i} of python {args} ran past {timeout}s; its "
                    f"end:\n{_stacks(proc)}")
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            _kill(proc)
    if check:
        for i, (rc, out) in enumerate(results):
            if rc != 0:
                raise AssertionError(f"worker {i} exited {rc}:\n{out[-4000:]}")
    return results


def worker_json(args, num_workers, out_dir, *, timeout=300):
    """`run_workers` of `python ARGS OUT_DIR/worker{index}.json`, each worker
    writing its results there; returns them parsed, in worker order."""
    out = pathlib.Path(out_dir)
    run_workers([*args, str(out / "worker{index}.json")], num_workers,
                timeout=timeout)
    return [json.loads((out / f"worker{i}.json").read_text())
            for i in range(num_workers)]
