"""A training process under `tfmulti-launch --data_workers N`.

Usage: data_service_launch_child.py OUT_JSON. Evaluates 300 ids through the
service `TFMULTI_DATA_SERVICE` names (no `service=` argument) on one device
and writes the ids it saw with weight 1 and the address it used.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
ids = tf.range(300, dtype=tf.int64)
data = tfmulti.distribute_dataset(
    strategy, lambda _: tf.data.Dataset.from_tensor_slices((ids, ids)),
    global_batch_size=32, training=False)
seen = []
for features, _, weight in data:
    seen += features.numpy()[weight.numpy() == 1].tolist()
with open(sys.argv[1], "w") as f:
    json.dump({"ids": seen, "address": os.environ["TFMULTI_DATA_SERVICE"]},
              f)
