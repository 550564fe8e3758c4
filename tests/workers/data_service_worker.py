"""One process of the tf.data service tests.

Usage: data_service_worker.py OUT_JSON STRATEGY ADDRESS [TFDS_DATA_DIR]
('{index}' in OUT_JSON becomes the worker index). STRATEGY is `mirrored4` (4 simulated
replicas, one input pipeline: a plain `dataset_fn`) or `multi_worker`
(TF_CONFIG from the environment: the same examples from 8 TFRecord files
through `files_dataset_fn`, sharded by file, as a service requires with
several input pipelines; a plain `dataset_fn` there is an error).

Through `distribute_dataset(..., service=ADDRESS)`:
- evaluation of a fixed model on 1001 synthetic examples, each carrying
  its id as a 9th feature (the model's kernel row for it is zero): the ids
  seen with weight 1, Keras `evaluate` with weighted metrics, and the same
  on one device (all examples in one batch, no pipeline, no service);
- training: the ids of two epochs' batches (96 examples, global batch 16),
  and a short Keras `fit` on the stream;
- the error for an address where nothing listens;
- with TFDS_DATA_DIR: 200 `tfmulti_shapes` test examples through
  `tfds_dataset_fn` (one file: one data worker reads it all, the other
  nothing) and without the service, as (pixel sum, label) pairs.
"""

import json
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

MODE, ADDRESS = sys.argv[2], sys.argv[3]
if MODE == "mirrored4":
    tfmulti.simulate_devices(4)
strategy = tfmulti.create_strategy(
    {"mirrored4": "mirrored"}.get(MODE, MODE))
OUT = sys.argv[1].format(index=tfmulti.cluster_config().task_index)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from golden_data import compiled_eval_model  # noqa: E402

from tfmulti.data import service as service_lib  # noqa: E402

rng = np.random.default_rng(0)
x = np.concatenate([rng.normal(size=(1001, 8)),
                    np.arange(1001)[:, None]], 1).astype("float32")
y = rng.integers(0, 4, size=(1001,)).astype("int64")
kernel = rng.normal(scale=0.5, size=(9, 16)).astype("float32")
kernel[8] = 0.0  # the id feature does not change the logits
weights = [kernel, *(rng.normal(scale=0.5, size=s).astype("float32")
                     for s in [(16,), (16, 4), (4,)])]


def compiled_model(scope_strategy):
    return compiled_eval_model(
        scope_strategy, (9,), [keras.layers.Dense(16, activation="relu"),
                               keras.layers.Dense(4)], weights,
        optimizer=keras.optimizers.SGD(0.01))


def local_values(value):
    return np.concatenate([t.numpy().reshape(-1) for t in
                           strategy.experimental_local_results(value)])


result = {"replicas": strategy.num_replicas_in_sync}
golden = compiled_model(tf.distribute.OneDeviceStrategy("/cpu:0"))
result["golden"] = golden.evaluate(x, y, batch_size=len(x), verbose=0,
                                   return_dict=True)



def records(path, rows, files):
    """`files_dataset_fn` over x[rows], y[rows] written into `files` files."""
    os.makedirs(path, exist_ok=True)
    names = []
    for k, part in enumerate(np.array_split(np.arange(rows), files)):
        names.append(os.path.join(path, f"part-{k}.tfrecord"))
        with tf.io.TFRecordWriter(names[-1]) as writer:
            for i in part:
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={"x": tf.train.Feature(float_list=tf.train.
                                                   FloatList(value=x[i])),
                             "y": tf.train.Feature(int64_list=tf.train.
                                                   Int64List(value=[y[i]]))}
                )).SerializeToString())
    spec = {"x": tf.io.FixedLenFeature([9], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return example["x"], example["y"]
    return tfmulti.data.files_dataset_fn(names, parse_fn=parse)


def slices(rows):
    return lambda _: tf.data.Dataset.from_tensor_slices((x[:rows], y[:rows]))


if MODE == "multi_worker":
    base = os.path.join(os.path.dirname(OUT), f"records{os.getpid()}")
    eval_fn = records(os.path.join(base, "eval"), 1001, 8)
    train_fn = records(os.path.join(base, "train"), 96, 8)
    try:
        tfmulti.distribute_dataset(strategy, slices(96), global_batch_size=16,
                                   service=ADDRESS)
        result["element_sharding_error"] = None
    except ValueError as e:
        result["element_sharding_error"] = str(e)
else:
    eval_fn, train_fn = slices(1001), slices(96)

started = time.monotonic()
evaluation = tfmulti.distribute_dataset(
    strategy, eval_fn, global_batch_size=48, training=False, service=ADDRESS)
ids, steps = [], 0
for features, label, weight in evaluation:
    f, w = local_values(features).reshape(-1, 9), local_values(weight)
    ids += f[w == 1.0, 8].astype(int).tolist()
    steps += 1
result["eval_ids"], result["eval_steps"] = ids, steps
model = compiled_model(strategy)
result["evaluate"] = model.evaluate(evaluation, verbose=0, return_dict=True)

train = tfmulti.distribute_dataset(strategy, train_fn, global_batch_size=16,
                                   service=ADDRESS)
iterator = iter(train)
epochs = []
for _ in range(2):
    seen = []
    for _ in range(96 // 16):
        features, _ = next(iterator)
        seen += local_values(features).reshape(-1, 9)[:, 8].astype(
            int).tolist()
    epochs.append(seen)
result["train_ids"] = epochs
history = model.fit(train, epochs=1, steps_per_epoch=6, verbose=0)
result["fit_loss"] = history.history["loss"][-1]
result["seconds"] = time.monotonic() - started



def shapes_fingerprints(service):
    """(pixel sum, label) of each real example of one evaluation pass."""
    pairs = []
    for images, labels, weight in tfmulti.distribute_dataset(
            strategy, tfmulti.tfds_dataset_fn(
                "tfmulti_shapes", "test[:200]", data_dir=sys.argv[4]),
            global_batch_size=48, training=False, service=service):
        w = local_values(weight)
        pixel = np.concatenate([
            t.numpy().reshape(len(t), -1).sum(1, dtype=np.int64)
            for t in strategy.experimental_local_results(images)])
        label = local_values(labels)
        pairs += zip(pixel[w == 1.0].tolist(), label[w == 1.0].tolist())
    return sorted(pairs)


if len(sys.argv) > 4:
    result["tfds_service"] = shapes_fingerprints(ADDRESS)
    result["tfds_local"] = shapes_fingerprints("")

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
service_lib.CONNECT_TIMEOUT_SECONDS = 2.0
started = time.monotonic()
try:
    tfmulti.distribute_dataset(strategy, train_fn, global_batch_size=16,
                               service=f"127.0.0.1:{closed}")
    result["unreachable"] = None
except ConnectionError as e:
    result["unreachable"] = str(e)
result["unreachable_seconds"] = time.monotonic() - started
result["closed_port"] = closed

with open(OUT, "w") as f:
    json.dump(result, f)
