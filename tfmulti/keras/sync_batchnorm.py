"""Batch normalisation over the global batch instead of each replica's slice.

Under a strategy every replica normalises with the moments of its own slice
of the batch (global batch / replicas examples), so N replicas train a
different model from one device, and small per-replica batches give noisy
statistics. Keras 3's `BatchNormalization(synchronized=True)` all-reduces the
moments across replicas on the TensorFlow backend; `sync_batchnorm` turns it
on for every such layer of an existing model.
"""

from __future__ import annotations

import logging

import keras

from tfmulti import compat

_log = logging.getLogger(__name__)


def sync_batchnorm(model: keras.Model) -> keras.Model:
    """Synchronises every BatchNormalization layer of `model` across replicas.

    The layers are switched in place (`synchronized = True`), so the model
    keeps its object identity, variables (created under whatever strategy
    scope the model was built in), weights and compiled state. This reaches
    layers nested anywhere, including inside custom layers and subclassed
    models, which `keras.models.clone_model` cannot rebuild. Functions the
    model already traced are dropped so the next `fit` / `evaluate` /
    `predict` traces the synchronised layers.

    With one replica the result is unchanged; with N replicas the moments
    are those of the global batch, as on one device.

    Args:
      model: a Keras 3 model or layer (Sequential, functional or subclassed).

    Returns:
      `model` itself.

    Raises:
      ValueError: `model` is not a Keras layer or model.
      RuntimeError: this Keras version has no way to list nested layers
        (checked with Keras 3.15).
    """
    if not isinstance(model, keras.layers.Layer):
        raise ValueError(f"`model` should be a Keras model or layer, got "
                         f"{type(model).__name__}: {model!r}.")
    count = 0
    # Without a way to list nested layers (a future Keras), this raises;
    # BatchNormalization(synchronized=True) in the model is the way then.
    for layer in compat.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.synchronized = True
            count += 1
    if not count:
        _log.warning("tfmulti.sync_batchnorm: %s has no BatchNormalization "
                     "layer; nothing changed.", model.name)
    for attribute in ("train_function", "test_function", "predict_function"):
        if getattr(model, attribute, None) is not None:
            setattr(model, attribute, None)
    return model
