"""The Keras major version tfmulti supports."""

from __future__ import annotations

import keras


# Checked on: TensorFlow 2.21.0, Keras 3.15.1.
SUPPORTED_KERAS_MAJOR = 3


def keras_major() -> int:
    """The installed Keras major version."""
    return int(keras.__version__.split(".")[0])
