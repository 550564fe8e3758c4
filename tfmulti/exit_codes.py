"""Exit codes tfmulti workers use, shared with the launcher (no TensorFlow).

A preempted worker that saved a checkpoint exits with `PREEMPTED` (75,
EX_TEMPFAIL: "try again"), so the launcher and the operator's logs can tell
it from a crash.
"""

PREEMPTED = 75


def describe(code: int) -> str | None:
    """A tfmulti meaning of a worker's exit code, or None."""
    if code == PREEMPTED:
        return ("was preempted (SIGTERM) and exited after saving a "
                "checkpoint")
    return None
