"""A training process reading through a tf.data service that loses servers.

Usage: data_service_fault_reader.py OUT_JSON ADDRESS. Reads 60 global
batches of 20 (3 epochs of 400 ids, one device) whose preprocessing takes a
few ms per element on the data workers; prints `batch 25` and `batch 45`
and waits for a line on stdin there (the test kills a server meanwhile).
Writes every id read, in order, and `service.losses()`.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti.data import service  # noqa: E402


def slow(x, y):
    m = tf.random.normal([64, 64])
    for _ in range(4):
        m = tf.matmul(m, m) / 64.0
    return x + tf.cast(tf.reduce_sum(m) * 0.0, tf.int64), y


strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
ids = tf.range(400, dtype=tf.int64)
data = tfmulti.distribute_dataset(
    strategy, lambda _: tf.data.Dataset.from_tensor_slices((ids, ids)),
    global_batch_size=20, map_fn=slow, shuffle_buffer=0,
    service=sys.argv[2])
iterator = iter(data)
seen = []
for batch in range(60):
    features, _ = next(iterator)
    seen += features.numpy().tolist()
    if batch in (25, 45):
        print(f"batch {batch}", flush=True)
        input()
with open(sys.argv[1], "w") as f:
    json.dump({"ids": seen, "losses": service.losses()}, f)
