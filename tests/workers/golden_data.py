"""The small classification data of the golden-run workers.

512 examples of 8 features and 3 classes (seeded); the first 100 are the
evaluation set, in global batches of `BATCH` whose last one is padded with
weight-0 rows: what the data layer's exact-once eval mode yields.
"""

import numpy as np
import tensorflow as tf

BATCH = 32
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype("float32")
Y = rng.integers(0, 3, size=(512,)).astype("int32")
X_EVAL, Y_EVAL = X[:100], Y[:100]


def padded_eval_dataset():
    pad = -len(X_EVAL) % BATCH
    x = np.concatenate([X_EVAL, np.zeros((pad, 8), "float32")])
    y = np.concatenate([Y_EVAL, np.zeros((pad,), "int32")])
    w = np.concatenate([np.ones(len(X_EVAL), "float32"),
                        np.zeros(pad, "float32")])
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(BATCH)


def compiled_eval_model(strategy, input_shape, layers, weights, **compile_args):
    """A Sequential with fixed numpy weights (the same model in every process,
    whatever the strategy does with Keras's RNG), compiled with the weighted
    accuracy and cross-entropy that exact-once evaluation reads."""
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input(input_shape), *layers])
        model.set_weights(weights)
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[
                "accuracy",
                keras.metrics.SparseCategoricalCrossentropy(
                    from_logits=True, name="xent")],
            **compile_args)
    return model
