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
with the number of collectives. While a training call is under way
(`armed`), every completed loop of steps is a `beat`; when nothing has beaten
for `timeout_seconds`, the watchdog aborts this process's collectives, as
MultiWorkerMirroredStrategy's own health check does for an unreachable peer.
The pending call then fails with `DeadlineExceededError`, which
`tfmulti.peer_failure` turns into a `PeerFailureError` naming the bound.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import tensorflow as tf
from tensorflow.python.eager import context

_WATCHDOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Watchdog:
    """Aborts this process's collectives after `timeout_seconds` without a
    beat while armed. One daemon thread, started on first use."""

    def __init__(self, timeout_seconds: float):
        self.timeout_seconds = float(timeout_seconds)
        self.fired = False
        self._cond = threading.Condition()
        self._armed = 0
        self._last_beat = time.monotonic()
        self._thread = None

    @contextlib.contextmanager
    def armed(self):
        """Watches the enclosed training call (re-entrant)."""
        with self._cond:
            self._armed += 1
            self._last_beat = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="tfmulti-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield self
        finally:
            with self._cond:
                self._armed -= 1
                self._cond.notify()

    def beat(self) -> None:
        """Records progress: the stall clock starts again."""
        # A plain store: the watcher reads it under its lock, and a beat a
        # few microseconds stale changes nothing at this time scale.
        self._last_beat = time.monotonic()

    def _watch(self):
        with self._cond:
            while True:
                if not self._armed or self.fired:
                    self._cond.wait()
                    continue
                remaining = (self._last_beat + self.timeout_seconds -
                             time.monotonic())
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self.fired = True
                context.context().abort_collective_ops(
                    tf.errors.DEADLINE_EXCEEDED,
                    f"tfmulti watchdog: no training progress for "
                    f"{self.timeout_seconds:g} s (`stall_timeout_seconds`); "
                    "a peer is stuck or far slower. Collectives aborted.")


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
def armed(strategy):
    """Arms `strategy`'s watchdog, if it has one, around a training call."""
    dog = of(strategy)
    if dog is None:
        yield None
    else:
        with dog.armed():
            yield dog


def beat(strategy) -> None:
    """Records progress on `strategy`'s watchdog, if it has one."""
    dog = of(strategy)
    if dog is not None:
        dog.beat()
