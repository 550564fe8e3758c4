"""tfmulti.keras.sync_batchnorm: 4 replicas train as one device does.

Without it, each of 4 replicas normalises with the moments of its quarter of
the batch, and the model drifts from the one-device model: that difference is
why the option exists.
"""

import json

import keras
import numpy as np
import pytest

from tests.subproc import run_python
from tfmulti.keras import sync_batchnorm

TOLERANCE = 1e-5
UNSYNCED_MARGIN = 1e-2


@pytest.mark.slow
def test_four_synced_replicas_match_one_device(tmp_path):
    out = tmp_path / "result.json"
    run_python(["tests/workers/keras_sync_batchnorm.py", str(out)],
               timeout=240)
    result = json.loads(out.read_text())
    assert result["sync"] < TOLERANCE
    np.testing.assert_allclose(result["sync_loss"], result["golden_loss"],
                               atol=TOLERANCE)
    assert result["unsynced"] > UNSYNCED_MARGIN
    assert abs(result["unsynced_loss"][0] - result["golden_loss"][0]) > 1e-3


class Block(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.norm = keras.layers.BatchNormalization()

    def call(self, inputs):
        return self.norm(inputs)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = [keras.layers.Dense(2),
                     keras.layers.BatchNormalization()]

    def call(self, inputs):
        return self.head[1](self.head[0](self.block(inputs)))


def _norms(model):
    return [layer for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.BatchNormalization)]


def test_switches_nested_layers_in_place_and_keeps_weights():
    model = Subclassed()
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model.fit(x, np.zeros((16, 2)), verbose=0)
    before = model.get_weights()
    assert len(_norms(model)) == 2
    assert not any(layer.synchronized for layer in _norms(model))

    assert sync_batchnorm(model) is model
    assert all(layer.synchronized for layer in _norms(model))
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # The traced step is dropped so the next fit uses the synced layers.
    assert model.train_function is None
    model.fit(x, np.zeros((16, 2)), verbose=0)


def test_synchronized_survives_saving(tmp_path):
    model = sync_batchnorm(keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization()]))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].synchronized


def test_rejects_what_is_not_a_model():
    with pytest.raises(ValueError, match="`model` should be a Keras model"):
        sync_batchnorm("resnet")
