"""What TensorFlow's `ClusterCoordinator` knows and does not publish: which
workers it holds failed (`WorkerWatch`) and how many closures it retried
(`RetryCounter`). Both read private state of TF 2.18-2.21's
`cluster_coordinator`; each says so and degrades to "unknown" without it.
"""

from __future__ import annotations

import math
import time

# How often a join looks at the workers' state: small against a loop of
# steps (seconds), and a lock or two per look.
_JOIN_POLL_SECONDS = 0.05


class WorkerWatch:
    """Which workers the coordinator holds failed, waiting for them.

    TensorFlow exposes no such state; this reads each of the coordinator's
    private `Worker._is_dead_with_error` (TF 2.18-2.21,
    `cluster_coordinator.Worker`: set when a closure fails with a worker
    error, cleared when the worker is back). Without it `available` is
    False and `Trainer.fit` joins unbounded, as TensorFlow does.
    """

    def __init__(self, coordinator):
        self._workers = list(getattr(getattr(coordinator, "_cluster", None),
                                     "workers", None) or ())
        self.available = bool(self._workers) and all(
            hasattr(w, "_is_dead_with_error") for w in self._workers)

    def failed(self) -> list[int]:
        """Indices of the workers held failed now."""
        return [w.worker_index for w in self._workers
                if w._is_dead_with_error]

    @property
    def size(self) -> int:
        return len(self._workers)


class RetryCounter:
    """Counts the closures the coordinator put back in its queue to run
    again after their worker failed.

    TensorFlow has no public count of these; this wraps the `put_back` of
    the coordinator's private closure queue (TF 2.21,
    `cluster_coordinator._CoordinatedClosureQueue`). A retry whose first
    attempt never started on its worker reaches no parameter server, so the
    `ClosureLedger` alone would miss it. Without that private method the
    count is None.
    """

    def __init__(self, coordinator):
        self.count = 0
        queue = getattr(getattr(coordinator, "_cluster", None),
                        "closure_queue", None)
        put_back = getattr(queue, "put_back", None)
        self.available = callable(put_back)
        if self.available and not getattr(put_back, "_tfmulti_counted",
                                          False):
            def counted(closure):
                self.count += 1
                return put_back(closure)
            counted._tfmulti_counted = True
            queue.put_back = counted

    def value(self):
        return self.count if self.available else None


def join(coordinator, watch: WorkerWatch, stall_timeout, *, lost):
    """`coordinator.join()`, bounded when every worker is lost.

    TensorFlow retries a failed worker's closures on the others and, with
    none left, waits for one to return (up to an hour). With every worker
    held failed by `watch` for `stall_timeout` seconds this raises
    `lost(failed worker indices, seconds)` instead. Without a bound, or
    without `watch`, it joins unbounded, as TensorFlow does.
    """
    if stall_timeout is None or stall_timeout == math.inf or (
            not watch.available):
        coordinator.join()
        return
    all_failed_since = None
    # done() raises the closures' error, as join() does.
    while not coordinator.done():
        failed = watch.failed()
        now = time.monotonic()
        if len(failed) < watch.size:
            all_failed_since = None
        elif all_failed_since is None:
            all_failed_since = now
        elif now - all_failed_since >= stall_timeout:
            raise lost(failed, now - all_failed_since)
        time.sleep(_JOIN_POLL_SECONDS)
