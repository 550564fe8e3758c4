"""Trains a small Keras classifier with model.fit under a tfmulti strategy.

Flags and wiring only; the logic lives in tfmulti.
"""

from absl import app
from absl import flags

import tfmulti

_CPU_REPLICAS = flags.DEFINE_integer(
    "cpu_replicas", 4, "Simulate this many CPU replicas.", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs to train.", lower_bound=1)
_STRATEGY = flags.DEFINE_enum("strategy", "auto",
                              list(tfmulti.strategies.STRATEGY_NAMES),
                              "Distribution strategy.")


def main(argv):
    del argv
    tfmulti.simulate_devices(_CPU_REPLICAS.value)
    strategy = tfmulti.create_strategy(_STRATEGY.value)
    import keras
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    model.fit(x, y, batch_size=64, epochs=_EPOCHS.value, verbose=2)


if __name__ == "__main__":
    app.run(main)
