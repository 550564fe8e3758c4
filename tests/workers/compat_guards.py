"""Reproduces, with stock Keras / TensorFlow on 2 logical CPUs, each upstream
defect that `tfmulti.compat` works around; prints one JSON line
{guard: {"present": bool, "detail": str}}. A guard whose defect is gone
(present False) means an upstream release fixed it: delete the workaround.

Usage: compat_guards.py
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402
from tfmulti import compat  # noqa: E402

tfmulti.simulate_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

results = {}


def guard(name):
    def wrap(fn):
        try:
            present, detail = fn()
        except Exception as e:  # noqa: BLE001 (reported, never hidden)
            present, detail = None, f"guard crashed: {type(e).__name__}: {e}"
        results[name] = {"present": present, "detail": str(detail)[:300]}
        return fn
    return wrap


# First: a multi-worker strategy must be made before other TF ops run.
@guard("multi_worker_reduce")
def _():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    scalar = strategy.run(lambda: tf.constant(1.0))
    try:
        strategy.reduce("MEAN", scalar, axis=0)
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        return True, e
    return False, "stock reduce(axis=0) of a scalar per replica works"


MIRRORED = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@guard("optimizer_sums_replicas")
def _():
    with MIRRORED.scope():
        v = keras.Variable(np.zeros(1, "float32"))
        opt = keras.optimizers.SGD(1.0)
        opt.build([v])

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            g = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            opt.apply_gradients([(tf.reshape(g, [1]), v)])
        MIRRORED.run(replica)
    step()
    # Gradients 1 and 2: applied as given -> -1 or -2; summed -> -3.
    value = float(v.numpy()[0])
    return value == -3.0, f"update {value}"


@guard("fit_steps_per_execution_cond")
def _():
    with MIRRORED.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.ones((16, 2), "float32")
    try:
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    except tf.errors.InvalidArgumentError as e:
        return "placeholder" in str(e), e
    return False, "Keras fit with steps_per_execution=2 ran on 2 replicas"


@guard("distributed_iterator_not_trackable")
def _():
    data = tf.data.Dataset.range(8).batch(2)
    iterator = iter(MIRRORED.experimental_distribute_dataset(data))
    trackable = compat.is_trackable(iterator)
    return not trackable, type(iterator).__name__


@guard("keras_loss_scales_by_replicas")
def _():
    loss = keras.losses.MeanSquaredError()

    @tf.function
    def run():
        return MIRRORED.run(lambda: loss(tf.ones([2, 1]), tf.zeros([2, 1])))
    value = float(MIRRORED.experimental_local_results(run())[0])
    return value == 0.5, f"per-replica loss {value} (unscaled: 1.0)"


@guard("from_function_cardinality_per_replica")
def _():
    # 10 global steps of 2 per-replica batches on 2 replicas.
    stock = MIRRORED.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(40).batch(2))
    steps = sum(1 for _ in stock)
    return int(stock.cardinality) == 2 * steps, (
        f"cardinality {stock.cardinality} for {steps} steps")


@guard("batchnorm_statistics_per_replica")
def _():
    # Stock strategy, plain fit: each replica updates its own copy.
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    with MIRRORED.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.BatchNormalization()])
        model.compile("sgd", "mse")
    model.fit(x, x, batch_size=16, epochs=1, verbose=0)
    copies = [t.numpy() for t in MIRRORED.experimental_local_results(
        model.layers[0].moving_mean.value)]
    spread = float(np.max(np.abs(copies[0] - copies[1])))
    return spread > 1e-4, f"replica copies {spread:.3g} apart"


@guard("keras_random_alike_on_every_replica")
def _():
    # compat.draw_seeds_per_replica
    with MIRRORED.scope():
        gen = keras.random.SeedGenerator(1337)
        drop = keras.layers.Dropout(0.5)

    @tf.function
    def draw():
        return MIRRORED.run(lambda: (keras.random.normal((8,), seed=gen),
                                     drop(tf.ones((1, 16)), training=True)))

    normals, masks = draw()
    a, b = [v.numpy() for v in MIRRORED.experimental_local_results(normals)]
    m, n = [v.numpy() for v in MIRRORED.experimental_local_results(masks)]
    return bool(np.array_equal(a, b) and np.array_equal(m, n)), (
        f"replica 0 draws {a[:3]}, replica 1 {b[:3]}")


@guard("model_without_call_not_built")
def _():
    # compat.build_models_without_call: the keras-io GAN's shape, a model
    # that only calls built sub-models in its train_step.
    class Pair(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = keras.Sequential([keras.Input((2,)),
                                           keras.layers.Dense(1)])

        def train_step(self, data):
            return {"out": tf.reduce_sum(self.inner(data))}

    with MIRRORED.scope():
        model = Pair()
        model.compile()
    try:
        model.fit(np.ones((4, 2), "float32"), batch_size=4, epochs=1,
                  verbose=0)
    except RuntimeError as e:
        return "Unable to automatically build the model" in str(e), e
    return False, "stock fit builds a model without call under a strategy"


print(json.dumps(results), flush=True)
