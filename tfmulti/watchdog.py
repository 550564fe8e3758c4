"""Watchdog: a stuck peer fails a multi-worker job instead of hanging it.

A dead peer is caught by TensorFlow's coordination service (its heartbeat
fails every survivor's collectives within about 10 s). A peer that is alive
but stuck (a deadlock, a hung filesystem) is not: the other workers wait in
their next collective forever. TensorFlow's per-collective
`CommunicationOptions(timeout_seconds=...)` bounds that wait, but it
schedules one sleeping thread per collective that lives until the timeout
expires (`base_collective_executor.cc`: "TODO(xldrx): Share the timeout
watchdog thread among collectives"), so a 600 s timeout at hundreds of
collectives a second exhausts the machine's threads within minutes (measured
in BUILD_NOTES, issue 19).

Here one thread per process watches instead, at a cost that does not grow
with the number of collectives. tfmulti's loops of steps and evaluation
passes run `calling` the watchdog; when one has waited `timeout_seconds`,
the watchdog aborts this process's collectives, as MultiWorkerMirroredStrategy's
own health check does for an unreachable peer.
The pending call then fails with `DeadlineExceededError`, which
`tfmulti.peer_failure` turns into a `PeerFailureError` naming the bound.

Until this process has completed its first loop, the bound is at least
`FIRST_LOOP_SECONDS`: that loop also traces (and may compile) the step, on
every worker, and a short bound meant for steady state would fail a healthy
job whose slowest worker is still tracing.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import tensorflow as tf
from tensorflow.python.eager import context

_WATCHDOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

FIRST_LOOP_SECONDS = 600.0


class Watchdog:
    """Aborts this process's collectives when a call with collectives has
    waited `timeout_seconds`. One daemon thread, started on first use."""

    def __init__(self, timeout_seconds: float):
        self.timeout_seconds = float(timeout_seconds)
        self.fired = False
        self.warm = False
        self._cond = threading.Condition()
        self._calls = 0
        self._began = 0.0
        self._thread = None

    @property
    def bound_seconds(self) -> float:
        """The bound in force now."""
        return self.timeout_seconds if self.warm else max(
            self.timeout_seconds, FIRST_LOOP_SECONDS)

    @contextlib.contextmanager
    def calling(self):
        """Times the enclosed call (a loop of steps, an evaluation pass).

        Only a process blocked in such a call aborts: one stuck in its own
        host code (the stuck peer itself) leaves the verdict to the peers
        that wait for it, whose error then names the bound.
        """
        with self._cond:
            self._calls += 1
            self._began = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="tfmulti-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield self
        finally:
            with self._cond:
                self._calls -= 1
                self.warm = True

    def _watch(self):
        with self._cond:
            while True:
                if not self._calls or self.fired:
                    self._cond.wait()
                    continue
                bound = self.bound_seconds
                remaining = self._began + bound - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self.fired = True
                context.context().abort_collective_ops(
                    tf.errors.DEADLINE_EXCEEDED,
                    f"tfmulti watchdog: a call waited {bound:g} s "
                    "(`stall_timeout_seconds`); a peer is stuck or far "
                    "slower. Collectives aborted.")


def attach(strategy, timeout_seconds: float | None) -> None:
    """Gives `strategy` a watchdog with this bound (None: no watchdog)."""
    if timeout_seconds is None:
        _WATCHDOGS.pop(strategy, None)
    else:
        _WATCHDOGS[strategy] = Watchdog(timeout_seconds)


def of(strategy) -> Watchdog | None:
    """The watchdog `attach` gave `strategy`, else None."""
    try:
        return _WATCHDOGS.get(strategy)
    except TypeError:  # not weak-referenceable: never attached
        return None


@contextlib.contextmanager
def calling(strategy):
    """Times a call with collectives on `strategy`'s watchdog, if any."""
    dog = of(strategy)
    if dog is None:
        yield None
    else:
        with dog.calling():
            yield dog
