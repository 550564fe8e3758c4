"""The start-up watchdog process: ends a worker stuck joining its cluster.

    python .../tfmulti/startup_watchdog.py PID SECONDS FIRST EVERY ME WHERE|PEER...
    (by startup.py)

While TensorFlow waits for the cluster to form, the worker's main thread is
blocked in C++ holding the GIL (TF 2.21 measured: no Python thread runs and
SIGTERM is ignored), so the bound is kept, and the wait reported, by this
separate process. The worker writes `done` to its stdin once joined; EOF
(the worker exited) ends it too. Until then it prints, FIRST seconds after
it started and every EVERY seconds after, which peers' ports do not answer
yet and how long the worker will still wait; after SECONDS it prints which
peers accept connections and SIGKILLs the worker. Run by path; it imports
only `tfmulti.startup` (standard library only): no TensorFlow.
"""

import os
import select
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from tfmulti import startup  # noqa: E402  (this package, run by path)


def _accepts(address, timeout=1.0):
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _silent_and_listening(peers):
    silent = [f"{where} {a!r}" for where, a in peers if not _accepts(a)]
    listening = [f"{where} {a!r}" for where, a in peers
                 if f"{where} {a!r}" not in silent]
    return silent, listening


def _say(message):
    print(f"tfmulti: {message}", file=sys.stderr, flush=True)


def _waiting_line(me, peers, began, seconds):
    silent, listening = _silent_and_listening(peers)
    what = (f"no answer yet from {', '.join(silent)}" if silent else
            f"every peer's port answers ({', '.join(listening)}), waiting "
            "for them to join")
    return (f"this worker ({me}) is waiting for the cluster to form: {what}; "
            f"{startup.until(began, seconds)}.")


def main(argv):
    pid, seconds, first, every = int(argv[1]), *map(float, argv[2:5])
    me = argv[5]
    peers = [p.split("|", 1) for p in argv[6:]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    began = time.monotonic()
    deadline, report_at = began + seconds, began + first
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        ready, _, _ = select.select([sys.stdin], [], [],
                                    min(deadline, report_at) - now)
        if ready:
            return 0  # `done`, or EOF: the worker joined or is gone
        if time.monotonic() >= report_at and time.monotonic() < deadline:
            report_at += every
            _say(_waiting_line(me, peers, began, seconds))
    silent, listening = _silent_and_listening(peers)
    detail = (f"no answer from {', '.join(silent)}" if silent else
              "every peer's port answers, so one of them is not a "
              f"TensorFlow worker of this job or failed: {', '.join(listening)}")
    _say(f"this worker ({me}) waited {seconds:g} s for the cluster to form "
         f"and gave up: {detail}. Check that every worker started (and its "
         "log for its own error), that the addresses in TF_CONFIG are right "
         "and reachable, and that every worker runs the same job. The bound "
         f"is {startup.BOUND_NAMES}; the worker is killed (SIGKILL: "
         "TensorFlow ignores SIGTERM while it waits).")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
