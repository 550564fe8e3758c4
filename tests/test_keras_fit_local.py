"""tfmulti.keras.distributed in one process, under a one_device strategy:
clear errors for bad input, mixed precision, resuming with accumulation.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_keras_callbacks import _Killed, _KillAt
import tfmulti
from tfmulti.keras.backup import BackupAndRestore


STRATEGY = tfmulti.create_strategy("one_device")


def _model(optimizer=None, *, compile=True, model_class=keras.Sequential,
           strategy=STRATEGY, steps_per_execution=4):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = model_class([keras.Input((4,)),
                             keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(2)])
        if compile:
            model.compile(optimizer=optimizer() if optimizer else
                          keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True),
                          steps_per_execution=steps_per_execution)
    return model


def _data(batch=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 2, size=(64,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()


def test_uncompiled_model_is_refused():
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        tfmulti.keras.distributed(_model(compile=False))


def test_keras_gradient_accumulation_points_to_grad_accum_steps():
    model = _model(lambda: keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match=(
            r"`gradient_accumulation_steps`=4.*distributed\(model, "
            r"grad_accum_steps=4\)")):
        tfmulti.keras.distributed(model)


def test_model_built_without_a_strategy_is_refused():
    with pytest.raises(ValueError, match="built without a strategy"):
        tfmulti.keras.distributed(_model(
            strategy=tf.distribute.get_strategy()))


def test_overridden_train_step_is_refused():
    class Custom(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    with pytest.raises(ValueError, match="Custom overrides `train_step`"):
        tfmulti.keras.distributed(_model(model_class=Custom))


@pytest.mark.parametrize("options, message", [
    ({"grad_accum_steps": 0}, "`grad_accum_steps` should be an int >= 1, "
                              "got 0"),
    ({"clip_global_norm": -1.0}, "`clip_global_norm` should be a positive "
                                 "number or None, got -1.0"),
    ({"allreduce_dtype": "int8"}, "`allreduce_dtype` is 'int8'"),
])
def test_bad_options_name_the_argument(options, message):
    with pytest.raises(ValueError, match=message):
        tfmulti.keras.distributed(_model(), **options)


def test_distributed_changes_only_that_instance():
    model = tfmulti.keras.distributed(_model())
    other = _model()
    assert "make_train_function" in vars(model)
    assert "make_train_function" not in vars(other)
    assert type(model) is type(other) is keras.Sequential


def test_mixed_float16_fit_matches_plain_keras():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        golden = _model(steps_per_execution=1)
        model = tfmulti.keras.distributed(_model())
        # `compile` wrapped the optimizer for dynamic loss scaling.
        assert isinstance(model.optimizer,
                          keras.optimizers.LossScaleOptimizer)
        expected = golden.fit(_data(), epochs=2, steps_per_epoch=6,
                              verbose=0).history["loss"]
        losses = model.fit(_data(), epochs=2, steps_per_epoch=6,
                           verbose=0).history["loss"]
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert int(model.optimizer.iterations.numpy()) == 12
    np.testing.assert_allclose(losses, expected, atol=1e-3)
    for a, b in zip(model.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-3)


def test_mid_epoch_resume_skips_accumulated_batches(tmp_path):
    # 4 updates of 2 batches an epoch = the 8 batches of the data, so a
    # restarted fit's fresh iterator is where epoch 1 began; resuming after
    # 2 updates must skip 4 batches, not 2.
    def model():
        return tfmulti.keras.distributed(_model(steps_per_execution=2),
                                         grad_accum_steps=2)

    fit = {"epochs": 2, "steps_per_epoch": 4, "verbose": 0}
    golden = model()
    golden.fit(_data(), **fit)
    with pytest.raises(_Killed):
        model().fit(_data(), **fit, callbacks=[
            BackupAndRestore(tmp_path, save_freq=2), _KillAt(1, 1)])
    resumed = model()
    backup = BackupAndRestore(tmp_path, save_freq=2)
    assert resumed.fit(_data(), **fit, callbacks=[backup]).epoch == [1]
    assert backup.restored == (1, 2)
    assert int(resumed.optimizer.iterations) == int(
        golden.optimizer.iterations) == 8
    for a, b in zip(resumed.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_loss_scaling_functions_still_exist():
    # Guard of compat.unscaled_keras_losses: the names it swaps exist, are
    # swapped only inside (re-entrant) and restored after.
    from keras.src.losses import loss as loss_module
    from tfmulti import compat
    before = [getattr(loss_module, n) for n in compat.LOSS_SCALE_FUNCTIONS]
    with compat.unscaled_keras_losses():
        with compat.unscaled_keras_losses():
            assert loss_module.scale_loss_for_distribution(3.0) == 3.0
        assert loss_module.unscale_loss_for_distribution(3.0) == 3.0
    assert [getattr(loss_module, n)
            for n in compat.LOSS_SCALE_FUNCTIONS] == before
