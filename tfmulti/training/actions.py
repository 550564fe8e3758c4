"""The actions `Trainer.fit` schedules between inner loops.

Each is a small callable with a `controller.Schedule`, built from explicit
collaborators (a checkpointer, an evaluate function, a writer), so each is
tested alone; `Trainer.fit(actions=...)` takes user actions of the same
kind (`controller.PeriodicAction` wraps a plain function).
"""

from __future__ import annotations

import functools
import math

import keras

from tfmulti.training import preemption, summaries
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


def fit_actions(*, strategy, model_dir, optimizer, say, evaluate, callbacks,
                history,
                eval_every, actions, checkpointer, position, checkpoint_every,
                verbose, preemption_watcher) -> list[Action]:
    """The actions of `Trainer.fit`, in order: summaries, the log line,
    evaluation, the user's `actions`, the checkpoint and the exit on
    preemption (every runner gets the same ones).

    Args:
      strategy, model_dir: where summaries go (chief only).
      optimizer: its learning rate is summarised.
      say: prints a line on the chief.
      evaluate: `evaluate()` -> results, or None (no evaluation).
      callbacks: the Keras `CallbackList` whose test hooks wrap it.
      history: the fit's `history.History` (evaluations are added).
      eval_every, checkpoint_every: steps, or None (see `Trainer.fit`).
      actions: the user's actions.
      checkpointer: a `checkpoints.Checkpointer`, or None.
      position: `position(step, *, loss_finite=True)`.
      verbose: print the log lines.
      preemption_watcher: for `ExitOnPreemption`.
    """
    eval_schedule = Schedule(every_steps=eval_every,
                             exact=eval_every is not None)
    loop_actions = []
    writer = summaries.ScalarWriter(model_dir, strategy, "train")
    if writer.active:
        loop_actions.append(WriteSummaries(writer, extra=lambda: {
            "learning_rate": float(keras.ops.convert_to_numpy(
                optimizer.learning_rate))}))
    if verbose:
        loop_actions.append(Log(say))
    if evaluate is not None:
        def evaluate_with_hooks():
            callbacks.on_test_begin()
            results = evaluate()
            callbacks.on_test_end(results)
            return results

        loop_actions.append(Evaluate(evaluate_with_hooks,
                                     schedule=eval_schedule, sinks=[
            history.record_eval,
            summaries.ScalarWriter(model_dir, strategy, "eval").write,
            *([functools.partial(_log_eval, say)] if verbose else [])]))
    loop_actions.extend(actions)
    if checkpointer is not None:
        save_schedule = Schedule(every_steps=checkpoint_every) if (
            checkpoint_every is not None or evaluate is None) else (
                eval_schedule)
        loop_actions.append(SaveCheckpoint(checkpointer, position,
                                           schedule=save_schedule, say=say))
        loop_actions.append(ExitOnPreemption(preemption_watcher, checkpointer,
                                             position, say=say))
    return loop_actions


def _log_eval(say, step, results):
    say(f"eval at step {step} " + " ".join(
        f"- {k} {v:.4f}" for k, v in results.items()))
