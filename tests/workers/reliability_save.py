"""Saves a 128 MiB variable as checkpoint 1, then (value 2.0) as checkpoint 2,
printing SAVED n after each; the test kills it during the second save.

Usage: reliability_save.py MODEL_DIR
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from tfmulti.training import Checkpointer  # noqa: E402

variable = tf.Variable(tf.ones([1 << 25]))
checkpointer = Checkpointer(sys.argv[1],
                            tf.distribute.get_strategy(), value=variable)
checkpointer.save(1)
print("SAVED 1", flush=True)
variable.assign(tf.fill([1 << 25], 2.0))
checkpointer.save(2)
print("SAVED 2", flush=True)
