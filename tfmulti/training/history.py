"""The history `Trainer.fit` returns, recorded the same way for every
runner: per loop the step, the mean loss, each metric and speed; every
step's loss; per evaluation `val_step` and `val_<name>`."""

from __future__ import annotations

BASE_KEYS = ("step", "loss", "step_loss", "steps_per_sec",
             "examples_per_sec")


class History:
    """Args:
      keys: the runner's extra per-loop keys and the metrics' names.
    """

    def __init__(self, keys=()):
        self.values = {key: [] for key in (*BASE_KEYS, *keys)}

    @property
    def step_losses(self) -> list:
        return self.values["step_loss"]

    def record(self, out, logs: dict, *, n: int, elapsed: float,
               examples_per_step: int) -> dict:
        """Records one loop (`runner.LoopOutput` `out`, its `logs`);
        returns the logs with the loop's speed."""
        self.values["step"].append(out.step)
        self.values["step_loss"].extend(out.losses.tolist())
        logs_and_speed = {
            **logs, "steps_per_sec": n / elapsed,
            "examples_per_sec": n * examples_per_step / elapsed}
        for key, value in {**out.history, **logs_and_speed}.items():
            self.values.setdefault(key, []).append(value)
        return logs_and_speed

    def record_eval(self, step: int, results: dict) -> None:
        self.values.setdefault("val_step", []).append(step)
        for key, value in results.items():
            self.values.setdefault(f"val_{key}", []).append(value)
