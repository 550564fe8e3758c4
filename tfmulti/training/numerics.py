"""Non-finite losses and weights: stop with the step, never checkpoint NaNs.

The Trainer's loop returns the loss of every step, summed over all replicas
and workers, so every worker sees the same values and stops at the same
point; checking them once per loop costs nothing inside the loop.
"""

from __future__ import annotations

import keras
import numpy as np

ON_NONFINITE = ("raise", "skip")
# No growth back after a skip: the scale only ever halves (exactly).
_NEVER = 2**30


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite.

    Attributes:
      step: the (1-based) optimizer step whose loss was not finite.
    """

    def __init__(self, message, *, step):
        super().__init__(message)
        self.step = step


def check_on_nonfinite(on_nonfinite: str) -> str:
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"`on_nonfinite` is {on_nonfinite!r}; use 'raise' "
                         "(stop with the step) or 'skip' (skip that update "
                         "on every replica and go on).")
    return on_nonfinite


def skipping_optimizer(optimizer, on_nonfinite: str):
    """`optimizer`, wrapped so that with "skip" a non-finite update is skipped.

    Keras's LossScaleOptimizer checks the gradients AFTER the cross-replica
    reduction (so every replica decides alike) and skips the whole update
    when any is NaN or inf. With scale 1 and no growth, the scale only ever
    halves after a skip, and multiplying by a power of two is exact in
    floating point: the updates of finite steps equal the plain optimizer's.
    Call under the strategy's scope.
    """
    if check_on_nonfinite(on_nonfinite) == "raise" or isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return keras.optimizers.LossScaleOptimizer(
        optimizer, initial_scale=1.0, dynamic_growth_steps=_NEVER)


def mode_for(optimizer, on_nonfinite: str) -> str:
    """"skip" whenever `optimizer` is a LossScaleOptimizer: it already skips
    non-finite updates on every replica (float16 overflows are routine and
    lower its scale), so raising would break dynamic loss scaling."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return "skip"
    return on_nonfinite


def check_losses(losses, *, first_step: int, on_nonfinite: str = "raise",
                 where=None, fix="`clip_global_norm`") -> list[int]:
    """Raises `NonFiniteLossError` naming the first step with a bad loss.

    Args:
      losses: per-step losses of one loop.
      first_step: the step count before the loop (the loop's first step is
        `first_step + 1`).
      on_nonfinite: "raise", or "skip" (the optimizer skipped those updates;
        nothing is raised).
      where: `where(step)` names a step in the message (default "step N
        (k of the n steps a-b are not finite)").
      fix: the clipping option to suggest.

    Returns:
      The steps whose loss was not finite (skipped with "skip").
    """
    bad = np.flatnonzero(~np.isfinite(np.asarray(losses, np.float64)))
    if bad.size and on_nonfinite == "skip":
        return [first_step + int(i) + 1 for i in bad]
    if bad.size:
        step = first_step + int(bad[0]) + 1
        place = where(step) if where else (
            f"step {step} ({bad.size} of the {len(losses)} steps "
            f"{first_step + 1}-{first_step + len(losses)} are not finite)")
        raise NonFiniteLossError(
            f"The training loss is {float(losses[bad[0]])} at {place}; "
            "training stopped before saving a checkpoint of these weights, "
            "so model_dir still holds the last finite one. Usual fixes: a "
            f"lower learning rate, {fix}, loss scaling for float16, or "
            "check the input for NaN/inf; or Trainer(on_nonfinite='skip') "
            "to skip such updates.", step=step)
    return []


def nonfinite_variables(variables) -> list[str]:
    """Names of the floating-point variables holding NaN or inf."""
    bad = []
    for variable in variables:
        value = np.asarray(variable.numpy())
        if np.issubdtype(value.dtype, np.floating) and not np.all(
                np.isfinite(value)):
            bad.append(getattr(variable, "path", None) or variable.name)
    return bad


# Consecutive skipped updates after which skipping is a failure, not loss
# scaling at work: dynamic loss scaling finds its scale within ~15 halvings
# from 2**15; more in a row means the loss or gradients overflow whatever the
# scale, and the job would end with exit 0 and untrained weights.
MAX_CONSECUTIVE_SKIPS = 25


def consecutive_skips(previous: int, losses) -> int:
    """Skipped updates in a row at the end of `losses`, continuing `previous`."""
    finite = np.isfinite(np.asarray(losses, np.float64))
    if finite.all():
        return 0
    if not finite.any():
        return previous + finite.size
    return int(finite.size - 1 - np.flatnonzero(finite)[-1])


def check_consecutive_skips(count: int, *, step: int, optimizer) -> None:
    """Raises `NonFiniteLossError` once `count` reaches the bound.

    The message names the loss scale reached, so the cause (an overflow the
    scale cannot absorb, or NaN input) is not blamed on the learning rate.
    """
    if count < MAX_CONSECUTIVE_SKIPS:
        return
    scale = getattr(optimizer, "dynamic_scale", None)
    scale_text = "" if scale is None else (
        f" with the loss scale down to {float(np.asarray(scale)):g}")
    raise NonFiniteLossError(
        f"The last {count} updates (up to step {step}) were all skipped "
        f"because the loss or its gradients were NaN or inf{scale_text}: "
        "training makes no progress and would end with untrained weights. "
        "This is not the learning rate (no update was applied): the forward "
        "or backward pass itself overflows (under mixed_float16, values "
        "beyond float16's 65504: keep that layer or the loss in float32), "
        "or the input holds NaN/inf.", step=step)
