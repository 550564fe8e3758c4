"""Keras models under tfmulti's strategies: `fit`'s initial epoch, one
random stream per replica, models without `call`."""

from __future__ import annotations

import logging

import keras
import tensorflow as tf

from tfmulti.compat.strategies import (KERAS_BUILD_CALLER, made_by_tfmulti,
                                        tfmulti_replica_context)

_log = logging.getLogger(__name__)


# --- Keras `fit` has no public initial epoch from a callback ---------------
# Symptom: a callback can only move `fit`'s start through the private
# `model._initial_epoch` (Keras's own BackupAndRestore does), and Keras
# never resets it: a later `fit` of the same model starts there too.
# Checked: Keras 3.15.1.
# Guard: test_compat.py::test_keras_keeps_initial_epoch_after_fit.
def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the running `fit` start at `epoch` (None: the caller's)."""
    model._initial_epoch = epoch or None


# --- Keras draws the same random numbers on every replica -----------------
# Symptom: under MirroredStrategy or MultiWorkerMirroredStrategy,
# `keras.random.*(seed=SeedGenerator)`, `keras.layers.Dropout` and every
# layer drawing from a `SeedGenerator` (or the global one) give the SAME
# numbers on every replica: N replicas repeat each of a per-replica batch's
# dropout masks N times where one device draws one per example, and the
# keras-io GAN's replicas generate N copies of the same latents. Cause:
# `keras/src/random/seed_generator.py` keeps its state in a variable with
# aggregation "none" (keras-team/keras#20612, for #20611): one copy per
# replica, all starting equal and advancing alike. TensorFlow's own
# `tf.random.Generator` gives each replica its own stream; tfmulti's
# strategies do the same for Keras: in a replica context of more than one
# replica, the drawn seed is folded with the replica's global id
# (`tf.random.experimental.stateless_fold_in`). An integer seed stays the
# user's fixed seed. Checked: Keras 3.15.1. Guard:
# tests/test_compat.py::test_stock_defect_is_still_present[keras_random_alike_on_every_replica].
def draw_seeds_per_replica() -> bool:
    """Makes every Keras `SeedGenerator` draw per replica under tfmulti's
    strategies, once per process.

    Returns:
      Whether it was installed now (False: already, or this Keras keeps its
      seed generator elsewhere; then a warning says what it means).
    """
    try:
        from keras.src.random import seed_generator
        cls = seed_generator.SeedGenerator
        stock = cls.next
    except (ImportError, AttributeError):
        _log.warning(
            "tfmulti: this Keras (%s) moved its SeedGenerator; dropout and "
            "keras.random may draw the same numbers on every replica.",
            keras.__version__)
        return False
    if getattr(stock, "_tfmulti_per_replica", False):
        return False

    def next(self, ordered=True):  # noqa: A001 - Keras's method name
        seed = stock(self, ordered=ordered)
        ctx = tfmulti_replica_context()
        if ctx is None:
            return seed
        return tf.cast(tf.random.experimental.stateless_fold_in(
            seed, ctx.replica_id_in_sync_group), seed.dtype)

    next._tfmulti_per_replica = True
    cls.next = next
    return True


# --- Keras cannot build a model without `call` under a strategy ------------
# Symptom: `fit` of a model that only overrides `train_step` and calls its
# sub-models there (the keras-io GAN) fails under any strategy before the
# first step: "RuntimeError: Unable to automatically build the model ...",
# and trains without one. Cause: `keras/src/backend/tensorflow/trainer.py`
# `_maybe_symbolic_build` builds symbolically whenever a strategy is set, by
# calling the model (`compute_output_spec(self, x)`), which a model without
# `call` cannot do. tfmulti's strategies mark such a model built when every
# layer under it is (nothing is left for the build to create); any other
# model, and any model under another strategy, goes to Keras's build
# unchanged. Checked: Keras 3.15.1. Guard:
# tests/test_compat.py::test_stock_defect_is_still_present[model_without_call_not_built].
def _built_without_call(model) -> bool:
    """Whether `model` (without a `call` of its own) needs no build: all its
    layers are built. Marks it built then."""
    if model.built:
        return True
    layers = list(model._flatten_layers(include_self=False))
    if not all(layer.built for layer in layers):
        return False
    model.built = True
    return True


def build_models_without_call() -> bool:
    """Wraps Keras's `_maybe_symbolic_build` (TensorFlow trainer) once: a
    model without `call` whose layers are built skips it under tfmulti's
    strategies.

    Returns:
      Whether it was wrapped now.
    """
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
        cls = tf_trainer.TensorFlowTrainer
        stock = getattr(cls, KERAS_BUILD_CALLER)
    except (ImportError, AttributeError):
        return False
    if getattr(stock, "_tfmulti_call_less", False):
        return False

    def build(self, *args, **kwargs):
        if (made_by_tfmulti(getattr(self, "_distribute_strategy", None))
                and type(self).call is keras.Model.call
                and _built_without_call(self)):
            return None
        return stock(self, *args, **kwargs)

    build._tfmulti_call_less = True
    setattr(cls, KERAS_BUILD_CALLER, build)
    return True


# --- Keras's layer graph has no public walk --------------------------------
# `Layer._flatten_layers(include_self, recursive)` is how Keras itself lists
# every layer under a model, nested ones included; a functional model's
# graph is `_nodes_by_depth` (keras/src/models/functional.py) and the layer
# that made a symbolic tensor is its `_keras_history.operation`; a built
# Sequential keeps its graph in `_functional`. Checked: Keras 3.12.0,
# 3.15.1. Guard: test_compat.py::test_private_names_tfmulti_reads_still_
# exist; use: test_pipeline.py (cuts), test_xla.py.
def flatten_layers(model, *, include_self: bool = True,
                   recursive: bool = True):
    """Every layer under `model` (itself first unless `include_self` is
    False), nested ones too when `recursive`.

    Raises:
      RuntimeError: this Keras has no way to list nested layers.
    """
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        raise RuntimeError(
            f"Keras {keras.__version__} has no `Layer._flatten_layers`, which "
            "tfmulti uses to find nested layers (checked with Keras 3.12 and "
            "3.15). Use keras 3.15.")
    return list(flatten(include_self=include_self, recursive=recursive))


def sequential_graph(model):
    """The functional graph of a built Sequential, or None (not built)."""
    return getattr(model, "_functional", None)


def has_layer_graph(model) -> bool:
    """Whether `model` is a functional graph (not a subclassed `call`)."""
    return hasattr(model, "_nodes_by_depth") and hasattr(model, "operations")


def graph_nodes(functional):
    """The nodes of a functional graph, depth by depth."""
    return [node for nodes in functional._nodes_by_depth.values()
            for node in nodes]


def producer(tensor):
    """The layer (operation) whose call made the symbolic `tensor`."""
    return tensor._keras_history.operation


# --- A Keras variable cannot move to another device ------------------------
# A Keras 3 variable on TensorFlow wraps one `tf.Variable`, created where
# the layer was built; Keras has no public way to move it.
# `KerasVariable._initialize(value)` with a `tf.Variable` is the TF
# backend's own path for adopting one (keras/src/backend/tensorflow/
# core.py). Checked: Keras 3.12.0, 3.15.1. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist; use: test_pipeline.py.
def adopt_variable(keras_variable, tf_variable) -> None:
    """Makes `keras_variable` hold `tf_variable` (its storage, device)."""
    keras_variable._initialize(tf_variable)


# --- Keras's symbolic build reads a real batch -----------------------------
# Keras 3.15's TF trainer (`_maybe_symbolic_build`) reads one batch from a
# fresh iterator of the data, and builds from it, at every `fit` and
# `evaluate`, even when everything is built. tfmulti builds from the data's
# spec instead (`_symbolic_build(iterator=, data_batch=)`), and only when
# something is unbuilt, under the conditions Keras checks (layers, compiled
# metrics and loss, optimizer). Checked: Keras 3.12.0, 3.15.1. Guard:
# test_compat.py::test_private_names_tfmulti_reads_still_exist; use:
# test_keras_fit_local.py.
def needs_symbolic_build(model) -> bool:
    """Whether Keras's `_symbolic_build` would build anything."""
    metrics = getattr(model, "_compile_metrics", None)
    loss = getattr(model, "_compile_loss", None)
    return (not all(layer.built for layer in flatten_layers(model))
            or (metrics is not None and not metrics.built)
            or (loss is not None and not loss.built)
            or (model.optimizer is not None and not model.optimizer.built))


def symbolic_build(model, *, iterator, data_batch):
    """Keras's symbolic build of `model` from `data_batch` (specs)."""
    return model._symbolic_build(iterator=iterator, data_batch=data_batch)


def stock_symbolic_build(model, *, iterator, data_batch):
    """The TF trainer's own `_maybe_symbolic_build` (the class's, not one
    an instance replaced)."""
    return getattr(type(model), KERAS_BUILD_CALLER)(
        model, iterator=iterator, data_batch=data_batch)

