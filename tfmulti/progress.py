"""Progress lines and the closing summary of a run, one format for both loops.

`ProgressLogger` is a Keras callback that works for `model.fit` and for
`tfmulti.Trainer.fit` alike (the Trainer calls batch hooks once per loop with
the global step as the batch index; `fit` calls them per execution with the
batch of the epoch), and prints on the chief only:

    step 150/468 (epoch 1/3) - loss 1.2345 - accuracy 0.5123 - 1830 examples/s - ETA 0:00:23
    eval at step 156 - loss 0.4525 - accuracy 0.8315

Keras's own progress bar is not used: it always redraws one line with
backspaces (Keras 3.15 treats every POSIX process as an interactive
terminal), which makes one unreadable line in a log file and in the
launcher's `[wI]`-prefixed output.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any, Mapping, TextIO

import keras

# At most one progress line this often, besides the last step of each epoch.
DEFAULT_INTERVAL_SECONDS = 5.0


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


def format_metrics(values: Mapping[str, Any]) -> str:
    """`- name value` pairs, e.g. `- loss 0.1234 - accuracy 0.9000`."""
    return " ".join(f"- {k} {float(v):.4f}" for k, v in values.items())


class ProgressLogger(keras.callbacks.Callback):
    """Prints progress lines (chief only) for `model.fit` or `Trainer.fit`.

    Args:
      total_steps: optimizer updates the run reaches.
      steps_per_epoch: updates per epoch (for `fit`'s epoch-relative batch
        indices and the epoch shown).
      examples_per_step: examples per update (global batch x accumulation).
      is_chief: whether this process prints.
      interval: minimum seconds between progress lines.
      stream: where to print; default stdout.
    """

    def __init__(self, *, total_steps: int, steps_per_epoch: int,
                 examples_per_step: int, is_chief: bool = True,
                 interval: float = DEFAULT_INTERVAL_SECONDS,
                 stream: TextIO | None = None):
        super().__init__()
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.examples_per_step = examples_per_step
        self.is_chief = is_chief
        self.interval = interval
        self._stream = stream
        self._epoch = None
        self._first = None   # (time, step) when this process began training
        self._last = None    # (time, step) of the last line printed
        self.step = 0

    def _print(self, line: str) -> None:
        if self.is_chief:
            print(line, file=self._stream or sys.stdout, flush=True)

    @property
    def first_step(self) -> int:
        """The step this process started training from (after a resume)."""
        return self._first[1] if self._first else self.step

    def _global_step(self, batch: int) -> int:
        # The Trainer never starts epochs and passes the global step.
        if self._epoch is None:
            return batch
        # fit: the batch of the epoch; its last execution reports a whole
        # `steps_per_execution` even when fewer steps were left.
        return self._epoch * self.steps_per_epoch + min(
            batch, self.steps_per_epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._first is None:
            now = time.perf_counter()
            self._first = self._last = (now, self._global_step(batch))

    def on_train_batch_end(self, batch, logs=None):
        self.step = step = self._global_step(batch + 1)
        now = time.perf_counter()
        epoch_end = step % self.steps_per_epoch == 0
        if (now - self._last[0] < self.interval and not epoch_end and
                step < self.total_steps):
            return
        rate = (step - self._last[1]) * self.examples_per_step / max(
            now - self._last[0], 1e-9)
        steps_per_sec = (step - self._first[1]) / max(now - self._first[0],
                                                      1e-9)
        eta = (self.total_steps - step) / max(steps_per_sec, 1e-9)
        epochs = -(-self.total_steps // self.steps_per_epoch)
        epoch = f" (epoch {(step - 1) // self.steps_per_epoch + 1}/{epochs})"
        self._print(f"step {step}/{self.total_steps}{epoch} "
                    f"{format_metrics(_train_logs(logs))} - {rate:.0f} "
                    f"examples/s - ETA {_duration(eta)}")
        self._last = (now, step)

    def on_test_end(self, logs=None):
        self._print(f"eval at step {self.step} "
                    f"{format_metrics(_train_logs(logs))}")


def _train_logs(logs) -> dict[str, float]:
    return {k: v for k, v in (logs or {}).items()
            if not k.startswith("val_") and not hasattr(v, "__len__")}


def summary(metrics: Mapping[str, Any], *, model_dir: str, wall_seconds: float,
            checkpoints: str) -> str:
    """The closing lines of a run: what it reached and where its outputs are.

    Args:
      metrics: what the run writes to metrics.json (`train`, `eval`,
        `steps`, `examples_per_sec`, `num_replicas`, `seconds`).
      model_dir: the run's directory.
      wall_seconds: time since the run started, set-up included.
      checkpoints: where the checkpoints are.
    """
    lines = [
        f"done: {metrics['steps']} steps on {metrics['num_replicas']} "
        f"replica(s) in {_duration(metrics['seconds'])} of training "
        f"({metrics['examples_per_sec']:.0f} examples/s), "
        f"{_duration(wall_seconds)} wall time",
        f"  train {format_metrics(metrics['train'])}",
        f"  eval  {format_metrics(metrics['eval'])}",
        f"  metrics:     {os.path.join(model_dir, 'metrics.json')}",
        f"  checkpoints: {checkpoints}",
        f"  TensorBoard: tensorboard --logdir {model_dir}",
    ]
    return "\n".join(lines)
