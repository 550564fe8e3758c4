"""Trainer argument checks and the optimizer-reduction guard, in process on
one device: each mistake fails with a message that names it and the fix."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import training  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


@pytest.fixture
def strategy():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def build(strategy, **optimizer_kwargs):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return model, keras.optimizers.SGD(0.1, **optimizer_kwargs)


def data(batch=8, drop_remainder=True):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.zeros(64, "int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        batch, drop_remainder=drop_remainder)


def test_keras_still_has_the_replaced_reduction():
    # The private method tfmulti replaces (Keras 3 TF optimizer); if a Keras
    # release drops it, this fails before training silently reduces twice.
    assert keras.__version__.startswith("3.")
    assert callable(getattr(keras.optimizers.SGD, "_all_reduce_sum_gradients"))
    optimizer = keras.optimizers.Adam()
    training.disable_optimizer_reduction(optimizer)
    pairs = [(tf.ones(2), "v")]
    assert optimizer._all_reduce_sum_gradients(pairs) == pairs
    # Only this instance changed.
    assert "_all_reduce_sum_gradients" not in vars(keras.optimizers.Adam())


def test_loss_scale_optimizer_inner_reduction_is_replaced_too():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    training.disable_optimizer_reduction(optimizer)
    assert "_all_reduce_sum_gradients" in vars(optimizer.inner_optimizer)


def test_keras_gradient_accumulation_is_rejected(strategy):
    model, optimizer = build(strategy, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"`grad_accum_steps=4`"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy)


def test_scalar_loss_says_reduction_none(strategy):
    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="reduction=None"):
        trainer.fit(data(), steps=1, verbose=0)


def test_model_and_optimizer_outside_scope(strategy):
    outside_model = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(3)])
    _, optimizer = build(strategy)
    with pytest.raises(ValueError, match=r"not created under the scope.*"
                       r"strategy.scope\(\)"):
        tfmulti.Trainer(outside_model, optimizer, loss=LOSS,
                        strategy=strategy)
    model, _ = build(strategy)
    with pytest.raises(ValueError, match="optimizer SGD was created outside"):
        tfmulti.Trainer(model, keras.optimizers.SGD(), loss=LOSS,
                        strategy=strategy)


def test_metric_outside_scope(strategy):
    model, optimizer = build(strategy)
    with pytest.raises(ValueError, match="metric 'acc' was created outside"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                        metrics=[keras.metrics.SparseCategoricalAccuracy(
                            name="acc")])


@pytest.mark.parametrize("kwargs, match", [
    ({"grad_accum_steps": 0}, r"`grad_accum_steps` should be an int >= 1, "
     r"got 0"),
    ({"clip_global_norm": -1.0}, r"`clip_global_norm` should be a positive "
     r"number or None, got -1.0"),
    ({"allreduce_dtype": "int8"}, r"`allreduce_dtype` is 'int8'"),
    ({"steps_per_loop": 2.5}, r"`steps_per_loop` should be an int >= 1, "
     r"got 2.5"),
    ({"mixed_precision": "mixed_float16"}, r"`mixed_precision` is "
     r"'mixed_float16' but the model was built with dtype policy 'float32'"),
    ({"mixed_precision": "float64"}, r"`mixed_precision` is 'float64'"),
])
def test_bad_options(strategy, kwargs, match):
    model, optimizer = build(strategy)
    with pytest.raises(ValueError, match=match):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                        **kwargs)


def test_global_batch_size_checks(strategy):
    model, optimizer = build(strategy)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        trainer.fit(data(drop_remainder=False), steps=1, verbose=0)
    with pytest.raises(ValueError, match=r"`global_batch_size` is 16 but the "
                       r"data yields 8 examples per replica x 1 replicas"):
        trainer.fit(data(), steps=1, global_batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"`steps` should be an int >= 1"):
        trainer.fit(data(), steps=0, verbose=0)
    with pytest.raises(ValueError, match="`train_data` should be"):
        trainer.fit([1, 2, 3], steps=1, verbose=0)


def test_train_step_needs_the_reduction_disabled(strategy):
    model, optimizer = build(strategy)
    with pytest.raises(ValueError, match="disable_optimizer_reduction"):
        training.TrainStep(strategy, model, optimizer, lambda x, y, w: None)


def test_loop_wants_a_tensor_step_count(strategy):
    train = training.create_train_loop(lambda iterator: 0.0,
                                       strategy=strategy)
    with pytest.raises(ValueError, match=r"`num_steps` should be a "
                       r"`tf.Tensor`, got 3"):
        train(iter([]), 3)
