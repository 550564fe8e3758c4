"""Non-finite losses and weights: stop with the step, never checkpoint NaNs.

The Trainer's loop returns the loss of every step, summed over all replicas
and workers, so every worker sees the same values and stops at the same
point; checking them once per loop costs nothing inside the loop.
"""

from __future__ import annotations

import numpy as np


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite.

    Attributes:
      step: the (1-based) optimizer step whose loss was not finite.
    """

    def __init__(self, message, *, step):
        super().__init__(message)
        self.step = step


def check_losses(losses, *, first_step: int) -> None:
    """Raises `NonFiniteLossError` naming the first step with a bad loss.

    Args:
      losses: per-step losses of one loop.
      first_step: the step count before the loop (the loop's first step is
        `first_step + 1`).
    """
    bad = np.flatnonzero(~np.isfinite(np.asarray(losses, np.float64)))
    if bad.size:
        step = first_step + int(bad[0]) + 1
        raise NonFiniteLossError(
            f"The training loss is {float(losses[bad[0]])} at step {step} "
            f"({bad.size} of the {len(losses)} steps {first_step + 1}-"
            f"{first_step + len(losses)} are not finite); training stopped "
            "before saving a checkpoint of these weights, so model_dir still "
            "holds the last finite one. Usual fixes: a lower learning rate, "
            "`clip_global_norm`, loss scaling for float16, or check the "
            "input for NaN/inf.", step=step)


def nonfinite_variables(variables) -> list[str]:
    """Names of the floating-point variables holding NaN or inf."""
    bad = []
    for variable in variables:
        value = np.asarray(variable.numpy())
        if np.issubdtype(value.dtype, np.floating) and not np.all(
                np.isfinite(value)):
            bad.append(getattr(variable, "path", None) or variable.name)
    return bad
