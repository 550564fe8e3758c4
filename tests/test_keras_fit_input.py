"""`fit` through tfmulti.keras.distributed keeps its iterator across calls.

In process, one device (the 4-replica case runs in tests/test_xla.py): a
second `fit` call on the same infinite dataset makes no new distributed
iterator and continues where the first stopped, so two calls of one epoch
equal plain Keras `fit` of two epochs.
"""

import keras
import numpy as np
import tensorflow as tf

import tfmulti


STRATEGY = tfmulti.create_strategy("one_device")


def _model(*, steps_per_execution):
    with STRATEGY.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      steps_per_execution=steps_per_execution)
    return model


def _data(repeat=True):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 2, size=(64,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    return dataset.repeat() if repeat else dataset


def _made(model):
    return model._tfmulti_fit.input.iterators_made


def test_second_fit_call_makes_no_iterator_and_continues_the_data():
    golden = _model(steps_per_execution=1)
    expected = golden.fit(_data(), epochs=2, steps_per_epoch=3,
                          verbose=0).history["loss"]
    model = tfmulti.keras.distributed(_model(steps_per_execution=2))
    data = _data()
    losses = model.fit(data, epochs=1, steps_per_epoch=3,
                       verbose=0).history["loss"]
    # The kept iterator only: the symbolic build reads the data's spec, so
    # Keras's probe iterator is never made.
    assert _made(model) == 1
    losses += model.fit(data, epochs=1, steps_per_epoch=3,
                        verbose=0).history["loss"]
    assert _made(model) == 1
    np.testing.assert_allclose(losses, expected, atol=1e-6)
    for a, b in zip(model.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # Another dataset object starts from its beginning, on a new iterator
    # (nothing left to build: no probe).
    model.fit(_data(), epochs=1, steps_per_epoch=3, verbose=0)
    assert _made(model) == 2


def test_finite_dataset_restarts_each_epoch_as_in_keras():
    golden = _model(steps_per_execution=1)
    model = tfmulti.keras.distributed(_model(steps_per_execution=4))
    data = _data(repeat=False)
    for net in (golden, model):
        net.fit(data, epochs=1, verbose=0)
        net.fit(data, epochs=1, verbose=0)
    # Keras's own iterators: the kept one is for infinite data only.
    assert _made(model) == 0
    assert int(model.optimizer.iterations) == 16
    for a, b in zip(model.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
