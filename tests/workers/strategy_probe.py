"""Creates every strategy on N simulated CPU devices and reports what it got.

Usage: strategy_probe.py N  (prints one JSON line prefixed with RESULT)
"""

import json
import sys

import tfmulti

count = int(sys.argv[1])
devices = tfmulti.simulate_devices(count)
result = {"devices": devices, "created": {}, "errors": {}}


def _tf_class(strategy):
    # tfmulti subclasses TF's strategies for Keras compatibility.
    return next(c.__name__ for c in type(strategy).__mro__
                if c.__module__.startswith("tensorflow"))


for name in ("auto", "one_device", "mirrored"):
    s = tfmulti.create_strategy(name, cluster=tfmulti.ClusterConfig())
    result["created"][name] = [_tf_class(s), s.num_replicas_in_sync]
import warnings  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    s = tfmulti.create_strategy("mirrored", devices=devices[:1],
                                all_reduce="reduce_to_one",
                                pack_bytes=1 << 20, timeout_seconds=30)
    default = tfmulti.create_strategy("mirrored", devices=devices[:1],
                                      timeout_seconds=30)
# An explicit per-collective timeout warns once per process (issue 19).
result["timeout_warnings"] = [str(w.message) for w in caught
                              if "timeout_seconds" in str(w.message)]
result["created"]["mirrored_subset"] = [_tf_class(s),
                                        s.num_replicas_in_sync]
opts = tfmulti.strategies.communication_options(s)
# Mirrored strategies over different device sets in one process: each
# all-reduce must use its own collective group (no abort, right sums).
import tensorflow as tf  # noqa: E402

sums = []
for n in sorted({1, min(2, count), count}):
    mirrored = tfmulti.create_strategy("mirrored", devices=devices[:n])
    per_replica = mirrored.run(lambda: tf.distribute.get_replica_context(
        ).all_reduce("SUM", tf.constant(1.0)))
    sums.append(float(mirrored.experimental_local_results(per_replica)[0]))
result["all_reduce_sums"] = sums
result["options"] = [opts.bytes_per_pack, opts.timeout_seconds]
result["default_bytes_per_pack"] = tfmulti.strategies.communication_options(
    default).bytes_per_pack
for label, kwargs in {
        "bad_name": dict(name="horovod"),
        "bad_algorithm": dict(name="mirrored", all_reduce="ring"),
        "nccl": dict(name="mirrored", all_reduce="nccl"),
        "gpus": dict(name="mirrored", num_gpus=2),
        "pack": dict(name="mirrored", pack_bytes=-1),
        "timeout": dict(name="mirrored", timeout_seconds=0),
        "stall": dict(name="mirrored", stall_timeout_seconds=-1),
}.items():
    try:
        tfmulti.create_strategy(**kwargs)
        result["errors"][label] = None
    except ValueError as e:
        result["errors"][label] = str(e)
try:
    tfmulti.simulate_devices(count + 1)
    result["errors"]["late"] = None
except RuntimeError as e:
    result["errors"]["late"] = str(e)
# Same layout again is fine: nothing to change.
result["again"] = len(tfmulti.simulate_devices(count))
print("RESULT " + json.dumps(result))
