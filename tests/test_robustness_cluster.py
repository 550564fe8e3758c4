"""Cluster start-up under bad addresses: bounded, and naming the host or port.

Real worker processes on loopback; a real socket holds the port in use.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests import subproc
from tfmulti import cluster as cluster_lib
from tfmulti import startup
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
    # Neither wait is silent: from a quarter of the bound on (2 s here; 5 s
    # at the default bounds), every quarter, one line says what the worker
    # waits for and for how much longer.
    _assert_waiting_lines(out1, (
        f"this worker (`cluster.worker[1]` '127.0.0.1:{p1}') is waiting for "
        "the cluster to form: every peer's port answers (`cluster.worker[0]` "
        f"'127.0.0.1:{p0}'), waiting for them to join; "))
    _assert_waiting_lines(out2, (
        f"this worker (`cluster.worker[0]` '127.0.0.1:{p2}') is waiting for "
        "hostname(s) to resolve: `cluster.worker[1]` "
        "'no-such-host.invalid:2222' (host 'no-such-host.invalid'); "))


def _assert_waiting_lines(out, what):
    lines = [line for line in out.splitlines()
             if line.startswith(f"tfmulti: {what}")]
    tail = (r"waited (\d+) s, gives up in (\d+) s \(at \d\d:\d\d:\d\d UTC; "
            r"bound 8 s: `create_strategy\(startup_timeout_seconds=...\)`, "
            r"recipes' --startup_timeout, \$TFMULTI_STARTUP_TIMEOUT\)\.$")
    times = [re.search(tail, line) for line in lines]
    assert len(lines) >= 2 and all(times), out
    waited = [int(m.group(1)) for m in times]
    # The first line within a few seconds; each says the time left.
    assert 2 <= waited[0] <= 4, out
    assert all(int(m.group(1)) + int(m.group(2)) == 8 for m in times), out


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


@pytest.mark.slow
def test_launcher_stops_the_group_at_once_when_a_worker_fails_at_start():
    # Worker 0's port is taken (by itself: a leftover of an earlier run
    # would do the same); worker 1 would wait for it inside TensorFlow's
    # join, up to the launcher's 120 s start-up bound.
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers", "2", "--",
         sys.executable, WORKER, "env", "hold_port_on_0"],
        capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - began
    print(f"launcher start-up failure after {seconds:.1f} s")
    assert result.returncode == 1, result.stderr
    assert re.search(
        r"tfmulti-launch: worker 0 exited with code 1 during start-up, "
        r"before the cluster formed: ValueError: Port (\d+) of this task "
        r"\(`cluster.worker\[0\]` = '127.0.0.1:\1'\) is already in use by "
        r"another process, .*; stopping the other 1 process\(es\) at once "
        r"\(SIGKILL: they wait for it inside TensorFlow, with nothing to "
        r"save\)\n", result.stderr), result.stderr
    assert re.search(r"exited: w0 1, w1 SIG(KILL|TERM); 0 restart\(s\)",
                     result.stderr), result.stderr
    assert "JOINED" not in result.stdout
    # Far within the 120 s start-up bound: the time two workers take to
    # import TensorFlow on a loaded machine (measured 19 s at load 20).
    assert seconds < 90, (seconds, result.stderr)


def test_startup_timeout_from_the_argument_the_environment_or_600():
    env = {startup.STARTUP_TIMEOUT_ENV: "120"}
    assert startup.startup_timeout_seconds(None, environ={}) == 600
    assert startup.startup_timeout_seconds(None, environ=env) == 120
    assert startup.startup_timeout_seconds(30, environ=env) == 30
    with pytest.raises(ValueError, match=(
            "`TFMULTI_STARTUP_TIMEOUT` should be a positive number of "
            "seconds, got 'soon'")):
        startup.startup_timeout_seconds(
            None, environ={startup.STARTUP_TIMEOUT_ENV: "soon"})
    with pytest.raises(ValueError, match=(
            "`startup_timeout_seconds` should be a positive number of "
            "seconds, got 0")):
        strategies.create_strategy("multi_worker", startup_timeout_seconds=0)
    # When a waiting worker speaks: first after 5 s (a quarter of a short
    # bound), then every 30 s (or quarter).
    assert startup.report_schedule(600) == (5, 30)
    assert startup.report_schedule(120) == (5, 30)
    assert startup.report_schedule(8) == (2, 2)


def test_launcher_gives_its_workers_a_short_startup_bound():
    show = [sys.executable, "-c", "import os; print('bound', os.environ["
            f"{startup.STARTUP_TIMEOUT_ENV!r}])"]
    env = {k: v for k, v in os.environ.items()
           if k != startup.STARTUP_TIMEOUT_ENV}
    for extra, bound in (({}, "120"), ({startup.STARTUP_TIMEOUT_ENV: "900"},
                                       "900")):
        result = subprocess.run(
            [sys.executable, "-m", "tfmulti.launch", "--workers", "1", "--",
             *show], capture_output=True, text=True, timeout=60,
            env={**env, **extra})
        assert f"[w0] bound {bound}\n" in result.stdout, result
