"""Bounds on a multi-worker job's start-up: every way it can hang fails in time.

TensorFlow's MultiWorkerMirroredStrategy waits, with no limit, for every
task of the cluster to join; a peer whose hostname does not resolve, a
worker whose port another process holds, or a peer that never starts leaves
the others blocked in C++ (TF 2.21 measured: over 10 minutes, SIGTERM
ignored; the coordination service's `cluster_register_timeout` bounds the
non-leaders only). So before TensorFlow starts its server this module checks
that every peer's hostname resolves and that this task's port is free, each
failing with an error naming the host or port; and it bounds the join itself
with a watchdog process that names the peers that did not answer and kills
the worker (no Python thread runs while TensorFlow waits there).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import subprocess
import time

# How long a worker waits for its peers to resolve and to join. Generous:
# on a shared cluster workers can start minutes apart (scheduling, image
# pulls), and DNS names of Kubernetes pods appear only once they run.
DEFAULT_STARTUP_TIMEOUT_SECONDS = 600.0
_RETRY_SECONDS = 1.0


def _host_port(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _addresses(cluster):
    """(`cluster.type[i]`, address) of every task."""
    return [(f"`cluster.{task_type}[{i}]`", address)
            for task_type, addresses in cluster.cluster.items()
            for i, address in enumerate(addresses)]


def _resolves(host):
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def check_hosts_resolve(cluster, *, timeout_seconds: float) -> None:
    """Waits until every task's hostname resolves, at most `timeout_seconds`.

    Args:
      cluster: a `tfmulti.ClusterConfig`.
      timeout_seconds: how long a name may take to appear (a Kubernetes
        pod's DNS record exists only once the pod runs).

    Raises:
      ValueError: naming the tasks whose hosts did not resolve in time.
    """
    deadline = time.monotonic() + timeout_seconds
    pending = _addresses(cluster)
    while True:
        pending = [(where, a) for where, a in pending
                   if not _resolves(_host_port(a)[0])]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(_RETRY_SECONDS)
    if pending:
        names = ", ".join(f"{where} {a!r} (host {_host_port(a)[0]!r})"
                          for where, a in pending)
        raise ValueError(
            f"The cluster's hostname(s) did not resolve within "
            f"{timeout_seconds:g} s: {names}. Fix the address in TF_CONFIG "
            "(or the SLURM/Kubernetes variables it came from); on "
            "Kubernetes the pods need a headless Service of that name. "
            "The wait is `create_strategy(startup_timeout_seconds=...)`.")


def check_port_free(cluster) -> None:
    """Raises ValueError if another process holds this task's port.

    TensorFlow would fail later with "Could not start gRPC server" and no
    port named, and its peers would wait for it.
    """
    if not cluster.cluster:
        return
    address = cluster.cluster[cluster.task_type][cluster.task_index]
    port = _host_port(address)[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # TIME_WAIT leftovers of a previous run do not stop gRPC either.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise ValueError(
                f"Port {port} of this task (`cluster.{cluster.task_type}"
                f"[{cluster.task_index}]` = {address!r}) is already in use "
                "by another process, so TensorFlow cannot start its server "
                f"there. Stop that process (`ss -ltnp 'sport = :{port}'` "
                "shows it) or give this task another port; a leftover "
                "worker of an earlier run is the usual cause.") from None


_WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "startup_watchdog.py")


@contextlib.contextmanager
def bounded_join(cluster, *, timeout_seconds: float):
    """Kills this process if the block (the cluster's join) outlasts the bound.

    The watchdog is a separate process (`startup_watchdog.py`): while
    TensorFlow waits for its peers no Python thread of this one runs. After
    `timeout_seconds` it prints which peers do and do not accept
    connections, then SIGKILLs this process.
    """
    me = cluster.cluster[cluster.task_type][cluster.task_index]
    watchdog = subprocess.Popen(
        [sys.executable, _WATCHDOG, str(os.getpid()), str(timeout_seconds),
         f"`cluster.{cluster.task_type}[{cluster.task_index}]` {me}",
         *[f"{where}|{a}" for where, a in _addresses(cluster) if a != me]],
        stdin=subprocess.PIPE)
    try:
        yield
    finally:
        try:
            watchdog.stdin.write(b"done\n")
            watchdog.stdin.close()
        except BrokenPipeError:
            pass
        watchdog.wait()
