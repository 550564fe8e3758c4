"""Progress lines and the closing summary of a run, one format for both loops.

`ProgressLogger` is a Keras callback that works for `model.fit` and for
`tfmulti.Trainer.fit` alike (the Trainer calls batch hooks once per loop with
the global step as the batch index; `fit` calls them per execution with the
batch of the epoch), and prints on the chief only:

    step 150/468 (epoch 1/3) - loss 1.2345 - accuracy 0.5123 - 1830 examples/s - ETA 0:00:23
    eval at step 156 - loss 0.4525 - accuracy 0.8315

With `balance`, each line also shows every replica's share of the global
batch, its compute milliseconds per step and the barrier idle fraction:

    ... - 1830 examples/s - shares 0.75/0.25 - replica ms/step 61.2/60.8 - idle 0.01 - ETA 0:00:23

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
        # The last train and evaluation logs, for a summary of a run that
        # stops before its end.
        self.train_logs: dict[str, float] = {}
        self.eval_logs: dict[str, float] = {}
        self.eval_step: int | None = None

    def _print(self, line: str) -> None:
        if self.is_chief:
            print(line, file=self._stream or sys.stdout, flush=True)

    @property
    def first_step(self) -> int:
        """The step this process started training from (after a resume)."""
        return self._first[1] if self._first else self.step

    @property
    def training_seconds(self) -> float:
        """Seconds since this process's first training step began."""
        return time.perf_counter() - self._first[0] if self._first else 0.0

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
        self.train_logs = _train_logs(logs)
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
                    f"{format_metrics(self.train_logs)} - {rate:.0f} "
                    f"examples/s{balance_text(logs)} - ETA {_duration(eta)}")
        self._last = (now, step)

    def on_test_end(self, logs=None):
        self.eval_logs, self.eval_step = _train_logs(logs), self.step
        self._print(f"eval at step {self.step} "
                    f"{format_metrics(self.eval_logs)}")


# The per-loop logs of load balancing (`tfmulti.training.balancing`):
# grouped on one line by `balance_text`, not one column per replica.
_BALANCE_PREFIXES = ("share_", "replica_seconds_")
_IDLE = "idle_fraction"


def _train_logs(logs) -> dict[str, float]:
    return {k: v for k, v in (logs or {}).items()
            if not k.startswith(("val_", *_BALANCE_PREFIXES))
            and k != _IDLE and not hasattr(v, "__len__")}


def _per_replica(logs, prefix) -> list[float]:
    found = {int(k[len(prefix):]): float(v) for k, v in logs.items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    return [found[r] for r in sorted(found)]


def balance_text(logs) -> str:
    """" - shares 0.75/0.25 - replica ms/step 61.2/60.8 - idle 0.01" from a
    balanced loop's logs; "" without them."""
    logs = logs or {}
    shares = _per_replica(logs, "share_")
    if not shares:
        return ""
    text = " - shares " + "/".join(f"{s:.2f}" for s in shares)
    seconds = _per_replica(logs, "replica_seconds_")
    if seconds:
        text += " - replica ms/step " + "/".join(f"{1e3 * s:.1f}"
                                                 for s in seconds)
    if _IDLE in logs:
        text += f" - idle {float(logs[_IDLE]):.2f}"
    return text


def device_line(*, replicas: int, device_type: str, workers: int = 1,
                gpus_found: int = 0, parameter_servers: int = 0) -> str:
    """What the run trains on, e.g. `2 CPU replicas, no GPU found` or `16
    GPU replicas on 2 workers` (it replaces TensorFlow's own note about
    missing CUDA drivers, kept off the output by `tfmulti.quiet_logging`).

    Args:
      replicas: replicas in sync.
      device_type: "CPU" or "GPU", what the replicas run on.
      workers: processes that train.
      gpus_found: GPUs this process sees.
      parameter_servers: in a parameter-server run (asynchronous), how many.
    """
    def count(n, what):
        return f"{n} {what}{'s' * (n != 1)}"

    if parameter_servers:
        line = (f"{count(workers, 'worker')} and "
                f"{count(parameter_servers, 'parameter server')} "
                "(asynchronous)")
    else:
        line = count(replicas, f"{device_type} replica")
        if workers > 1:
            line += f" on {workers} workers"
    return line + ("" if gpus_found else ", no GPU found")


def summary(metrics: Mapping[str, Any], *, model_dir: str, wall_seconds: float,
            checkpoints: str) -> str:
    """The closing lines of a run: what it reached and where its outputs are.

    Args:
      metrics: what the run writes to metrics.json (`train`, `eval`,
        `steps`, `examples_per_sec`, `num_replicas`, `seconds`, and for a
        continued run `resumed_at`, the step it restored).
      model_dir: the run's directory.
      wall_seconds: time since the run started, set-up included.
      checkpoints: where the checkpoints are.
    """
    steps, resumed = metrics["steps"], metrics.get("resumed_at")
    head = f"done: {steps} steps"
    if resumed is not None and resumed >= steps:
        head += f" (resumed at step {resumed}: nothing left to train)"
    elif resumed:
        head += f" (resumed at step {resumed})"
    head += (f" on {metrics['num_replicas']} replica(s) in "
             f"{_duration(metrics['seconds'])} of training "
             f"({metrics['examples_per_sec']:.0f} examples/s), "
             f"{_duration(wall_seconds)} wall time")
    return _lines(head, train=metrics["train"], evaluation=metrics["eval"],
                  metrics_file=os.path.join(model_dir, "metrics.json"),
                  model_dir=model_dir, checkpoints=checkpoints)


def stopped_summary(logger: ProgressLogger, *, reason: str,
                    num_replicas: int, model_dir: str, wall_seconds: float,
                    checkpoints: str) -> str:
    """The closing lines of a run that stopped before its end (preempted,
    interrupted, an error): where it stopped, its last metrics, its outputs.

    Args:
      logger: the run's `ProgressLogger` (its last step and logs).
      reason: why it stopped, e.g. "preempted: ...".
      num_replicas: replicas in sync.
      model_dir: the run's directory.
      wall_seconds: time since the run started, set-up included.
      checkpoints: where the checkpoints are.
    """
    trained = logger.step - logger.first_step
    rate = trained * logger.examples_per_step / max(
        logger.training_seconds, 1e-9)
    head = (f"stopped at step {logger.step} of {logger.total_steps} "
            f"({reason}) on {num_replicas} replica(s) after "
            f"{_duration(logger.training_seconds)} of training "
            f"({rate:.0f} examples/s), {_duration(wall_seconds)} wall time")
    evaluation = dict(logger.eval_logs)
    return _lines(head, train=logger.train_logs, evaluation=evaluation,
                  eval_step=logger.eval_step if evaluation else None,
                  metrics_file=None, model_dir=model_dir,
                  checkpoints=checkpoints)


def _lines(head, *, train, evaluation, metrics_file, model_dir, checkpoints,
           eval_step=None) -> str:
    """The summary's rows; a row with nothing to show says why."""
    lines = [
        head,
        f"  train {format_metrics(train) or '(no step trained in this run)'}",
        f"  eval  {format_metrics(evaluation) or '(not run)'}"
        + (f" (at step {eval_step})" if eval_step is not None else ""),
        "  metrics:     " + (metrics_file or
                             "not written (the run did not end)"),
        f"  checkpoints: {checkpoints}",
        f"  TensorBoard: tensorboard --logdir {model_dir}",
    ]
    return "\n".join(lines)
