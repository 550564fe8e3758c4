"""Turning TensorFlow's errors about a lost peer into one that says so.

MultiWorkerMirroredStrategy cannot continue when a worker dies: the
coordination service's heartbeat (or, for a stuck peer, tfmulti's watchdog or
a collective's `timeout_seconds`) makes every surviving worker's next or
pending collective fail, but with
`UnavailableError`, `DeadlineExceededError`, `AbortedError` or
`CancelledError` and text about RPCs and collective keys. `translated` turns
those into a `PeerFailureError` naming the worker that saw it, the likely
cause and what to do.
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import strategies, watchdog

_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError)


class PeerFailureError(RuntimeError):
    """A collective failed because another worker died or became unreachable.

    Attributes:
      worker: this worker's task index.
      num_workers: the number of workers in the job.
    """

    def __init__(self, message, *, worker, num_workers):
        super().__init__(message)
        self.worker = worker
        self.num_workers = num_workers


@contextlib.contextmanager
def translated(strategy):
    """Re-raises a lost-peer TensorFlow error as `PeerFailureError`.

    Only under a strategy spanning several workers; otherwise errors pass
    through unchanged.
    """
    cluster = cluster_lib.of_strategy(strategy)
    num_workers = cluster.num_workers
    try:
        yield
    except _PEER_ERRORS as e:
        if num_workers < 2:
            raise
        dog = watchdog.of(strategy)
        if dog is not None and dog.fired:
            cause = (
                "a loop of training steps waited `stall_timeout_"
                f"seconds`={dog.timeout_seconds:g} of create_strategy "
                f"({dog.fired_bound:g} s; the first run of each loop, "
                "evaluation pass or agreement, which also traces it, gets "
                f"at least {watchdog.FIRST_LOOP_SECONDS:g} s): "
                "another worker is stuck, far slower, or dead (raise it if "
                "one loop of steps, an evaluation pass or a save "
                "legitimately takes longer)")
        elif isinstance(e, tf.errors.DeadlineExceededError):
            timeout = strategies.communication_options(
                strategy).timeout_seconds
            cause = ("another worker did not join it within `timeout_"
                     f"seconds`={timeout} of create_strategy: it is stuck, "
                     "far slower, or dead (raise the timeout if the job "
                     "legitimately waits longer)")
        else:
            cause = ("another worker died, was preempted or became "
                     "unreachable")
        raise PeerFailureError(
            f"{cluster.task_type} {cluster.task_index} (of {num_workers} workers): a collective operation "
            f"failed with {type(e).__name__}, most likely because {cause}. "
            "A MultiWorkerMirrored "
            "job cannot continue without it: restart all workers (tfmulti-"
            "launch --max_restarts does) and training resumes from the last "
            "checkpoint in model_dir. Check the other workers' logs for the "
            f"first failure. TensorFlow said: {str(e).strip()[:500]}",
            worker=cluster.worker_rank, num_workers=num_workers) from e


def translating(method):
    """Decorates a method of an object with `.strategy` with `translated`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with translated(self.strategy):
            return method(self, *args, **kwargs)

    return wrapper
