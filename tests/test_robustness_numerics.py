"""Updates skipped without end, and clipping to inf: clear errors, not exit 0.

In process, one device, a real mixed_float16 model whose forward pass
overflows float16 on every step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti.training import numerics  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


def test_mixed_float16_overflowing_every_step_stops_naming_the_cause():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(3)])
            trainer = tfmulti.Trainer(model, keras.optimizers.SGD(0.1),
                                      loss=LOSS, steps_per_loop=10)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    before = [w.numpy().copy() for w in model.weights]
    # 1e5 is beyond float16's 65504: inf on every step, whatever the scale.
    x = np.full((64, 4), 1e5, "float32")
    data = tf.data.Dataset.from_tensor_slices(
        (x, np.zeros(64, "int32"))).repeat().batch(8, drop_remainder=True)
    with pytest.raises(numerics.NonFiniteLossError, match=(
            r"The last 30 updates \(up to step 30\) were all skipped because "
            r"the loss or its gradients were NaN or inf with the loss scale "
            r"down to .*This is not the learning rate")):
        trainer.fit(data, steps=100, verbose=0)
    for old, new in zip(before, model.weights):
        np.testing.assert_array_equal(old, new.numpy())


@pytest.mark.parametrize("clip", [float("inf"), float("nan")])
def test_clip_global_norm_inf_is_refused_up_front(clip):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        with pytest.raises(ValueError, match=(
                "`clip_global_norm` should be a positive number or None, got "
                f"{clip}; it must be finite .* Pass None for no clipping")):
            tfmulti.Trainer(model, keras.optimizers.SGD(0.1), loss=LOSS,
                            clip_global_norm=clip)
