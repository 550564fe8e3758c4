"""Watchdog: a stuck peer fails a multi-worker job instead of hanging it.

A dead peer is caught by TensorFlow's coordination service (its heartbeat
fails every survivor's collectives within 15 s: a worker is declared dead
after 10 s without a heartbeat). A peer that is alive
but stuck (a deadlock, a hung filesystem) is not: the other workers wait in
their next collective forever. TensorFlow's per-collective
`CommunicationOptions(timeout_seconds=...)` bounds that wait, but it
schedules one sleeping thread per collective that lives until the timeout
expires (`base_collective_executor.cc`: "TODO(xldrx): Share the timeout
watchdog thread among collectives"), so a 600 s timeout at hundreds of
collectives a second exhausts the machine's threads within minutes (measured
in BUILD_NOTES, issue 19).

Here one thread per process watches instead, at a cost that does not grow
with the number of compat. tfmulti's loops of steps and evaluation
passes run `calling` the watchdog; when one has waited `timeout_seconds`,
the watchdog aborts this process's collectives, as MultiWorkerMirroredStrategy's
own health check does for an unreachable peer.
The pending call then fails with `DeadlineExceededError`, which
`tfmulti.peer_failure` turns into a `PeerFailureError` naming the bound.

The first run of each timed function (a training loop, an evaluation pass,
the agreement at the start of `fit`) is bounded by at least
`FIRST_LOOP_SECONDS` instead: that run also traces (and may compile) the
function on every worker, which takes seconds to minutes depending on the
machine and the model, not on `steps_per_loop`, and the workers finish
tracing at different times. `stall_timeout_seconds` is the user's bound on
steady state (a loop, a pass or a save must fit within it); a bound that also
had to cover tracing would fail a healthy job on a slower or loaded machine
(the first loop after the start-of-fit agreement would get only that bound).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

from tfmulti import compat

_WATCHDOGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

FIRST_LOOP_SECONDS = 600.0


class Watchdog:
    """Aborts this process's collectives when a call with collectives has
    waited its bound: `timeout_seconds`, or at least `FIRST_LOOP_SECONDS` on
    the first run of each function. One daemon thread, started on first use.
    """

    def __init__(self, timeout_seconds: float):
        self.timeout_seconds = float(timeout_seconds)
        self.fired = False
        # The bound of the call that fired (None until one does).
        self.fired_bound = None
        self._cond = threading.Condition()
        # (start time, bound) of each call in progress, innermost last.
        self._calls = []
        self._ran_objects = weakref.WeakSet()
        self._ran_names = set()
        self._thread = None

    def _has_run(self, fn) -> bool:
        # WeakSet's `in` answers False (no TypeError) for a name.
        return fn in self._ran_names or fn in self._ran_objects

    def _mark_run(self, fn) -> None:
        try:
            self._ran_objects.add(fn)
        except TypeError:  # not weak-referenceable: a name
            self._ran_names.add(fn)

    def bound_seconds(self, fn=None) -> float:
        """The bound a call of `fn` gets now."""
        return self.timeout_seconds if self._has_run(fn) else max(
            self.timeout_seconds, FIRST_LOOP_SECONDS)

    @contextlib.contextmanager
    def calling(self, fn=None):
        """Times the enclosed call (a loop of steps, an evaluation pass).

        Only a process blocked in such a call aborts: one stuck in its own
        host code (the stuck peer itself) leaves the verdict to the peers
        that wait for it, whose error then names the bound.

        Args:
          fn: what the call runs (the `tf.function`, or a name for an eager
            collective): its first completed call ends its first-run bound.
        """
        with self._cond:
            entry = (time.monotonic(), self.bound_seconds(fn))
            self._calls.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="tfmulti-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield self
        finally:
            with self._cond:
                self._calls.remove(entry)
                self._mark_run(fn)
                self._cond.notify()

    def _watch(self):
        with self._cond:
            while True:
                if not self._calls or self.fired:
                    self._cond.wait()
                    continue
                began, bound = self._calls[-1]
                remaining = began + bound - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self.fired = True
                self.fired_bound = bound
                compat.abort_collectives(
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
def calling(strategy, fn=None):
    """Times a call with collectives on `strategy`'s watchdog, if any.

    Args:
      strategy: the strategy whose collectives the call runs.
      fn: what the call runs (see `Watchdog.calling`); None for one shared
        first run.
    """
    dog = of(strategy)
    if dog is None:
        yield None
    else:
        with dog.calling(fn):
            yield dog
