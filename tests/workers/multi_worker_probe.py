"""create_strategy('auto') in a worker of a loopback cluster (TF_CONFIG set)."""

import json

import tfmulti

s = tfmulti.create_strategy("auto", all_reduce="ring", timeout_seconds=60)
print("RESULT " + json.dumps([type(s).__name__, s.num_replicas_in_sync,
                              tfmulti.cluster_config().is_chief]))
