"""How the global batch is shared among replicas of uneven speed.

In a synchronous step every replica waits for the slowest. Giving each
replica a slice of the global batch in proportion to its speed (LB-BSP,
SoCC 2020) lets all of them finish together; the global batch, and so the
update, stays the same (`tfmulti.data.balanced` cuts the slices,
`tfmulti.training.step.TrainStep` weights the loss by the real examples).

This module is the policy only, pure Python: parse the `balance` argument,
turn weights into integer example counts, and move the counts towards the
measured speeds with bounded steps and hysteresis. Every worker computes the
same counts from the same (all-reduced) timings, so they agree without
talking.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

AUTO = "auto"


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def parse_balance(balance, *, num_replicas: int, num_workers: int = 1):
    """Checks the `balance` argument.

    Args:
      balance: None (an even split), `"auto"` (shares follow the measured
        speed) or a list of positive weights, one per replica, or one per
        worker (each worker's weight then split evenly over its replicas).
      num_replicas: replicas in sync.
      num_workers: workers; their replicas are numbered worker by worker.

    Returns:
      None, `"auto"`, or a list of `num_replicas` float weights.

    Raises:
      ValueError: anything else, naming the argument and the fix.
    """
    if balance is None or balance == AUTO:
        return balance
    if isinstance(balance, str) or not isinstance(balance, (list, tuple)):
        raise ValueError(
            f"`balance` should be None, 'auto' or a list of positive "
            f"weights (one per replica, or one per worker), got {balance!r}."
            " E.g. balance=[3, 1] gives the first of 2 replicas 3/4 of the "
            "global batch.")
    if not all(_is_number(w) and w > 0 for w in balance):
        raise ValueError(
            f"`balance` should hold positive finite numbers, got {balance!r}."
            " A replica with weight 0 would get no examples; drop it from "
            "the job instead.")
    if len(balance) == num_replicas:
        return [float(w) for w in balance]
    if num_workers > 1 and len(balance) == num_workers and (
            num_replicas % num_workers == 0):
        per = num_replicas // num_workers
        return [float(w) / per for w in balance for _ in range(per)]
    raise ValueError(
        f"`balance` has {len(balance)} weight(s) ({balance!r}) but the job "
        f"has {num_replicas} replica(s) on {num_workers} worker(s). Give one "
        f"weight per replica ({num_replicas})"
        + (f" or one per worker ({num_workers})" if num_workers > 1 else "")
        + ".")


def counts_from_weights(weights: Sequence[float],
                        global_batch_size: int) -> list[int]:
    """Integer example counts proportional to `weights`, summing to
    `global_batch_size`, each at least 1 (largest remainder; ties go to the
    lower replica id, so every worker computes the same counts).

    Raises:
      ValueError: fewer examples than replicas.
    """
    n = len(weights)
    if global_batch_size < n:
        raise ValueError(
            f"`global_batch_size`={global_batch_size} cannot give each of "
            f"the {n} replicas at least one example. Use a global batch of "
            f"at least {n}.")
    total = float(sum(weights))
    exact = [global_batch_size * w / total for w in weights]
    counts = [int(math.floor(e)) for e in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:global_batch_size - sum(counts)]:
        counts[i] += 1
    # No replica is left with an empty slice: an empty replica is never
    # measured again. The example comes from the largest count.
    for i in range(n):
        if counts[i] == 0:
            counts[max(range(n), key=lambda j: (counts[j], -j))] -= 1
            counts[i] = 1
    return counts


def idle_fraction(seconds: Sequence[float]) -> float:
    """The barrier idle fraction of one step, 1 - mean/max of the replicas'
    compute seconds: the share of the replicas' time spent waiting."""
    longest = max(seconds)
    if longest <= 0:
        return 0.0
    return 1.0 - (sum(seconds) / len(seconds)) / longest


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """How `SharePolicy` moves the shares.

    Attributes:
      max_change: the largest change of one replica's share per update, as
        a fraction of the global batch (bounded steps: one noisy loop
        cannot swing the split).
      hysteresis: no change unless the target split's step would be
        shorter than the current split's by more than this fraction (noise
        does not thrash the split). Judged by time, not by examples: a gap
        of 1.4% of the global batch on a replica holding a fifth of it is
        a 6% longer step (measured: the bench's slowed worker, stop 43).
      smoothing: weight of the newest measurement in the exponential
        moving average of each replica's time per example (1: no memory).
      min_share: the smallest share a replica keeps, as a fraction of an
        even share (a replica that gets nothing is never measured again).
    """

    max_change: float = 0.1
    hysteresis: float = 0.02
    smoothing: float = 0.5
    min_share: float = 0.1

    def __post_init__(self):
        for name in ("max_change", "hysteresis", "smoothing", "min_share"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value <= 1 or (
                    name in ("max_change", "smoothing") and value == 0):
                raise ValueError(
                    f"`{name}` should be a number in "
                    f"{'(0, 1]' if name in ('max_change', 'smoothing') else '[0, 1]'}"
                    f", got {value!r}.")


class SharePolicy:
    """Per-replica example counts that follow the measured speeds.

    Args:
      num_replicas: replicas in sync.
      global_batch_size: examples per step over all replicas (unchanged by
        the policy).
      initial: starting weights (None: even).
      options: `PolicyOptions`.
    """

    def __init__(self, num_replicas: int, global_batch_size: int, *,
                 initial: Sequence[float] | None = None,
                 options: PolicyOptions = PolicyOptions()):
        self.global_batch_size = global_batch_size
        self.options = options
        self.counts = counts_from_weights(
            initial or [1.0] * num_replicas, global_batch_size)
        self._per_example = None

    def update(self, seconds: Sequence[float],
               examples: Sequence[float]) -> bool:
        """Takes one loop's compute seconds and examples per replica (the
        same all-reduced values on every worker); moves `counts` towards
        shares proportional to speed. Returns whether `counts` changed."""
        if any(e <= 0 for e in examples) or any(s <= 0 for s in seconds):
            return False
        per_example = [s / e for s, e in zip(seconds, examples)]
        a = self.options.smoothing
        self._per_example = per_example if self._per_example is None else [
            a * new + (1 - a) * old
            for new, old in zip(per_example, self._per_example)]
        n, batch = len(self.counts), self.global_batch_size
        speed = [1.0 / t for t in self._per_example]
        target = [batch * v / sum(speed) for v in speed]
        floor = self.options.min_share * batch / n
        target = [max(t, floor) for t in target]
        target = [batch * t / sum(target) for t in target]
        # A synchronous step lasts as long as its slowest replica.
        now = max(c * t for c, t in zip(self.counts, self._per_example))
        best = max(c * t for c, t in zip(target, self._per_example))
        if best >= now * (1 - self.options.hysteresis):
            return False
        gap = [t - c for t, c in zip(target, self.counts)]
        step = self.options.max_change * batch
        moved = [c + max(-step, min(step, g))
                 for c, g in zip(self.counts, gap)]
        counts = counts_from_weights(moved, batch)
        changed = counts != self.counts
        self.counts = counts
        return changed


def from_flag(text: str | None):
    """`--balance` to `balance`: "none" or "" -> None, "auto", or
    comma-separated weights ("3,1") -> a list of floats.

    Raises:
      ValueError: anything else, naming the flag.
    """
    if text is None or text in ("", "none"):
        return None
    if text == AUTO:
        return AUTO
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if not weights or not all(_is_number(w) and w > 0 for w in weights):
        raise ValueError(
            f"`--balance` should be 'none', 'auto' or comma-separated "
            f"positive weights (one per replica or per worker, e.g. 3,1), "
            f"got {text!r}.")
    return weights
