"""Keras `model.fit` under tfmulti's strategies."""

from tfmulti.keras.callbacks import callbacks
from tfmulti.keras.sync_batchnorm import sync_batchnorm

__all__ = [
    "callbacks",
    "sync_batchnorm",
]
