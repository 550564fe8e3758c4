"""The issue-16 spike: what of Keras 3 runs under ParameterServerStrategy.

Run as every role of a loopback cluster (chief + 2 workers + 1 ps; see
`tests/test_parameter_server.py::PsCluster`): the worker and ps tasks run a
`tf.distribute.Server`, the chief tries each part below and prints
"--- NAME: OK" or "--- NAME: FAIL <exception>". BUILD_NOTES (issue 16)
records the result.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
if task["type"] in ("worker", "ps"):
    tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]),
                         job_name=task["type"], task_index=task["index"],
                         protocol="grpc", start=True).join()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmulti import models  # noqa: E402

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                     reduction=None)


def part(name, fn):
    print(f"=== {name}", flush=True)
    try:
        fn()
        print(f"--- {name}: OK", flush=True)
    except Exception as e:  # noqa: BLE001 (the spike records every failure)
        print(f"--- {name}: FAIL {type(e).__name__}: {str(e)[:700]}",
              flush=True)
        traceback.print_exc(limit=-3)


def images(ctx):
    del ctx
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(256, 32, 32, 3)).astype("uint8")
    y = rng.integers(0, 10, 256).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(images)


iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
with strategy.scope():
    model = models.small_cnn()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer.build(model.trainable_variables)
    applied = tf.Variable(tf.zeros([8], tf.int32))


def grads_of(batch):
    x, y = batch
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(
            loss_fn(y, model(x, training=True)), global_batch_size=16)
    return loss, tape.gradient(loss, model.trainable_variables)


def variables_on_ps():
    for v in model.variables[:2] + optimizer.variables[:2]:
        print(v.path, type(v.value).__name__, v.value.device)


def keras_model_scheduled():
    @tf.function
    def step(it):
        def replica(batch):
            loss, grads = grads_of(batch)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return strategy.run(replica, args=(next(it),))
    remote = [coordinator.schedule(step, args=(iterator,)) for _ in range(6)]
    coordinator.join()
    print("losses", [round(float(r.fetch()), 3) for r in remote],
          "iterations", int(optimizer.iterations.numpy()))


def cond_in_replica_context():
    @tf.function
    def step(it, cid):
        def replica(batch):
            _, grads = grads_of(batch)

            def apply():
                optimizer.apply(grads, model.trainable_variables)
                return tf.constant(True)
            return tf.cond(tf.equal(applied[cid], 0), apply,
                           lambda: tf.constant(False))
        return strategy.run(replica, args=(next(it),))
    coordinator.schedule(step, args=(iterator, tf.constant(0)))
    coordinator.join()


def cond_in_cross_replica_context():
    @tf.function
    def step(it, cid):
        _, grads = strategy.run(grads_of, args=(next(it),))

        def apply():
            strategy.run(lambda g: optimizer.apply(
                g, model.trainable_variables), args=(grads,))
            applied.scatter_nd_add([[cid]], [1])
            return tf.constant(True)
        with tf.device(applied.device):
            return tf.cond(tf.equal(applied[cid], 0), apply,
                           lambda: tf.constant(False))
    before = int(optimizer.iterations.numpy())
    remote = [coordinator.schedule(step, args=(iterator, tf.constant(i)))
              for i in (0, 1, 2, 0, 1)]  # the repeats must be skipped
    coordinator.join()
    print("applied", [bool(r.fetch()) for r in remote], "iterations added",
          int(optimizer.iterations.numpy()) - before)


def keras_fit():
    with strategy.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        m.compile(keras.optimizers.SGD(0.1), loss_fn)
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((64, 8), "float32"), np.zeros(64, "int32"))).repeat()
    m.fit(data.batch(16), steps_per_epoch=2, epochs=1, verbose=0)


def keras_dataset_creator():
    return keras.utils.experimental.DatasetCreator


def partitioned_embedding():
    sharded = tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=(
            tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=1024, max_shards=2)))
    sharded_coordinator = tf.distribute.coordinator.ClusterCoordinator(
        sharded)
    with sharded.scope():
        emb_model = keras.Sequential([
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(1000, 8), keras.layers.Flatten(),
            keras.layers.Dense(3)])
        emb_optimizer = keras.optimizers.Adam(0.01)
        emb_optimizer.build(emb_model.trainable_variables)
    table = emb_model.layers[0].embeddings
    print("embedding", type(table).__name__, "->", type(table.value).__name__,
          [s.device for s in getattr(table.value, "variables", [])])
    print("slot", type(emb_optimizer.variables[1].value).__name__)

    def ids(ctx):
        del ctx
        x = np.arange(64 * 4).reshape(64, 4).astype("int32") % 1000
        return tf.data.Dataset.from_tensor_slices(
            (x, np.zeros(64, "int32"))).repeat().batch(8)

    it = iter(sharded_coordinator.create_per_worker_dataset(tf.function(
        lambda: sharded.distribute_datasets_from_function(ids))))

    step = embedding_step(sharded, emb_model, emb_optimizer, shard_gradients=(
        bool(os.environ.get("PS_SPIKE_SHARD_GRADIENTS"))))
    before = table.numpy().copy()
    remote = [sharded_coordinator.schedule(step, args=(it,))
              for _ in range(3)]
    sharded_coordinator.join()
    print("losses", [round(float(r.fetch()), 3) for r in remote],
          "embedding rows changed",
          int(np.sum(np.any(table.numpy() != before, axis=1))))
    path = tf.train.Checkpoint(model=emb_model).save("/tmp/ps_spike_ckpt/c")
    print("checkpoint", path)


def embedding_step(sharded, emb_model, emb_optimizer, *, shard_gradients):
    """A train step of the embedding model. With `shard_gradients`, the
    workaround tried: differentiate w.r.t. the shards (tf.Variables),
    concatenate them to the table's shape, apply with the Keras optimizer."""
    keras_vars = emb_model.trainable_variables
    sources = [getattr(v.value, "variables", [v.value]) for v in keras_vars]

    def gradients(tape, loss):
        if not shard_gradients:
            return tape.gradient(loss, keras_vars)
        flat = tape.gradient(loss, [s for group in sources for s in group])
        grads, i = [], 0
        for group in sources:
            parts = [tf.convert_to_tensor(g) for g in flat[i:i + len(group)]]
            grads.append(parts[0] if len(parts) == 1 else
                         tf.concat(parts, axis=0))
            i += len(group)
        return grads

    @tf.function
    def step(iterator):
        def replica(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, emb_model(x)))
            emb_optimizer.apply(gradients(tape, loss), keras_vars)
            return loss
        return sharded.run(replica, args=(next(iterator),))
    return step


if os.environ.get("PS_SPIKE_SHARD_GRADIENTS"):
    part("variable_partitioner: gradients w.r.t. the shards",
         partitioned_embedding)
    sys.exit(0)
part("variables of a Keras 3 model and optimizer", variables_on_ps)
part("Keras 3 small_cnn step scheduled on the coordinator",
     keras_model_scheduled)
part("tf.cond around optimizer.apply in replica context",
     cond_in_replica_context)
part("tf.cond around strategy.run(apply) in cross-replica context",
     cond_in_cross_replica_context)
part("keras Model.fit under ParameterServerStrategy", keras_fit)
part("keras.utils.experimental.DatasetCreator", keras_dataset_creator)
part("variable_partitioner: Keras Embedding, Adam, checkpoint",
     partitioned_embedding)
sys.exit(0)
