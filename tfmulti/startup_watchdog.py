"""The start-up watchdog process: ends a worker stuck joining its cluster.

    python .../tfmulti/startup_watchdog.py PID SECONDS ME WHERE|PEER...  (by startup.py)

While TensorFlow waits for the cluster to form, the worker's main thread is
blocked in C++ holding the GIL (TF 2.21 measured: no Python thread runs and
SIGTERM is ignored), so the bound is kept by this separate process. The
worker writes `done` to its stdin once joined; EOF (the worker exited) ends
it too. Otherwise, after SECONDS it prints which peers accept connections
and SIGKILLs the worker. Standard library only, run by path: no TensorFlow.
"""

import os
import select
import signal
import socket
import sys


def _accepts(address, timeout=1.0):
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def main(argv):
    pid, seconds, me, peers = int(argv[1]), float(argv[2]), argv[3], argv[4:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    if ready:
        return 0  # `done`, or EOF: the worker joined or is gone
    peers = [p.split("|", 1) for p in peers]
    silent = [f"{where} {a!r}" for where, a in peers if not _accepts(a)]
    listening = [f"{where} {a!r}" for where, a in peers
                 if f"{where} {a!r}" not in silent]
    detail = (f"no answer from {', '.join(silent)}" if silent else
              "every peer's port answers, so one of them is not a "
              f"TensorFlow worker of this job or failed: {', '.join(listening)}")
    print(f"tfmulti: this worker ({me!r}) waited {seconds:g} s for the "
          f"cluster to form and gave up: {detail}. Check that every worker "
          "started (and its log for its own error), that the addresses in "
          "TF_CONFIG are right and reachable, and that every worker runs "
          "the same job. The bound is "
          "`create_strategy(startup_timeout_seconds=...)`; the worker is "
          "killed (SIGKILL: TensorFlow ignores SIGTERM while it waits).",
          file=sys.stderr, flush=True)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
