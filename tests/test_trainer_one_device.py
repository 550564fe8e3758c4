"""Trainer in process on one device: equal to Keras `model.fit`, history,
progress lines and evaluation."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)
X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


@pytest.fixture
def strategy():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return model, keras.optimizers.SGD(0.1, momentum=0.9)


def data(batch=8):
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        batch, drop_remainder=True)


def test_equals_keras_fit(strategy):
    # An independent reference: Keras's own loop over the same batches.
    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                              steps_per_loop=3)
    trainer.fit(data(), steps=16, verbose=0)
    reference, reference_optimizer = build(strategy)
    reference.compile(optimizer=reference_optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_one_device_fit_and_evaluate(strategy, capsys):
    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                              metrics=["sparse_categorical_accuracy"],
                              steps_per_loop=3)
    history = trainer.fit(data(), steps=7, eval_data=data().take(2),
                          verbose=1)
    assert history["step"] == [3, 6, 7] and len(history["step_loss"]) == 7
    assert history["val_step"] == [7]
    assert "step 7/7 - loss" in capsys.readouterr().out
    assert all(np.isfinite(history["step_loss"]))
    assert trainer.evaluate(data().take(2)) == pytest.approx(
        {"loss": history["val_loss"][-1],
         "sparse_categorical_accuracy":
             history["val_sparse_categorical_accuracy"][-1]})


def test_dataset_fn_with_global_batch_size(strategy):
    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
            context.get_per_replica_batch_size(8), drop_remainder=True)

    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy)
    from_fn = trainer.fit(dataset_fn, steps=4, global_batch_size=8,
                          verbose=0)
    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy)
    from_dataset = trainer.fit(data(), steps=4, verbose=0)
    np.testing.assert_allclose(from_fn["step_loss"],
                               from_dataset["step_loss"], atol=1e-7)
    with pytest.raises(ValueError, match="pass `global_batch_size`"):
        trainer.fit(dataset_fn, steps=8, verbose=0)
