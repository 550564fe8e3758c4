"""The example model the recipes and benchmarks train."""

from __future__ import annotations

import keras


def small_cnn(input_shape=(32, 32, 3), num_classes: int = 10, *,
              batch_norm: bool = True) -> keras.Model:
    """A small image classifier: uint8 images in, float32 logits out.

    Three conv blocks and a dense layer; reaches over 80% test accuracy on
    `tfmulti_shapes` in two CPU epochs. Images are rescaled inside the model,
    because a per-element cast in tf.data costs ~50 us per element on a CPU
    (BUILD_NOTES, input pipeline).

    Args:
      input_shape: image shape (height, width, channels).
      num_classes: number of logits.
      batch_norm: add BatchNormalization after each convolution (what
        `--sync_batchnorm` synchronises across replicas).
    """
    layers = keras.layers
    inputs = keras.Input(input_shape, dtype="uint8")
    x = layers.Rescaling(1.0 / 255)(inputs)
    for filters in (32, 64, 64):
        x = layers.Conv2D(filters, 3, padding="same",
                          use_bias=not batch_norm)(x)
        if batch_norm:
            # Momentum 0.9, not Keras's 0.99: a run of a few hundred steps
            # must end with moving statistics that describe the trained
            # weights, or test accuracy lags far behind training accuracy
            # (measured: 17% test vs 80% train after 312 steps at 0.99).
            x = layers.BatchNormalization(momentum=0.9)(x)
        x = layers.Activation("relu")(x)
        x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    x = layers.Dense(64, activation="relu")(x)
    # float32 logits keep the softmax stable under a mixed-precision policy.
    outputs = layers.Dense(num_classes, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


def mlp(features: int = 64, width: int = 64, num_classes: int = 10
        ) -> keras.Model:
    """Two ReLU layers of `width` over `features` inputs, `num_classes`
    logits: the benchmarks' dense model."""
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(num_classes)])
