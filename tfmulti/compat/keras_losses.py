"""Keras's losses under a strategy: the 1/replicas scale, the loss tracker,
and what a replica step reads of Keras's train step."""

from __future__ import annotations

import contextlib
import threading

import keras
import tensorflow as tf


# --- Keras's train step internals that tfmulti's step reproduces -----------
# Symptom: `keras.Model.train_step` (TF backend) cannot be reused without
# its own gradient application, so tfmulti.keras.distributed re-does its loss
# part, which reads the private `_call_has_training_arg` and updates the
# private `_loss_tracker` exactly as Keras does. Checked: Keras 3.15.1.
# Guard: test_compat.py::test_private_strategy_attributes_still_exist.
def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (Keras's cached answer)."""
    return bool(getattr(model, "_call_has_training_arg", True))


def loss_tracker(model):
    """The metric Keras's `fit` reports as "loss"."""
    return model._loss_tracker


# --- Keras losses divide by the replica count under a strategy -------------
# Symptom: `keras.losses.Loss.__call__` (`reduce_values`) multiplies the
# mean loss by 1/num_replicas in a replica context, so the compiled loss is
# already this replica's share; the value Keras's loss tracker wants is the
# unscaled mean. Checked: Keras 3.15.1.
# Guard: test_compat.py (keras_loss_scales_by_replicas).
def unscaled_keras_loss(loss, strategy):
    """The local mean loss from a Keras-compiled loss of this replica."""
    return loss * tf.cast(strategy.num_replicas_in_sync, loss.dtype)


# --- Keras losses are scaled by 1/replicas in a custom `test_step` too ------
# Symptom: keras-io "Customizing what happens in fit() with TensorFlow",
# "Providing your own evaluation step": the guide's `test_step` logs
# `self.compute_loss(...)` with `metric.update_state(loss)`; under a
# strategy with N replicas `keras/src/losses/loss.py` `reduce_values` (and
# the TF trainer's `_aggregate_additional_loss`) multiply every loss by 1/N
# (`scale_loss_for_distribution`), which only the summed GRADIENT needs, so
# `evaluate` reports 1/N of one device's loss (0.556 for 2.226 on 4
# replicas), silently. Keras's own `test_step` undoes the scale with
# `unscale_loss_for_distribution`. Checked: Keras 3.15.1.
# Workaround: while a custom `test_step` runs (traced) under tfmulti's
# strategies or `tfmulti.keras.distributed`, both functions are the
# identity, so its losses are what one device computes. Guard: the stock
# scale, test_compat.py (keras_loss_scales_by_replicas); the stock guide's
# 1/N, tests/conformance/test_conformance.py::test_stock_guide_test_step_
# loss_still_scaled; these names, test_keras_fit_local.py::
# test_loss_scaling_functions_still_exist.
LOSS_SCALE_FUNCTIONS = ("scale_loss_for_distribution",
                         "unscale_loss_for_distribution")
_unscaled_lock = threading.Lock()
_unscaled_depth = 0
_scaled_originals = {}


def _identity(value):
    return value


def _loss_module():
    from keras.src.losses import loss as loss_module
    missing = [n for n in LOSS_SCALE_FUNCTIONS
               if not callable(getattr(loss_module, n, None))]
    if missing:
        raise RuntimeError(
            f"keras.src.losses.loss has no {missing}: this Keras "
            f"({keras.__version__}) changed how it scales losses for "
            "replicas, and tfmulti cannot report a custom test_step's loss "
            "as one device does. Use keras 3.15.")
    return loss_module


@contextlib.contextmanager
def unscaled_keras_losses():
    """Keras losses computed inside are not scaled for replicas (re-entrant,
    and shared by the replica threads of one `strategy.run`)."""
    global _unscaled_depth
    module = _loss_module()
    with _unscaled_lock:
        if _unscaled_depth == 0:
            for name in LOSS_SCALE_FUNCTIONS:
                _scaled_originals[name] = getattr(module, name)
                setattr(module, name, _identity)
        _unscaled_depth += 1
    try:
        yield
    finally:
        with _unscaled_lock:
            _unscaled_depth -= 1
            if _unscaled_depth == 0:
                for name in LOSS_SCALE_FUNCTIONS:
                    setattr(module, name, _scaled_originals.pop(name))


def losses_unscaled_in(fn):
    """`fn` (a step that computes losses only to log them) run inside
    `unscaled_keras_losses`."""
    def unscaled(*args, **kwargs):
        with unscaled_keras_losses():
            return fn(*args, **kwargs)
    unscaled.__name__ = getattr(fn, "__name__", "unscaled")
    return unscaled


# --- The compiled loss is private to the trainer ---------------------------
# Keras 3 keeps what `compile(loss=...)` made in `model._compile_loss` (a
# CompileLoss; its losses in `_flat_losses`, entries whose second item is
# the loss object), computes it with `model._compute_loss` (which also takes
# a pre-3.3 `compute_loss(x, y, y_pred, sample_weight)` override), and adds
# each regularisation term through the TF trainer's
# `_aggregate_additional_loss` (the 1/replicas scale). tfmulti's step
# computes Keras's loss the same way, to weight a replica by its real share.
# Checked: Keras 3.12.0, 3.15.1. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist; use: test_keras_fit_local.py.
def compiled_loss(model):
    """The model's CompileLoss, or None (not compiled with a loss)."""
    return getattr(model, "_compile_loss", None)


def compiled_loss_objects(model) -> list | None:
    """The loss objects of the compiled loss ([] without one), or None if
    this Keras keeps them elsewhere."""
    compiled = compiled_loss(model)
    if compiled is None:
        return []
    flat = getattr(compiled, "_flat_losses", None)
    return None if flat is None else [entry[1] for entry in flat]


def compute_compiled_loss(model, **kwargs):
    """`model._compute_loss(x=, y=, y_pred=, sample_weight=, training=)`."""
    return model._compute_loss(**kwargs)


def additional_loss(model, term):
    """A regularisation term as Keras adds it to the loss (scaled by
    1/replicas under a strategy)."""
    return model._aggregate_additional_loss(term)
