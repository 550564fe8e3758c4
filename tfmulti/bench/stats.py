"""Paired ratios with 95% confidence intervals, and the verdict on a goal.

On a shared machine a rate alone says more about the neighbours than about
the code. Two variants timed back to back in the same round see about the
same load, so the bench judges their per-round ratio: the geometric mean of
the rounds' ratios, with a Student-t interval on the log ratios (rounds are
assumed independent; a ratio of times is scale-free, so the log is the
natural scale to average it on).
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student-t quantiles by degrees of freedom (1..30); above 30
# the normal quantile 1.96 is within 4%.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262,
        2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093,
        2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)


def t95(dof: int) -> float:
    """The two-sided 95% Student-t quantile for `dof` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"`dof` is {dof}; it should be at least 1.")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def geometric_mean(values) -> float:
    """The geometric mean of positive `values` (rates of one variant)."""
    return math.exp(statistics.fmean(math.log(v) for v in values))


def paired_ratio(numerators, denominators) -> dict:
    """The ratio numerator/denominator over paired rounds, with its interval.

    Args:
      numerators, denominators: per-round values (e.g. steps/s of two
        variants timed in the same round), positive, equally long.

    Returns:
      {"ratio": geometric mean of the per-round ratios, "low", "high": its
      95% interval (None with fewer than 2 rounds), "rounds"}.
    """
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"`numerators` and `denominators` should be equally long and not"
            f" empty; got {len(numerators)} and {len(denominators)} rounds.")
    logs = [math.log(a / b) for a, b in zip(numerators, denominators)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "low": None, "high": None,
                "rounds": len(logs)}
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half),
            "high": math.exp(mean + half), "rounds": len(logs)}


def relative_width(interval: dict) -> float:
    """high/low - 1 of an interval (inf without one): 0.05 is +-2.5%."""
    if interval.get("low") is None:
        return math.inf
    return interval["high"] / interval["low"] - 1


def verdict(interval: dict, goal: float) -> str:
    """"met" when the whole interval is at or above `goal`, "MISSED" when
    it is below, "not shown" when it straddles the goal (or has no
    interval: one round)."""
    if interval.get("low") is None:
        return "not shown"
    if interval["low"] >= goal:
        return "met"
    if interval["high"] < goal:
        return "MISSED"
    return "not shown"


def format_interval(interval: dict) -> str:
    """"0.97 [0.95, 0.99] (12 rounds)"."""
    if interval.get("low") is None:
        return f"{interval['ratio']:.3f} (no interval, {interval['rounds']} round)"
    return (f"{interval['ratio']:.3f} [{interval['low']:.3f}, "
            f"{interval['high']:.3f}] ({interval['rounds']} rounds)")
