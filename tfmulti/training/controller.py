"""The outer training loop: run N steps, then the actions that are due.

In the manner of Orbit's `Controller` and CLU's `PeriodicAction`: the
controller only decides how many steps the next inner loop runs and which
actions run after it; checkpointing, evaluation, summaries, preemption and
user code are `Action`s with a `Schedule`, each testable alone.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence


def _check_positive(name, value, kind):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kind) or not (
            value > 0) or (kind is not int and not math.isfinite(value)):
        raise ValueError(f"`{name}` should be a positive {kind.__name__} or "
                         f"None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When an action runs.

    Attributes:
      every_steps: each time the step count crosses a multiple of it.
      every_seconds: when this many seconds passed since it last ran (or
        since training began).
      every_loop: after every inner loop.
      at_end: after the last loop too.
      exact: the inner loop stops exactly at each multiple of
        `every_steps` (evaluation wants the weights of that step).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    every_loop: bool = False
    at_end: bool = True
    exact: bool = False

    def __post_init__(self):
        _check_positive("every_steps", self.every_steps, int)
        _check_positive("every_seconds", self.every_seconds, (int, float))
        if self.exact and self.every_steps is None:
            raise ValueError("`exact` needs `every_steps`.")

    def steps_to_boundary(self, step: int) -> int | None:
        """Steps until the next exact boundary, or None."""
        if not self.exact:
            return None
        return self.every_steps - step % self.every_steps

    def due(self, *, before: int, after: int, at_end: bool,
            seconds_since: float) -> bool:
        """Whether to run after a loop that took the step from `before` to
        `after` (`seconds_since` the action last ran)."""
        return bool(
            self.every_loop or (at_end and self.at_end) or (
                self.every_steps is not None and
                after // self.every_steps > before // self.every_steps) or (
                    self.every_seconds is not None and
                    seconds_since >= self.every_seconds))


@dataclasses.dataclass
class LoopResult:
    """What one inner loop did, as the actions see it.

    Attributes:
      step: the step count after the loop.
      steps: the step count training stops at.
      at_end: whether this is the last loop.
      losses: the loss of each step of the loop.
      logs: the loop's scalars ("loss", metrics, speed).
    """

    step: int
    steps: int
    at_end: bool
    losses: Sequence[float] = ()
    logs: dict = dataclasses.field(default_factory=dict)


class Action:
    """Something done between inner loops on a `Schedule`.

    Subclasses set `schedule` and implement `__call__(result)`; any callable
    with a `schedule` attribute works too.
    """

    schedule = Schedule(every_loop=True)

    def __call__(self, result: LoopResult) -> None:
        raise NotImplementedError


class PeriodicAction(Action):
    """Runs `fn(result)` on `schedule` (CLU's PeriodicCallback).

    Args:
      fn: called with the `LoopResult`.
      every_steps, every_seconds, at_end: see `Schedule`.
    """

    def __init__(self, fn: Callable[[LoopResult], None], *,
                 every_steps=None, every_seconds=None, at_end=True):
        self._fn = fn
        self.schedule = Schedule(every_steps=every_steps,
                                 every_seconds=every_seconds, at_end=at_end,
                                 every_loop=not (every_steps or
                                                 every_seconds))

    def __call__(self, result):
        self._fn(result)


class Controller:
    """Runs `train(step, n) -> LoopResult` and the due actions until done.

    Args:
      train: runs `n` steps from `step` and returns what they did.
      steps_per_loop: the most steps per inner loop.
      actions: run in this order after each loop when due.
      agree: `agree(flags) -> flags`, the element-wise OR of a list of
        bools over all workers; needed when a schedule depends on the
        clock, which differs between workers while saving is collective.
      clock: seconds, for the `every_seconds` schedules.
    """

    def __init__(self, train, *, steps_per_loop: int, actions=(),
                 agree=None, clock=time.monotonic):
        self._train = train
        self._steps_per_loop = steps_per_loop
        self.actions = list(actions)
        self._agree = agree
        self._clock = clock
        self._boundaries = [a.schedule for a in self.actions
                            if a.schedule.exact]
        self._timed = any(a.schedule.every_seconds for a in self.actions)

    def _loop_length(self, step, steps):
        n = min(self._steps_per_loop, steps - step)
        for schedule in self._boundaries:
            n = min(n, schedule.steps_to_boundary(step))
        return n

    def run(self, step: int, steps: int, *, stop=lambda: False) -> int:
        """Trains from `step` to `steps` (or until `stop()`); returns the
        step reached."""
        began = self._clock()
        last_ran = [began] * len(self.actions)
        while step < steps and not stop():
            n = self._loop_length(step, steps)
            result = self._train(step, n)
            before, step = step, step + n
            result.at_end = step >= steps or bool(stop())
            now = self._clock() if self._timed else began
            due = [a.schedule.due(before=before, after=step,
                                  at_end=result.at_end,
                                  seconds_since=now - t)
                   for a, t in zip(self.actions, last_ran)]
            if self._timed and self._agree is not None:
                due = self._agree(due)
            for index, (action, run) in enumerate(zip(self.actions, due)):
                if run:
                    action(result)
                    last_ran[index] = now
        return step
