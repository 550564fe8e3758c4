"""What TensorFlow's `ClusterCoordinator` knows and does not publish: which
workers it holds failed (`WorkerWatch`) and how many closures it retried
(`RetryCounter`). Both read private state of TF 2.18-2.21's
`cluster_coordinator` through `tfmulti.compat`, and degrade to "unknown"
without it.
"""

from __future__ import annotations

import math
import time

from tfmulti import compat

# How often a join looks at the workers' state: small against a loop of
# steps (seconds), and a lock or two per look.
_JOIN_POLL_SECONDS = 0.05


class WorkerWatch:
    """Which workers the coordinator holds failed, waiting for them.

    TensorFlow exposes no such state; `tfmulti.compat` reads it from the
    coordinator's private one. Without it `available` is False and
    `Trainer.fit` joins unbounded, as TensorFlow does.
    """

    def __init__(self, coordinator):
        workers = compat.coordinator_workers(coordinator)
        self._workers = workers or []
        self.available = workers is not None

    def failed(self) -> list[int]:
        """Indices of the workers held failed now."""
        return [w.worker_index for w in self._workers
                if compat.worker_failed(w)]

    @property
    def size(self) -> int:
        return len(self._workers)


class RetryCounter:
    """Counts the closures the coordinator put back in its queue to run
    again after their worker failed.

    TensorFlow has no public count of these; `tfmulti.compat` counts what
    its private closure queue puts back. A retry whose first attempt never
    started on its worker reaches no parameter server, so the
    `ClosureLedger` alone would miss it. Without that queue the count is
    None.
    """

    def __init__(self, coordinator):
        self.count = 0
        self.available = compat.count_retries(coordinator, self._retried)

    def _retried(self):
        self.count += 1

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
