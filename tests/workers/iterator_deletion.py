"""How many tf.data iterator deletions block (the lost wakeup of the
autotune thread; see `tfmulti.compat`, "Deleting an autotuned tf.data
iterator").

Usage: iterator_deletion.py NUM_ITERATORS AGE_SECONDS [--no-plain]
Three kinds, NUM_ITERATORS each, over an autotuned dataset: plain
iterators (unless --no-plain: they block for up to 60 s each on TF 2.18
and 2.20, and the guard test asserts nothing of them) and iterators
distributed over 2 mirrored CPU replicas by the stock strategy (made before
tfmulti.compat is imported), then distributed iterators made after it (with
its workaround). Each kind is read for
AGE_SECONDS (autotune periods grow), then deleted one by one until one
deletion takes over 1 s (each later one would wait longer). Prints one
JSON line {"blocked": {kind: [seconds of the blocked deletion]}} and exits
without deleting what is left.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

NUM, AGE = int(sys.argv[1]), float(sys.argv[2])
KINDS = ("stock_distributed",) if "--no-plain" in sys.argv[3:] else (
    "plain", "stock_distributed")
devices = tfmulti.simulate_devices(2)
assert "tfmulti.compat" not in sys.modules

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MirroredStrategy(devices)
dataset = tf.data.Dataset.range(10**9).map(
    lambda x: x * 2, num_parallel_calls=tf.data.AUTOTUNE).batch(4).prefetch(
        tf.data.AUTOTUNE)


def blocked_deletions(iterators):
    began = time.time()
    while time.time() - began < AGE:
        for iterator in iterators:
            next(iterator)
        time.sleep(0.05)
    while iterators:
        iterator = iterators.pop()
        start = time.perf_counter()
        del iterator
        seconds = time.perf_counter() - start
        if seconds > 1.0:
            return [round(seconds, 1)]
    return []


# Kept to the end: deleting them at exit would block too.
kept = []
blocked = {}
for kind in KINDS:
    iterators = [iter(dataset) if kind == "plain" else
                 iter(strategy.experimental_distribute_dataset(dataset))
                 for _ in range(NUM)]
    blocked[kind] = blocked_deletions(iterators)
    kept.append(iterators)

from tfmulti import compat  # noqa: E402  (installs the workaround)

blocked["tfmulti_distributed"] = blocked_deletions(
    [iter(strategy.experimental_distribute_dataset(dataset))
     for _ in range(NUM)])
print(json.dumps({"tensorflow": tf.__version__,
                  "workaround": not compat.distributed_input_autotuned(),
                  "blocked": blocked}), flush=True)
os._exit(0)
