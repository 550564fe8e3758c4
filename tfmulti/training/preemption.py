"""Preemption: on SIGTERM every worker saves one aligned checkpoint and exits.

A preempted worker gets SIGTERM and a grace period. Saving is collective
under MultiWorkerMirroredStrategy, so the workers must agree on the step at
which they all save: the SIGTERM handler only sets a flag, and at each loop
boundary the flags are summed across workers in one small all-reduce; if any
worker was signalled, all save a checkpoint of the same step and exit with
`tfmulti.exit_codes.PREEMPTED`. The relaunched job resumes from it.

TensorFlow's `PreemptionCheckpointHandler` does the same agreement through
the coordination service, but it saves with its own directory layout and
wants to wrap every step function call; the Trainer already saves at loop
boundaries with the chief rule, so one all-reduce per loop is enough.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import exit_codes
from tfmulti.training import loop


class PreemptionWatcher:
    """Notices SIGTERM and agrees across workers on when to stop.

    Args:
      strategy: the strategy the workers train under.
      signals: the signals that mean "preempted".
    """

    def __init__(self, strategy, *, signals=(signal.SIGTERM,)):
        self._strategy = strategy
        self._signals = tuple(signals)
        self.signalled = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        del signum, frame
        self.signalled = True

    def agreed(self) -> bool:
        """Whether any worker was signalled; the same answer on every worker.

        Runs one all-reduce under a multi-worker strategy, so every worker
        must call it at the same point of training.
        """
        local = tf.constant(1.0 if self.signalled else 0.0)
        if cluster_lib.of_strategy(self._strategy).num_workers < 2:
            return self.signalled
        return bool(loop.sum_over_replicas(self._strategy, local).numpy() > 0)


@contextlib.contextmanager
def watching(strategy, *, enabled=True):
    """A `PreemptionWatcher` installed for the block, or None if disabled."""
    if not enabled:
        yield None
        return
    with PreemptionWatcher(strategy) as watcher:
        yield watcher


def save_and_exit_if_preempted(watcher, checkpointer, position, *,
                               say=print):
    """At a step boundary: if any worker was preempted, save and exit.

    Args:
      watcher: a `PreemptionWatcher` or None (then nothing happens).
      checkpointer: the `checkpoints.Checkpointer` every worker saves with.
      position: the `checkpoints.Position` (or step) every worker reached.
      say: prints a line (the chief's).
    """
    if watcher is None or not watcher.agreed():
        return
    step = getattr(position, "step", position)
    if checkpointer.last_saved_step != step:
        checkpointer.save(position)
    watcher.__exit__(None, None, None)
    exit_preempted(say=say, what=f"saved the checkpoint of step {step}")


def exit_preempted(*, say=print, what="the last checkpoint is current"):
    """Exits with `exit_codes.PREEMPTED`, saying so."""
    say(f"preempted: {what}; exiting with code {exit_codes.PREEMPTED} so "
        "the job is restarted and resumes there")
    sys.exit(exit_codes.PREEMPTED)


def watching_preemption(fit):
    """Decorates a trainer's `fit`: a watcher in `self._preemption` while it
    runs, when the trainer has a `model_dir` to save into."""

    @functools.wraps(fit)
    def wrapper(self, *args, **kwargs):
        with watching(self.strategy,
                      enabled=bool(self.model_dir)) as watcher:
            self._preemption = watcher
            try:
                return fit(self, *args, **kwargs)
            finally:
                self._preemption = None

    return wrapper
