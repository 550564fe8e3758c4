"""What tfmulti workers and the launcher share (no TensorFlow): exit codes
and the restart attempt.

A preempted worker that saved a checkpoint exits with `PREEMPTED` (75,
EX_TEMPFAIL: "try again"), so the launcher and the operator's logs can tell
it from a crash.

The launcher numbers each start of the worker group in `ATTEMPT_ENV` (0 for
the first, then 1, 2, ... after restarts) so a worker can tell a restart
from a first start.
"""

import os

PREEMPTED = 75
ATTEMPT_ENV = "TFMULTI_LAUNCH_ATTEMPT"


def launch_attempt(environ=None) -> int:
    """This worker group's start number under `tfmulti-launch`; 0 if not
    launched by it."""
    environ = os.environ if environ is None else environ
    return int(environ.get(ATTEMPT_ENV, "0") or 0)


def describe(code: int) -> str | None:
    """A tfmulti meaning of a worker's exit code, or None."""
    if code == PREEMPTED:
        return ("was preempted (SIGTERM) and exited after saving a "
                "checkpoint")
    return None
