"""Keras `model.fit` under tfmulti's strategies."""

from tfmulti.keras.callbacks import callbacks
from tfmulti.keras.fit import communication, distributed
from tfmulti.keras.sync_batchnorm import sync_batchnorm

__all__ = [
    "callbacks",
    "communication",
    "distributed",
    "sync_batchnorm",
]
