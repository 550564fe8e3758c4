"""Sharded optimizer state (ZeRO-1) against the unsharded step and one device.

Usage: python optimizer_sharding_golden.py OUT.json

One process with 4 simulated CPU devices trains, for each optimizer, 50
steps on one device (a plain Keras optimizer), on 4 mirrored replicas
unsharded and on 4 mirrored replicas sharded, all clipping by the global
norm of the reduced gradient; then resumes across the two forms through the
unsharded optimizer state (sharded 25 steps -> one device 25 steps, and one
device 25 -> sharded 25). Writes losses, weights, the bytes of optimizer
state per device and the errors for unshardable optimizers.
"""

import json
import sys

import numpy as np

import tfmulti

tfmulti.simulate_devices(4)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.training import gradients as gradients_lib  # noqa: E402
from tfmulti.training import optimizer_sharding  # noqa: E402
from tfmulti.training import step as step_lib  # noqa: E402

STEPS = 50
BATCH = 16
CLIP = 0.5
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
}
rng = np.random.RandomState(0)
X = rng.randn(STEPS * BATCH, 5).astype("float32")
Y = rng.randn(STEPS * BATCH, 3).astype("float32")


def build_model():
    keras.utils.set_random_seed(1)
    # 5*7+7 + 7*3+3 = 66 parameters: 66 / 4 shards pads 2 elements.
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(7, activation="tanh"),
                             keras.layers.Dense(3)])


def loss_fn(model, x, y, global_batch):
    per_example = tf.reduce_mean((model(x) - y) ** 2, axis=-1)
    return tf.nn.compute_average_loss(per_example,
                                      global_batch_size=global_batch)


def one_device(name, start=0, stop=STEPS, model=None, optimizer=None):
    if model is None:
        model = build_model()
        optimizer = OPTIMIZERS[name]()
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y, BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, CLIP)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    losses = [float(step(X[i * BATCH:(i + 1) * BATCH],
                         Y[i * BATCH:(i + 1) * BATCH]))
              for i in range(start, stop)]
    return model, optimizer, losses


def mirrored(strategy, name, sharded, start=0, stop=STEPS, state=None):
    with strategy.scope():
        model = build_model()
        optimizer = OPTIMIZERS[name]()
        if sharded:
            sharding = optimizer_sharding.ShardedOptimizer(
                strategy, optimizer, model.trainable_variables)
        else:
            gradients_lib.disable_optimizer_reduction(optimizer)
            optimizer.build(model.trainable_variables)
    if state is not None:
        weights, full = state
        model.set_weights(weights)
        sharding.load_from(full)
    data = tf.data.Dataset.from_tensor_slices(
        (X[start * BATCH:stop * BATCH], Y[start * BATCH:stop * BATCH]))
    iterator = iter(strategy.experimental_distribute_dataset(
        data.batch(BATCH)))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y, BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        grads = gradients_lib.all_reduce_sum(grads)
        grads, _ = gradients_lib.clip_by_global_norm(grads, CLIP)
        if sharded:
            sharding.apply(grads)
        else:
            optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(iterator):
        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_step, (x, y)),
                               axis=None)

    losses = [float(step(iterator)) for _ in range(start, stop)]
    return model, (sharding if sharded else optimizer), losses


def train_step_accumulated(strategy, name, k=2):
    """TrainStep(sharding=...) with K micro-batches of BATCH/K."""
    with strategy.scope():
        model = build_model()
        optimizer = OPTIMIZERS[name]()
        sharding = optimizer_sharding.ShardedOptimizer(
            strategy, optimizer, model.trainable_variables)
        gradients_lib.disable_optimizer_reduction(optimizer)

    def compute_loss(x, y, sample_weight):
        return loss_fn(model, x, y, BATCH // k), None

    step = step_lib.TrainStep(
        strategy, model, optimizer, compute_loss,
        options=step_lib.GradientOptions(grad_accum_steps=k,
                                         clip_global_norm=CLIP),
        sharding=sharding)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH // k)
    iterator = iter(strategy.experimental_distribute_dataset(data))

    @tf.function
    def run(iterator):
        return strategy.reduce("SUM", step(iterator), axis=None)

    losses = [float(run(iterator)) for _ in range(STEPS)]
    return model, losses


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def main(out):
    strategy = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")])
    result = {}
    for name in OPTIMIZERS:
        case = {}
        model, optimizer, losses = one_device(name)
        case["one_device"] = {"loss": losses, "weights": weights(model)}
        model, _, losses = mirrored(strategy, name, sharded=False)
        case["unsharded"] = {"loss": losses, "weights": weights(model)}
        model, sharding, losses = mirrored(strategy, name, sharded=True)
        case["sharded"] = {"loss": losses, "weights": weights(model)}
        full = OPTIMIZERS[name]()
        full.build(model.trainable_variables)
        sharding.assign_to(full)
        case["state_difference"] = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(full.variables, optimizer.variables))
        case["bytes_per_device"] = sharding.state_bytes_per_device()
        case["unsharded_bytes"] = sum(
            int(np.prod(v.shape)) * 4 for v in optimizer.variables)

        # Sharded for 25 steps, saved unsharded, resumed on one device.
        half = STEPS // 2
        model, sharding, first = mirrored(strategy, name, sharded=True,
                                          stop=half)
        resumed = build_model()
        resumed.set_weights(model.get_weights())
        full = OPTIMIZERS[name]()
        full.build(resumed.trainable_variables)
        sharding.assign_to(full)
        resumed, _, second = one_device(name, half, STEPS, resumed, full)
        case["sharded_to_one_device"] = {"loss": first + second,
                                         "weights": weights(resumed)}
        # One device for 25 steps, resumed sharded over 4 replicas.
        model, full, first = one_device(name, 0, half)
        model, _, second = mirrored(
            strategy, name, sharded=True, start=half,
            state=(model.get_weights(), full))
        case["one_device_to_sharded"] = {"loss": first + second,
                                         "weights": weights(model)}
        if name == "adam":
            model, losses = train_step_accumulated(strategy, name)
            case["train_step_accumulated"] = {"loss": losses,
                                              "weights": weights(model)}
        result[name] = case
    errors = {}
    for label, make in (
            ("adafactor", lambda: keras.optimizers.Adafactor(0.01)),
            ("global_clipnorm",
             lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0))):
        try:
            with strategy.scope():
                optimizer_sharding.ShardedOptimizer(
                    strategy, make(), build_model().trainable_variables)
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    result["errors"] = errors
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
