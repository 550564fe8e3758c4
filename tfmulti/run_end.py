"""Where a run ends: its length in steps, the step a continued run has
reached (a run is continued, never shortened), the callback that stops Keras
`fit` there, and the one-line reason a run stopped early."""

from __future__ import annotations

import os

from tfmulti import rundir
from tfmulti.experiment_config import ConfigError, ExperimentConfig


def run_length(config: ExperimentConfig, *,
               examples_per_update: int) -> tuple[int, int]:
    """(steps per epoch, the global step training ends at)."""
    from tfmulti import data
    info = data.tfds_dataset_fn(config.dataset, "train",
                                data_dir=config.data_dir).builder.info
    steps_per_epoch = max(1, info.splits["train"].num_examples //
                          examples_per_update)
    return steps_per_epoch, config.steps or config.epochs * steps_per_epoch


def check_end(config: ExperimentConfig, run: rundir.RunDir, loop: str,
               total_steps: int) -> int | None:
    """The step a continued run has reached (None for a new run).

    Raises:
      ConfigError: the end asked for is before that step.
      tfmulti.rundir.NothingToTrain: it is that step.
    """
    if not run.resuming:
        return None
    from tfmulti.training import checkpoints
    # The newest checkpoint; a finished run's metrics.json, if an extension
    # of it was stopped before its first checkpoint.
    steps = [s for s in (run.finished_steps, checkpoints.latest_step(
        os.path.join(run.path, *(() if loop == "trainer" else (
            _backup_dir(),))))) if s is not None]
    reached = max(steps) if steps else None
    if reached is None or total_steps > reached or (
            total_steps == reached != run.finished_steps):
        # The last case: stopped after its last checkpoint, before writing
        # metrics.json for it; it evaluates and writes them.
        return reached
    flag = "steps" if config.steps else "epochs"
    asked = (f"`--steps`={config.steps}" if config.steps else
             f"`--epochs`={config.epochs} ({total_steps} steps)")
    if total_steps == reached:
        raise rundir.NothingToTrain(
            f"nothing to train: the run in {run.path!r} has reached step "
            f"{reached}, where {asked} ends; pass a larger --{flag} to train "
            "longer.")
    raise ConfigError(
        f"{asked} ends before step {reached}, which the run in "
        f"{run.path!r} has reached: a run is continued, never shortened. "
        f"Pass a --{flag} that ends after step {reached} to train longer, or "
        "start a new run without --resume.", flag=flag)


def _backup_dir() -> str:
    from tfmulti.keras import backup
    return backup.BACKUP_DIR


def stop_reason(error: BaseException) -> str:
    from tfmulti import exit_codes
    if isinstance(error, SystemExit) and (
            error.code == exit_codes.PREEMPTED):
        return ("preempted: the last checkpoint is current; --resume "
                "continues from it")
    if isinstance(error, KeyboardInterrupt):
        return "interrupted; --resume continues from the last checkpoint"
    text = str(error).strip().splitlines()
    return (f"{type(error).__name__}" + (f": {text[0][:200]}" if text else "")
            + "; traceback below")


def stop_at(total_steps: int):
    """A callback that stops Keras `fit` at `total_steps` updates, inside
    its last epoch (`fit` runs whole epochs; `--steps` need not be a
    multiple of one)."""
    import keras

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= total_steps:
                self.model.stop_training = True

    return StopAt()
