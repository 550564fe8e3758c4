"""Non-finite losses and weights: stop with the step, never checkpoint NaNs.

The Trainer's loop returns the loss of every step, summed over all replicas
and workers, so every worker sees the same values and stops at the same
point; checking them once per loop costs nothing inside the loop.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

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


def guarded_optimizer(optimizer, variables, *, strategy, mixed_precision,
                      on_nonfinite: str, build_scope=None):
    """`optimizer` as the runners apply it: skipping non-finite updates
    with `on_nonfinite="skip"`, with dynamic loss scaling under
    "mixed_float16", built for `variables` under `strategy` (inside
    `build_scope`, a context, if given: a sharded run builds the unsharded
    form on the host, `shard_placement.host_variables`)."""
    with strategy.scope(), build_scope or contextlib.nullcontext():
        optimizer = skipping_optimizer(optimizer, on_nonfinite)
        if (mixed_precision == "mixed_float16" and not isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer)):
            # Its finiteness check runs on the reduced gradients, so the
            # skip decision is the same on every replica.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        if not optimizer.built:
            optimizer.build(variables)
    return optimizer


def mode_for(optimizer, on_nonfinite: str) -> str:
    """"skip" whenever `optimizer` is a LossScaleOptimizer: it already skips
    non-finite updates on every replica (float16 overflows are routine and
    lower its scale), so raising would break dynamic loss scaling."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return "skip"
    return on_nonfinite


# Weights of a trained model stay far below this; an exponent bit flip of a
# float32 weight below 1 in magnitude lands between 2**64 and 2**128.
HUGE_WEIGHT = 1e15
# A finite loss this many times the smallest one before it: divergence.
_GROWTH = 10.0


class WeightCheck:
    """Each weight's non-finite and huge values, recorded before each loop.

    Evidence for the message when a loss goes bad: by then the update of
    the bad step has made every weight NaN, whatever the cause. `record`
    runs inside the train loop's `tf.function` before its first step
    (`loop.create_train_loop(before=...)`): one sum of magnitudes per
    weight, and the values are counted only when that total is NaN/inf or
    beyond `HUGE_WEIGHT` (a separate `tf.function` per loop cost 0.27 ms,
    10-25% of a 2 ms step at steps_per_loop=1; counting every loop in the
    graph about as much).
    """

    def __init__(self, variables):
        self._variables = [v for v in variables
                           if tf.as_dtype(v.dtype).is_floating]
        self._names = [getattr(v, "path", None) or v.name
                       for v in self._variables]
        self.step = None
        with tf.init_scope():
            # Per weight: values NaN/inf, values beyond HUGE_WEIGHT, largest
            # finite magnitude; zeros while the total is ordinary.
            self._stats = tf.Variable(
                tf.zeros([len(self._variables), 3], tf.float32),
                trainable=False, name="tfmulti_weight_check")
        self._count_now = tf.function(self._count)

    def _count(self):
        rows = []
        for v in self._variables:
            value = tf.cast(tf.convert_to_tensor(v), tf.float32)
            finite = tf.math.is_finite(value)
            size = tf.abs(tf.where(finite, value, tf.zeros_like(value)))
            rows.append(tf.stack([
                tf.reduce_sum(tf.cast(~finite, tf.float32)),
                tf.reduce_sum(tf.cast(size > HUGE_WEIGHT, tf.float32)),
                tf.reduce_max(size) if value.shape.num_elements() else
                tf.constant(0.0)]))
        return tf.stack(rows)

    def record(self) -> None:
        """Records the weights (inside the loop's tf.function)."""
        if not self._variables:
            return
        total = tf.add_n([tf.reduce_sum(tf.abs(tf.cast(
            tf.convert_to_tensor(v), tf.float32))) for v in self._variables])
        # No collective inside: a cond is safe here.
        self._stats.assign(tf.cond(
            tf.math.is_finite(total) & (total <= HUGE_WEIGHT),
            lambda: tf.zeros_like(self._stats), self._count))

    def take(self, step: int) -> None:
        """Marks the next recording as the weights before step `step` + 1."""
        self.step = step

    @staticmethod
    def _found(names, variables, stats):
        return [(name, int(bad), int(huge), int(np.prod(v.shape)), float(big))
                for name, v, (bad, huge, big) in zip(names, variables, stats)
                if bad or huge]

    def findings(self) -> list[tuple[str, int, int, int, float]]:
        """(name, non-finite values, huge values, size, largest finite
        magnitude) of each weight with non-finite or huge values at the
        start of the last loop."""
        return self._found(self._names, self._variables,
                           self._stats.numpy())

    def check_now(self, *, step: int) -> None:
        """Raises `NonFiniteLossError` if a weight holds NaN/inf now, after
        step `step`, although every loss was finite (call after the losses'
        check).

        Measured: a NaN input that a ReLU hides in the forward pass
        (relu(NaN) is 0) still reaches the gradient, and the update wrote
        NaN into the first layer's kernel while every loss stayed finite:
        exit 0, a broken model. The checkpoint layer refuses to save such
        weights; this names the cause, also without `model_dir`.
        """
        if not self._variables:
            return
        bad = [f for f in self._found(self._names, self._variables,
                                      self._count_now().numpy()) if f[1]]
        if not bad:
            return
        name, nonfinite, _, size, _ = bad[0]
        raise NonFiniteLossError(
            f"The weights hold NaN/inf after step {step} although every "
            f"training loss was finite: {name!r} has {nonfinite} of its "
            f"{size} values NaN/inf ({len(bad)} variable(s) affected). Likely "
            "cause: non-finite input that the forward pass hid (relu(NaN) "
            "is 0) but the gradient did not (the first kernel's rows for "
            "the NaN features turn NaN); or, if one value alone is hit, a "
            "corrupted weight (faulty memory). Drop or fix such examples in "
            "the pipeline (find them with tf.debugging.check_numerics); "
            "no checkpoint of these weights was saved.", step=step)


def likely_cause(losses, bad: int, *, first_step: int, previous=(),
                 weights: WeightCheck | None = None,
                 fix="`clip_global_norm`") -> str:
    """The likely cause of the non-finite loss `losses[bad]`, from evidence.

    Args:
      losses: per-step losses of the loop (its first step is `first_step`+1).
      bad: index of the first non-finite one.
      first_step: the step count before the loop.
      previous: losses of the steps before the loop (the newest last).
      weights: the `WeightCheck` taken before the loop, if any.
      fix: the clipping option to suggest.
    """
    step = first_step + bad + 1
    before = [float(v) for v in (*list(previous)[-100:], *losses[:bad])
              if np.isfinite(v)]
    lowest = min(before, default=None)
    grew = len(before) > 1 and abs(before[-1]) >= _GROWTH * max(
        abs(lowest), 1e-12)
    found = weights.findings() if weights is not None else []
    diverge = ("a lower learning rate, {fix}, or loss scaling for float16."
               ).format(fix=fix)
    # A flipped bit damages one value; divergence grows whole tensors.
    sparse = [f for f in found if f[1] + f[2] <= max(1, f[3] // 100)]
    if sparse:
        name, nonfinite, huge, size, biggest = sparse[0]
        what = (f"{nonfinite} NaN/inf value(s)" if nonfinite else
                f"{huge} value(s) beyond {HUGE_WEIGHT:g} (the largest "
                f"{biggest:.3g})")
        earlier = [float(v) for v in previous if np.isfinite(v)]
        last = (f", while the loss was {earlier[-1]:.4g} at step "
                f"{weights.step}" if earlier else "")
        return (f"Likely cause: a corrupted weight, not the learning rate. "
                f"Before step {weights.step + 1}, {name!r} held "
                f"{what} among its {size}{last}: training changes "
                "weights gradually and all together, and a flipped exponent "
                "bit (faulty memory) or a bad assignment gives such a value. "
                "Resume from the last finite checkpoint, and check the "
                "machine's memory (ECC errors) if it happens again.")
    if found and not grew:
        name, nonfinite, huge, size, biggest = found[0]
        return (f"Likely cause: divergence: before step {weights.step + 1}, "
                f"{nonfinite + huge} of the {size} values of {name!r} were "
                f"NaN/inf or beyond {HUGE_WEIGHT:g}. Usual fixes: {diverge}")
    if grew:
        return (f"Likely cause: the loss overflowed (divergence): it grew "
                f"from {lowest:.4g} to {before[-1]:.4g} in the steps before "
                f"step {step}. Usual fixes: {diverge}")
    if weights is None and not before:
        return ("No evidence here tells the causes apart: non-finite input "
                f"(check it for NaN/inf), divergence ({diverge[:-1]}), or a "
                "corrupted weight.")
    if not np.isnan(losses[bad]):
        return (f"Likely cause: the loss overflowed at once (it is "
                f"{float(losses[bad])}, not NaN). Usual fixes: {diverge} "
                "Or check the input for values far out of range.")
    checked = (f" and every weight was finite and below {HUGE_WEIGHT:g} "
               f"before step {weights.step + 1}" if weights is not None
               and weights.step is not None else "")
    ordinary = (f"the loss was ordinary until step {step - 1} "
                f"({before[-1]:.4g}){checked}" if before else
                f"it is the first loss of this fit{checked}")
    return (f"Likely cause: non-finite input: {ordinary}, so the batch(es) of "
            f"step {step} most likely hold NaN/inf (or make the loss "
            "undefined, e.g. log(0)). Drop or fix such examples in the "
            "pipeline (find them with tf.debugging.check_numerics, or "
            "dataset.filter on tf.math.is_finite). If the input is finite, "
            f"the update before was too large: {diverge}")


def check_losses(losses, *, first_step: int, on_nonfinite: str = "raise",
                 where=None, fix="`clip_global_norm`", previous=(),
                 weights: WeightCheck | None = None) -> list[int]:
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
      previous: losses of the steps before this loop, and
      weights: the `WeightCheck` taken before it: evidence for the likely
        cause the message names (`likely_cause`).

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
        cause = likely_cause(losses, int(bad[0]), first_step=first_step,
                             previous=previous, weights=weights, fix=fix)
        raise NonFiniteLossError(
            f"The training loss is {float(losses[bad[0]])} at {place}. "
            f"{cause} Training stopped before saving a checkpoint of these "
            "weights, so model_dir still holds the last finite one; "
            "Trainer(on_nonfinite='skip') skips such updates instead.",
            step=step)
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


# Below float16's smallest subnormal, every scaled float16 gradient flushes
# to zero: the loss scale has collapsed and no update can carry information.
MIN_LOSS_SCALE = 2.0**-24


def consecutive_skips(previous: int, losses, applied: int | None = None
                      ) -> int:
    """Skipped updates in a row at the end of a loop, continuing `previous`.

    Args:
      previous: the count before this loop.
      losses: the loop's per-step losses (a non-finite one was skipped).
      applied: updates the optimizer applied in this loop (its
        `iterations` advance), if known: 0 means every step was skipped,
        also when the losses were finite and only the gradients overflowed.
    """
    finite = np.isfinite(np.asarray(losses, np.float64))
    if applied == 0 and finite.size:
        return previous + finite.size
    if finite.all():
        return 0
    if not finite.any():
        return previous + finite.size
    return int(finite.size - 1 - np.flatnonzero(finite)[-1])


def _loss_scale(optimizer):
    scale = getattr(optimizer, "dynamic_scale", None)
    return None if scale is None else float(np.asarray(scale))


def check_consecutive_skips(count: int, *, step: int, optimizer) -> None:
    """Raises `NonFiniteLossError` once `count` reaches the bound, or the
    loss scale has collapsed below `MIN_LOSS_SCALE`.

    The message names the loss scale reached and the steps skipped, so the
    cause (an overflow the scale cannot absorb, or NaN input) is not blamed
    on the learning rate.
    """
    scale = _loss_scale(optimizer)
    collapsed = scale is not None and scale < MIN_LOSS_SCALE
    if count < MAX_CONSECUTIVE_SKIPS and not collapsed:
        return
    scale_text = "" if scale is None else (
        f" with the loss scale down to {scale:g}")
    what = (f"The last {count} updates (steps {step - count + 1}-{step}) "
            "were all skipped because the loss or its gradients were NaN or "
            f"inf{scale_text}" if count >= MAX_CONSECUTIVE_SKIPS else
            f"The loss scale collapsed to {scale:g} by step {step} (below "
            f"{MIN_LOSS_SCALE:g}, float16's smallest value: every scaled "
            f"gradient is zero), after {count} skipped update(s) in a row "
            "and more before: the loss or its gradients overflow on most "
            "steps")
    raise NonFiniteLossError(
        f"{what}: training makes no progress and would end with untrained "
        "weights; no checkpoint was written from a skipped step. "
        "This is not the learning rate (no update was applied): the forward "
        "or backward pass itself overflows (under mixed_float16, values "
        "beyond float16's 65504: keep that layer or the loss in float32), "
        "or the input holds NaN/inf.", step=step)
