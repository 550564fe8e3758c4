"""The Runner protocol: what a way of training gives the Trainer.

The Trainer is a small controller (as Orbit's `Controller` over its
`StandardTrainer` runners): it checks its arguments, picks a runner,
restores the newest checkpoint, and runs the `controller.Controller` loop
after loop with the actions every way of training shares (summaries, the log
line, evaluation, checkpoints, the exit on preemption), the Keras callback
hooks, the history and the non-finite checks. A runner owns only what
differs: how its data becomes an iterator, one loop of updates, what its
checkpoint holds, what a restore must redo, and evaluation.

Three runners: `synchronous.SynchronousRunner` (`TrainStep` under any
synchronous strategy, the compiled loop, the reducer),
`async_trainer.AsyncRunner` (closures on a parameter-server job) and
`pipeline.runner.PipelinedRunner` (the synchronous runner with a pipeline's
step). A model that brings its own way of training (a
`tfmulti.pipeline.PipelinedModel`) is found through `register_model_runner`:
the Trainer sits below the packages that define such models (the layer order
in README's "Layout" section), so a package registers, at its import, a
predicate for its models and the factory of their part (which gives the
Trainer the model, optimizer and loss, and `trainer_runner(parts,
**options)`, the runner); a model of that kind cannot exist before its
package is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfmulti.training import step as step_lib


@dataclasses.dataclass
class Parts:
    """What the Trainer built and every runner trains with.

    Attributes:
      strategy, model, optimizer: the Trainer's (the optimizer wrapped for
        skipping and loss scaling, its own reduction replaced).
      loss: `loss(y_true, y_pred)` returning per-example losses.
      metrics: the resolved Keras metrics (created under the strategy).
      eval_loss: the `keras.metrics.Mean` of evaluation losses.
      options: the `step.GradientOptions`.
      on_nonfinite: "raise" or "skip" (as given to the Trainer).
      say: prints a line on the chief.
    """

    strategy: Any
    model: Any
    optimizer: Any
    loss: Callable
    metrics: list
    eval_loss: Any
    options: step_lib.GradientOptions
    on_nonfinite: str
    say: Callable[[str], None]

    def compute_loss_fn(self, global_batch_size):
        """`compute_loss(x, y, sample_weight, global_batch=None)` -> (loss
        share of this replica, predictions): per-example losses averaged
        with the global batch, regularisation scaled by 1/replicas."""
        def compute_loss(x, y, sample_weight, global_batch=None):
            y_pred = self.model(x, training=True)
            per_example = tf.convert_to_tensor(
                self.loss(y, float32(y_pred)))
            check_per_example(per_example)
            # A partial batch is averaged over the examples it holds, as
            # one device does (TrainStep passes its actual global size).
            loss = tf.nn.compute_average_loss(
                per_example, sample_weight=sample_weight,
                global_batch_size=global_batch_size if global_batch is None
                else tf.cast(global_batch, tf.int64))
            if self.model.losses:
                # Added on every replica, so scaled by 1/replicas once.
                loss += tf.nn.scale_regularization_loss(tf.add_n(
                    [tf.cast(l, loss.dtype) for l in self.model.losses]))
            return loss, y_pred
        return compute_loss

    def eval_step(self, batch, forward=None):
        """Adds one batch to the evaluation loss and metrics (`forward`:
        the model's output for `x`; default: the model in inference)."""
        x, y, sample_weight = step_lib.unpack_batch(batch)
        y_pred = self.model(x, training=False) if forward is None else (
            forward(x))
        per_example = tf.convert_to_tensor(self.loss(y, float32(y_pred)))
        check_per_example(per_example)
        self.eval_loss.update_state(per_example, sample_weight=sample_weight)
        for metric in self.metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)

    def reset_eval(self) -> None:
        for metric in (self.eval_loss, *self.metrics):
            metric.reset_state()

    def eval_results(self) -> dict:
        return {m.name: float(m.result())
                for m in (self.eval_loss, *self.metrics)}


def float32(y_pred):
    """Floating predictions in float32 (the loss of a mixed-precision model
    is computed in float32, as Keras does)."""
    return tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating and
        t.dtype != tf.float64 else t, y_pred)


def check_per_example(per_example):
    if per_example.shape.rank == 0:
        raise ValueError(
            "`loss` returned a scalar; the Trainer needs PER-EXAMPLE losses "
            "so it can average them with the global batch size across "
            "replicas. Pass a Keras loss with `reduction=None`, e.g. "
            "keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
            "reduction=None), or a function returning shape [batch].")


@dataclasses.dataclass
class LoopOutput:
    """One loop of `n` updates, as a runner reports it.

    Attributes:
      step: updates made in total after the loop.
      losses: each step's loss (numpy, length n).
      logs: the loop's values for the log line and callbacks besides the
        loss (metrics, balance shares).
      history: more per-loop values for the history (e.g. the
        asynchronous runner's retried closures).
      applied: optimizer updates applied in the loop (skipped ones not);
        None where the runner cannot tell.
      messages: lines to print after the loop.
    """

    step: int
    losses: np.ndarray
    logs: dict
    history: dict = dataclasses.field(default_factory=dict)
    applied: int | None = None
    messages: list = dataclasses.field(default_factory=list)


class Runner:
    """One way of training under the Trainer. The Trainer calls, per `fit`:
    `guard`, `begin`, then (with `model_dir`) builds a Checkpointer of
    `trackables()` (calling `before_save` before each save) and calls
    `restored` if one was restored; then
    `prepare`, then `run_loop` loop after loop inside `translating`, then
    `finish`. `evaluate` may be called at any time.

    Attributes:
      balancer: the `balancing.Balancer` of a balanced run, or None.
      collective: True when the workers run each loop together (their
        stopping decisions and restored positions are agreed by
        all-reduce); False when only the chief runs the loop.
      examples_per_step: examples one update uses (after `begin`).
      history_keys: extra history keys (`LoopOutput.history`).
      optional: trackables a checkpoint may lack (one written by Keras
        `fit` has no iterator).
      weight_check: a `numerics.WeightCheck` the loss checks may consult,
        or None.
    """

    collective = True
    balancer = None
    examples_per_step = None
    history_keys: tuple = ()
    optional: tuple = ()
    weight_check = None

    def guard(self):
        """A context around the whole `fit` (restore and loops)."""
        return contextlib.nullcontext()

    def begin(self, train_data, global_batch_size) -> int:
        """Takes `fit`'s data; returns the global batch size."""
        raise NotImplementedError

    def trackables(self) -> dict:
        """What a checkpoint of this runner holds, by name."""
        raise NotImplementedError

    def worker_state(self):
        """A `worker_state.WorkerState` saved beside checkpoints, or None."""
        return None

    def restored(self, position, *, batch: int, missing) -> None:
        """Called after a checkpoint at `position` was restored (`missing`:
        the optional trackables it did not hold)."""

    def before_save(self) -> None:
        """Called on every worker before each checkpoint save, to bring the
        trackables up to date."""

    def prepare(self, *, step: int, steps: int, batch: int,
                verbose: int) -> None:
        """Called before the first loop, after any restore."""

    def translating(self, *, steps: int, step: Callable[[], int]):
        """A context around the loops (e.g. data errors named)."""
        return contextlib.nullcontext()

    def run_loop(self, start: int, n: int) -> LoopOutput:
        """Makes updates start+1 .. start+n."""
        raise NotImplementedError

    def preemption(self, watcher):
        """The preemption watcher the exit action should consult."""
        return watcher

    def finish(self, *, step: int) -> None:
        """Called after the last loop of a `fit`."""

    def evaluate(self, eval_data) -> dict:
        """Loss and metrics over `eval_data`, each example counted once."""
        raise NotImplementedError


_MODEL_RUNNERS: list[tuple[Callable[[Any], bool], Callable[..., Any]]] = []


def register_model_runner(accepts: Callable[[Any], bool],
                          factory: Callable[..., Any]) -> None:
    """Registers `factory(model, **trainer_options)` for models `accepts`
    answers True for (once per pair; registering again is a no-op)."""
    if (accepts, factory) not in _MODEL_RUNNERS:
        _MODEL_RUNNERS.append((accepts, factory))


def model_runner(model, **trainer_options):
    """The runner part registered for `model`'s kind, built with the
    Trainer's options; None for a plain Keras model."""
    for accepts, factory in _MODEL_RUNNERS:
        if accepts(model):
            return factory(model, **trainer_options)
    return None
