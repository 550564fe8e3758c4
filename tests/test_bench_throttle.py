"""The balance bench's slowdown (tfmulti/bench/throttle.py): a CPU quota
really slows a CPU-bound process to about its fraction of a core."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from tfmulti.bench import throttle

BUSY = "while True:\n    pass\n"


def _cpu_share(proc, seconds=1.5):
    """CPU seconds of `proc` per wall second, over `seconds`."""
    process = psutil.Process(proc.pid)
    before, began = sum(process.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return (sum(process.cpu_times()[:2]) - before) / (
        time.monotonic() - began)


def _busy():
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    # One core, so the share is of one core whatever the machine's count.
    os.sched_setaffinity(proc.pid, {sorted(os.sched_getaffinity(0))[0]})
    return proc


def test_cgroup_quota_slows_a_busy_process_to_its_fraction():
    with throttle.cpu_quota(0.3) as path:
        if path is None:
            pytest.skip("cgroup v1 cpu controller not writable here")
        proc = _busy()
        try:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(proc.pid))
            share = _cpu_share(proc)
        finally:
            proc.kill()
            proc.wait()
    # At most the quota (plus accounting slack); the machine's other load
    # can only lower it.
    assert share < 0.4
    assert not os.path.exists(path)


def test_duty_cycle_slows_a_busy_process_and_leaves_it_running():
    proc = _busy()
    cycle = throttle.start_duty_cycle(proc.pid, 0.3)
    try:
        time.sleep(0.3)
        share = _cpu_share(proc)
        cycle.terminate()
        cycle.wait(timeout=10)
        # SIGTERM continues the process before the throttler leaves.
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
    finally:
        cycle.kill()
        proc.kill()
        proc.wait()
    assert share < 0.45
