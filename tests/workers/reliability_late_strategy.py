"""Runs a TensorFlow op, then asks for a multi_worker strategy: prints the
error (ERROR <type>: <message>) instead of joining a cluster.

Usage: reliability_late_strategy.py  (TF_CONFIG from the environment)
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

print(float(tf.constant(1.0) + 1.0))
try:
    tfmulti.create_strategy("multi_worker")
    print("NO ERROR")
except RuntimeError as e:
    print(f"ERROR {type(e).__name__}: {e}")
