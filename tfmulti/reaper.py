"""The launcher's orphan guard: workers die with `tfmulti-launch`, however it dies.

    python .../tfmulti/reaper.py GRACE_SECONDS   (started by the launcher)

A launcher killed by SIGKILL (or the OOM killer) runs no handler, so its
workers would be re-parented to pid 1 and go on training and writing
`model_dir`. This small process, started by the launcher in a session of its
own (a signal to the launcher's process group does not reach it), reads the
process-group ids of the workers from a pipe whose only writer is the
launcher: `+PGID` when a worker starts, `-PGID` when the launcher has reaped
it, `done` when the launcher exits normally. When the pipe closes without
`done`, the launcher is gone: every listed group gets SIGTERM (the workers'
preemption signal, so they can save), then SIGKILL after GRACE_SECONDS.

Standard library only and run by path, so it starts in milliseconds and does
not import TensorFlow.
"""

import os
import signal
import sys
import time

_POLL_SECONDS = 0.1


def _alive(pgid):
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_all(pgids, signum):
    for pgid in pgids:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _say(message):
    try:
        print(f"tfmulti-launch: {message}", file=sys.stderr, flush=True)
    except OSError:  # the launcher's stderr may be gone with it
        pass


def main(argv):
    grace = float(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgids = set()
    for line in sys.stdin:
        line = line.strip()
        if line == "done":
            return 0
        if line[:1] == "+":
            pgids.add(int(line[1:]))
        elif line[:1] == "-":
            pgids.discard(int(line[1:]))
    pgids = {p for p in pgids if _alive(p)}
    if not pgids:
        return 0
    _say(f"the launcher died; stopping {len(pgids)} worker(s) "
         f"(SIGTERM, SIGKILL after {grace:g} s)")
    _signal_all(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pgids):
        time.sleep(_POLL_SECONDS)
    _signal_all(pgids, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
