"""Slowing one worker down by a real, external cause: a CPU quota.

A competing `while True` process barely slows a worker under Linux's
scheduler: the worker sleeps at the barrier for most of a step, and a task
that wakes from sleep runs ahead of a CPU-bound one (measured on this
project's machine, BUILD_NOTES issue 32). A CPU quota does: the kernel lets
the worker run `fraction` of each period and then stops it until the next
one, whatever else runs, as a cloud VM's CPU credit or a container limit
does.

Two ways, the first that this machine allows:
* `cgroup`: a child of the cgroup v1 `cpu` controller
  (`/sys/fs/cgroup/cpu`) with `cpu.cfs_quota_us / cpu.cfs_period_us =
  fraction`, which the worker joins (writes its pid to `cgroup.procs`);
* `duty_cycle`: a separate process that sends the worker SIGSTOP and
  SIGCONT, running it `fraction` of each period (coarser: the stop also
  lands while the worker waits at the barrier).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

CGROUP_CPU = "/sys/fs/cgroup/cpu"
# Short enough that a step of tens of milliseconds sees the quota as a
# slower core, not as runs of full speed and long stops.
PERIOD_US = 10_000


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


@contextlib.contextmanager
def cpu_quota(fraction: float, *, root: str = CGROUP_CPU,
              period_us: int = PERIOD_US):
    """A cgroup allowed `fraction` of one core; yields its directory, or
    None where cgroup v1's cpu controller is absent or not writable (then
    use `duty_cycle`). Removed at exit (its processes must have ended)."""
    if not 0 < fraction < 1:
        raise ValueError(f"`fraction` is {fraction}; it should be in (0, 1):"
                         " the share of one core the slowed worker gets.")
    path = os.path.join(root, f"tfmulti_bench_{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        _write(os.path.join(path, "cpu.cfs_period_us"), period_us)
        _write(os.path.join(path, "cpu.cfs_quota_us"),
               int(fraction * period_us))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        yield None
        return
    try:
        yield path
    finally:
        # The kernel refuses while a process is still inside: wait a little
        # for the workers' exit to be reaped.
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


def join(path: str) -> None:
    """Moves this process (all its threads) into the cgroup `path`."""
    _write(os.path.join(path, "cgroup.procs"), os.getpid())


def start_duty_cycle(pid: int, fraction: float, *,
                     period: float = 0.02) -> subprocess.Popen:
    """A process that lets `pid` run `fraction` of every `period` seconds
    (SIGCONT, then SIGSTOP for the rest); it ends when `pid` does. Kill it
    to stop (the worker is then left running: it sends SIGCONT on
    SIGTERM)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tfmulti.bench.throttle", str(pid),
         str(fraction), str(period)], start_new_session=True)


def _duty_cycle(pid: int, fraction: float, period: float) -> None:
    def leave(*_):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    try:
        while True:
            os.kill(pid, signal.SIGCONT)
            time.sleep(fraction * period)
            os.kill(pid, signal.SIGSTOP)
            time.sleep((1 - fraction) * period)
    except ProcessLookupError:
        return


if __name__ == "__main__":
    _duty_cycle(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
