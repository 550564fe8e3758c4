"""The actions `Trainer.fit` schedules between inner loops.

Each is a small callable with a `controller.Schedule`, built from explicit
collaborators (a checkpointer, an evaluate function, a writer), so each is
tested alone; `Trainer.fit(actions=...)` takes user actions of the same
kind (`controller.PeriodicAction` wraps a plain function).
"""

from __future__ import annotations

import math

from tfmulti.training import preemption
from tfmulti.training.controller import Action, LoopResult, Schedule


class _OrPending:
    """`schedule`, and also every loop while a deferred save is pending."""

    def __init__(self, schedule: Schedule):
        self._schedule = schedule
        self.pending = False

    def __getattr__(self, name):
        return getattr(self._schedule, name)

    def due(self, **kwargs) -> bool:
        return self.pending or self._schedule.due(**kwargs)


class SaveCheckpoint(Action):
    """Saves a checkpoint of the position `position(step, loss_finite)`.

    Never from a step whose loss was not finite (an update skipped under
    loss scaling, or with `on_nonfinite="skip"`): that save is put off to
    the end of the next loop whose last loss is finite.

    Args:
      checkpointer: a `checkpoints.Checkpointer` (every worker calls it).
      position: `position(step, *, loss_finite) -> checkpoints.Position`.
      schedule: when to save.
      say: prints the chief's line when a save is put off.
    """

    def __init__(self, checkpointer, position, *, schedule: Schedule,
                 say=print):
        self._checkpointer = checkpointer
        self._position = position
        self.schedule = _OrPending(schedule)
        self._say = say

    def __call__(self, result: LoopResult) -> None:
        if self._checkpointer.last_saved_step == result.step:
            return
        if len(result.losses) and not math.isfinite(
                float(result.losses[-1])):
            if not self.schedule.pending:
                self._say(
                    f"not saving a checkpoint at step {result.step}: its "
                    f"loss is {float(result.losses[-1])} (update skipped); "
                    "saving after the next loop that ends on a finite loss")
            self.schedule.pending = True
            return
        self.schedule.pending = False
        self._checkpointer.save(self._position(result.step,
                                               loss_finite=True))


class Evaluate(Action):
    """Runs `evaluate()` and hands `(step, results)` to each of `sinks`.

    Args:
      evaluate: returns a dict of scalars.
      schedule: when to evaluate (use `exact=True` for every N steps).
      sinks: `sink(step, results)` callables (history, writer, log line).
    """

    def __init__(self, evaluate, *, schedule: Schedule, sinks=()):
        self._evaluate = evaluate
        self._sinks = list(sinks)
        self.schedule = schedule

    def __call__(self, result: LoopResult) -> None:
        results = self._evaluate()
        for sink in self._sinks:
            sink(result.step, results)


class WriteSummaries(Action):
    """Writes the loop's scalars (and `extra()`'s) with a `ScalarWriter`."""

    schedule = Schedule(every_loop=True)

    def __init__(self, writer, *, extra=dict):
        self._writer = writer
        self._extra = extra

    def __call__(self, result: LoopResult) -> None:
        self._writer.write(result.step, {**result.logs, **self._extra()})


class Log(Action):
    """Prints one progress line per loop with `say`."""

    schedule = Schedule(every_loop=True)

    def __init__(self, say=print):
        self._say = say

    def __call__(self, result: LoopResult) -> None:
        speed = result.logs.get("steps_per_sec")
        self._say(f"step {result.step}/{result.steps} " + " ".join(
            f"- {k} {v:.4f}" for k, v in result.logs.items()
            if k not in ("steps_per_sec", "examples_per_sec")) + (
                f" - {speed:.1f} steps/s" if speed is not None else ""))


class ExitOnPreemption(Action):
    """If any worker got SIGTERM: all save the same step and exit.

    Args:
      watcher: a `preemption.PreemptionWatcher` (None: never).
      checkpointer: saves the position before exiting.
      position: `position(step) -> checkpoints.Position`.
      say: prints the chief's line.
    """

    schedule = Schedule(every_loop=True)

    def __init__(self, watcher, checkpointer, position, *, say=print):
        self._watcher = watcher
        self._checkpointer = checkpointer
        self._position = position
        self._say = say

    def __call__(self, result: LoopResult) -> None:
        preemption.save_and_exit_if_preempted(
            self._watcher, self._checkpointer, self._position(result.step),
            say=self._say)
