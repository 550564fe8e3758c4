"""Cluster start-up under bad addresses: bounded, and naming the host or port.

Real worker processes on loopback; a real socket holds the port in use.
"""

import json
import os
import socket
import sys
import time

import pytest

from tests import subproc
from tfmulti import cluster as cluster_lib
from tfmulti import strategies

WORKER = "tests/workers/robustness_startup.py"
BOUND = 8  # seconds: startup_timeout_seconds in these runs


def _tf_config(addresses, index):
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


@pytest.mark.slow
def test_unresolvable_peer_and_busy_port_fail_within_the_bound(tmp_path):
    p0, p1, p2 = cluster_lib._distinct_free_ports("127.0.0.1", 3)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", p0))
    squatter.listen(8)  # accepts TCP, speaks no gRPC
    busy = [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]
    unresolvable = [f"127.0.0.1:{p2}", "no-such-host.invalid:2222"]
    procs = []
    try:
        began = time.monotonic()
        for addresses, index in ((busy, 0), (busy, 1), (unresolvable, 0)):
            procs.append(subproc._start(
                [sys.executable, WORKER, str(BOUND)],
                dict(os.environ, TF_CONFIG=_tf_config(addresses, index))))
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            results.append((proc.returncode, out,
                            time.monotonic() - began))
    finally:
        squatter.close()
        for proc in procs:
            subproc._kill(proc)
    (rc0, out0, _), (rc1, out1, t1), (rc2, out2, t2) = results
    # The task whose port is taken: an error naming the port.
    assert rc0 == 1, out0
    assert (f"Port {p0} of this task (`cluster.worker[0]` = "
            f"'127.0.0.1:{p0}') is already in use") in out0
    # Its peer: ends after the bound, naming the task it waited for.
    assert rc1 == -9, out1  # SIGKILL: TensorFlow ignores SIGTERM there
    assert "waited 8 s for the cluster to form and gave up" in out1
    assert f"`cluster.worker[0]` '127.0.0.1:{p0}'" in out1
    assert "JOINED" not in out1
    # The unresolvable peer: named, within the bound (+ start-up).
    assert rc2 == 1, out2
    assert ("hostname(s) did not resolve within 8 s: `cluster.worker[1]` "
            "'no-such-host.invalid:2222' (host 'no-such-host.invalid')"
            ) in out2
    assert max(t1, t2) < 280


def test_single_process_strategy_in_a_cluster_is_refused():
    cluster = cluster_lib.ClusterConfig(
        cluster={"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]},
        task_type="worker", task_index=1)
    for name in ("mirrored", "one_device"):
        with pytest.raises(ValueError, match=(
                f"`name` is '{name}', a single-process strategy, but this "
                "process is worker 1 of a cluster of 2 workers")):
            strategies.create_strategy(name, cluster=cluster)


@pytest.mark.parametrize("environ, message", [
    (dict(TFMULTI_PORT="abc"),
     "`TFMULTI_PORT` should be a port number in [1, 65535], got 'abc'"),
    (dict(TFMULTI_WORKER_HOST="trainer-{index}.{service}"),
     "`TFMULTI_WORKER_HOST` is 'trainer-{index}.{service}', which has a "
     "field other than '{index}'"),
])
def test_bad_kubernetes_variables_are_named(environ, message):
    base = dict(TFMULTI_NUM_WORKERS="2", JOB_COMPLETION_INDEX="0",
                TFMULTI_WORKER_HOST="trainer-{index}.trainer")
    with pytest.raises(ValueError) as e:
        cluster_lib.cluster_config(environ={**base, **environ})
    assert message in str(e.value)
