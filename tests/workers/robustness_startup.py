"""Creates the multi_worker strategy with a start-up bound, then one all-reduce.

Usage: robustness_startup.py STARTUP_TIMEOUT_SECONDS|env [hold_port_on_0]
(cluster from TF_CONFIG). `env` leaves the bound to $TFMULTI_STARTUP_TIMEOUT
(as tfmulti-launch sets it); `hold_port_on_0` makes worker 0 listen on its
own port first, as a leftover process of an earlier run would.
Prints `JOINED <sum>` when the cluster formed; errors go out as raised.
"""

import json
import os
import socket
import sys
import time

import tfmulti

began = time.monotonic()
if sys.argv[2:] == ["hold_port_on_0"]:
    config = json.loads(os.environ["TF_CONFIG"])
    if config["task"]["index"] == 0:
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", int(
            config["cluster"]["worker"][0].rpartition(":")[2])))
        squatter.listen(8)
strategy = tfmulti.create_strategy(
    "multi_worker", startup_timeout_seconds=None if sys.argv[1] == "env"
    else float(sys.argv[1]))
import tensorflow as tf  # noqa: E402  (after the strategy, as it must be)

total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)),
                        axis=None)
print(f"JOINED {float(total)} after {time.monotonic() - began:.1f} s",
      flush=True)
