"""Creates the multi_worker strategy with a start-up bound, then one all-reduce.

Usage: robustness_startup.py STARTUP_TIMEOUT_SECONDS (cluster from TF_CONFIG)
Prints `JOINED <sum>` when the cluster formed; errors go out as raised.
"""

import sys
import time

import tfmulti

began = time.monotonic()
strategy = tfmulti.create_strategy(
    "multi_worker", startup_timeout_seconds=float(sys.argv[1]))
import tensorflow as tf  # noqa: E402  (after the strategy, as it must be)

total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)),
                        axis=None)
print(f"JOINED {float(total)} after {time.monotonic() - began:.1f} s",
      flush=True)
