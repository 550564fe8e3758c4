"""Learning rates for large global batches (Goyal et al. 2017).

Data parallelism multiplies the global batch by the number of replicas; the
learning rate tuned for the small batch then has to grow with it, and a
gradual warmup keeps the first steps of the large rate from diverging
("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour").
"""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

RULES = ("linear", "sqrt")
_DECAY_NAMES = ("cosine",)
_SCHEDULE = keras.optimizers.schedules.LearningRateSchedule


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
            value < 1):
        raise ValueError(f"`{name}` should be a positive int, got {value!r}.")


@keras.saving.register_keras_serializable(package="tfmulti")
class ScaledLearningRate(_SCHEDULE):
    """The rate for `global_batch_size`, warmed up and optionally decayed.

    Created by `tfmulti.scaled_learning_rate`, which documents the arguments.
    Serialisable: a `.keras` model compiled with it loads back (with
    `tfmulti` imported, which registers it).
    """

    def __init__(self, base_lr, *, base_batch_size, global_batch_size,
                 rule="linear", warmup_steps=0, decay=None, decay_steps=None):
        if isinstance(base_lr, bool) or not isinstance(
                base_lr, numbers.Real) or not (
                    math.isfinite(base_lr) and base_lr > 0):
            raise ValueError(
                f"`base_lr` should be a positive finite number, got "
                f"{base_lr!r}: the rate tuned for `base_batch_size`.")
        _check_positive_int("base_batch_size", base_batch_size)
        _check_positive_int("global_batch_size", global_batch_size)
        if rule not in RULES:
            raise ValueError(f"`rule` is {rule!r}; valid values are "
                             f"{list(RULES)} (linear for SGD, as in Goyal et "
                             "al.; sqrt is often used with Adam).")
        if isinstance(warmup_steps, bool) or not isinstance(
                warmup_steps, numbers.Integral) or warmup_steps < 0:
            raise ValueError(f"`warmup_steps` should be a non-negative int, "
                             f"got {warmup_steps!r}.")
        self.base_lr = float(base_lr)
        self.base_batch_size = int(base_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.rule = rule
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.decay_steps = decay_steps
        self._multiplier = self._decay_multiplier(decay, decay_steps)

    def _decay_multiplier(self, decay, decay_steps):
        if decay in _DECAY_NAMES:
            _check_positive_int("decay_steps", decay_steps)
            return keras.optimizers.schedules.CosineDecay(
                1.0, decay_steps=int(decay_steps))
        if decay_steps is not None:
            raise ValueError(
                f"`decay_steps` is {decay_steps!r} but `decay` is {decay!r}; "
                "`decay_steps` only goes with decay='cosine' (a schedule "
                "passed as `decay` carries its own length).")
        if decay is None:
            return None
        if not isinstance(decay, _SCHEDULE):
            raise ValueError(
                f"`decay` should be None, 'cosine' or a "
                f"keras.optimizers.schedules.LearningRateSchedule, got "
                f"{decay!r}.")
        start = float(decay(0))
        if not math.isclose(start, 1.0, rel_tol=1e-6):
            raise ValueError(
                f"`decay` is {start} at step 0; it multiplies the scaled rate "
                f"{self.peak_learning_rate} after warmup, so it should start "
                "at 1.0. Build it with initial_learning_rate=1.0, e.g. "
                "keras.optimizers.schedules.CosineDecay(1.0, decay_steps=N).")
        return decay

    @property
    def peak_learning_rate(self) -> float:
        """`base_lr` scaled by the batch ratio: the rate warmup ends at."""
        ratio = self.global_batch_size / self.base_batch_size
        return self.base_lr * (ratio if self.rule == "linear" else
                               math.sqrt(ratio))

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak = self.peak_learning_rate
        rate = ops.convert_to_tensor(peak, "float32")
        if self.warmup_steps:
            progress = ops.minimum(step / self.warmup_steps, 1.0)
            rate = self.base_lr + (peak - self.base_lr) * progress
        if self._multiplier is not None:
            after = ops.maximum(step - self.warmup_steps, 0.0)
            decayed = peak * ops.cast(self._multiplier(after), "float32")
            rate = ops.where(step < self.warmup_steps, rate, decayed)
        return rate

    def get_config(self):
        decay = self.decay
        if isinstance(decay, _SCHEDULE):
            decay = keras.optimizers.schedules.serialize(decay)
        return {"base_lr": self.base_lr,
                "base_batch_size": self.base_batch_size,
                "global_batch_size": self.global_batch_size,
                "rule": self.rule, "warmup_steps": self.warmup_steps,
                "decay": decay, "decay_steps": self.decay_steps}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("decay"), dict):
            config["decay"] = keras.optimizers.schedules.deserialize(
                config["decay"])
        base_lr = config.pop("base_lr")
        return cls(base_lr, **config)


def scaled_learning_rate(base_lr: float, *, base_batch_size: int,
                         global_batch_size: int, rule: str = "linear",
                         warmup_steps: int = 0, decay=None,
                         decay_steps: int | None = None
                         ) -> ScaledLearningRate:
    """A learning-rate schedule scaled to the global batch, with warmup.

    The peak rate is `base_lr * k` (rule "linear") or `base_lr * sqrt(k)`
    (rule "sqrt"), with `k = global_batch_size / base_batch_size`. During the
    first `warmup_steps` steps the rate rises linearly from `base_lr` to the
    peak, as in Goyal et al. 2017; after that it is the peak times the decay
    multiplier evaluated at `step - warmup_steps`.

    Args:
      base_lr: the rate tuned for `base_batch_size`.
      base_batch_size: the batch size `base_lr` was tuned for.
      global_batch_size: the batch one optimizer step sees across all
        replicas and workers.
      rule: "linear" or "sqrt".
      warmup_steps: optimizer steps of gradual warmup; 0 for none.
      decay: None (constant after warmup), "cosine" (to 0 over `decay_steps`
        steps after warmup), or a
        `keras.optimizers.schedules.LearningRateSchedule` used as a
        multiplier: it must be 1.0 at its step 0 (build it with
        `initial_learning_rate=1.0`).
      decay_steps: length of the cosine decay; only with decay="cosine".

    Returns:
      A serialisable `keras.optimizers.schedules.LearningRateSchedule`
      (`tfmulti.schedules.ScaledLearningRate`) to pass as an optimizer's
      `learning_rate`.

    Raises:
      ValueError: an argument is out of range or of the wrong kind; the
        message names it and says the fix.
    """
    return ScaledLearningRate(
        base_lr, base_batch_size=base_batch_size,
        global_batch_size=global_batch_size, rule=rule,
        warmup_steps=warmup_steps, decay=decay, decay_steps=decay_steps)
