"""Outside code (Keras guides, TF tutorial, upstream reports) on one device
and on mirrored replicas, in ONE process with 4 simulated CPU devices.

Usage: cases_local.py OUT_JSON [CASE ...]
Each case function gets a strategy factory and returns numbers (weights,
losses, logs) or the text of the error it raised; the test file compares
layouts. Every case builds its own model with a fixed seed.
"""

import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

DEVICES = tfmulti.simulate_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_STRATEGIES = {}


def strategy(layout):
    """"one" (one device), "m3", "m4": mirrored over 3 / 4 devices."""
    if layout not in _STRATEGIES:
        if layout == "one":
            _STRATEGIES[layout] = tfmulti.create_strategy(
                "one_device", devices=DEVICES[:1])
        else:
            # The only line changed in the user code: the strategy.
            _STRATEGIES[layout] = tfmulti.create_strategy(
                "mirrored", devices=DEVICES[:int(layout[1:])])
    return _STRATEGIES[layout]


def weights(model):
    return [w.numpy().tolist() for w in model.weights]


def data(n, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    w = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")
    return x, y, w


def mlp(features=8, classes=3):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(classes)])


def sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def caught(fn):
    """Runs fn; returns ("ok", result, warnings) or ("error", text)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - the text is the result
            return {"error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:]}
    return {"result": out, "warnings": [str(w.message) for w in seen
                                        if "tfmulti" in str(w.message)]}


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# -- silent differences ---------------------------------------------------

def _uneven_fit(layout, how):
    """330 examples, batch 32, sample weights: the last batch of 10 splits
    3,3,2,2 over 4 replicas."""
    x, y, w = data(330)
    with strategy(layout).scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), sce(),
                      weighted_metrics=["accuracy"])
    if how == "distributed":
        tfmulti.keras.distributed(model)
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(32)
    history = model.fit(ds, epochs=2, verbose=0)
    return {"weights": weights(model), "history": history.history}


@case
def uneven_fit(layouts):
    return {layout: {how: caught(lambda: _uneven_fit(layout, how))
                     for how in ("plain", "distributed")}
            for layout in layouts}
