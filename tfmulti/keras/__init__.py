"""Keras `model.fit` under tfmulti's strategies."""

from tfmulti.keras.backup import BackupAndRestore, callbacks
from tfmulti.keras.fit import distributed
from tfmulti.keras.fit_state import communication
from tfmulti.keras.sync_batchnorm import sync_batchnorm

__all__ = [
    "BackupAndRestore",
    "callbacks",
    "communication",
    "distributed",
    "sync_batchnorm",
]
