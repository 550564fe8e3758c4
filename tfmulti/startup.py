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

Neither wait is silent: a few seconds after it starts, and then at
intervals, the worker prints one line to stderr naming what it waits for
(the hosts that do not resolve, the tasks whose port does not answer) and
how long it will still wait; once the cluster has formed it prints one
`tfmulti: ... joined the cluster` line (which `tfmulti-launch` watches for).
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
# Overrides the default for every worker of a job (`tfmulti-launch` sets it
# to a short bound: its workers start together on one machine).
STARTUP_TIMEOUT_ENV = "TFMULTI_STARTUP_TIMEOUT"
# Where an operator sets the bound, named in every start-up message.
BOUND_NAMES = ("`create_strategy(startup_timeout_seconds=...)`, recipes' "
               f"--startup_timeout, ${STARTUP_TIMEOUT_ENV}")
_RETRY_SECONDS = 1.0
# A waiting worker's first line comes this soon, then one every
# `_REPORT_EVERY_SECONDS` (both at most a quarter of the bound, so a short
# bound still shows a few lines before it gives up).
_FIRST_REPORT_SECONDS = 5.0
_REPORT_EVERY_SECONDS = 30.0
# `tfmulti-launch` reads this from a worker's output: it has started.
JOINED_MARKER = "joined the cluster"


def startup_timeout_seconds(value: float | None = None, *,
                            environ=None) -> float:
    """The start-up bound: `value`, else $TFMULTI_STARTUP_TIMEOUT, else 600.

    Raises:
      ValueError: the value (or the variable) is not a positive number.
    """
    environ = os.environ if environ is None else environ
    where = "`startup_timeout_seconds`"
    if value is None and environ.get(STARTUP_TIMEOUT_ENV):
        where, value = f"`{STARTUP_TIMEOUT_ENV}`", environ[STARTUP_TIMEOUT_ENV]
        try:
            value = float(value)
        except ValueError:
            pass
    if value is None:
        return DEFAULT_STARTUP_TIMEOUT_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            not 0 < value < float("inf")):
        raise ValueError(
            f"{where} should be a positive number of seconds, got {value!r}. "
            f"Give how long a worker may wait for its peers at start-up "
            f"(default {DEFAULT_STARTUP_TIMEOUT_SECONDS:g}).")
    return float(value)


def report_schedule(timeout_seconds: float) -> tuple[float, float]:
    """(first, every): when a waiting worker first reports, then how often."""
    quarter = timeout_seconds / 4
    return (min(_FIRST_REPORT_SECONDS, quarter),
            min(_REPORT_EVERY_SECONDS, quarter))


def _me(cluster):
    address = cluster.cluster[cluster.task_type][cluster.task_index]
    return f"`cluster.{cluster.task_type}[{cluster.task_index}]` {address!r}"


def until(began: float, timeout_seconds: float) -> str:
    """How long a wait begun at `began` (monotonic) has left, for a log line.

    Returns:
      e.g. "waited 5 s, gives up in 595 s (at 17:55:03 UTC; bound 600 s:
      <where it is set>)".
    """
    waited = time.monotonic() - began
    at = time.strftime("%H:%M:%S UTC", time.gmtime(
        time.time() + timeout_seconds - waited))
    return (f"waited {waited:.0f} s, gives up in "
            f"{max(0.0, timeout_seconds - waited):.0f} s (at {at}; bound "
            f"{timeout_seconds:g} s: {BOUND_NAMES})")


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
    began = time.monotonic()
    deadline = began + timeout_seconds
    first, every = report_schedule(timeout_seconds)
    report_at = began + first
    pending = _addresses(cluster)

    def names():
        return ", ".join(f"{where} {a!r} (host {_host_port(a)[0]!r})"
                         for where, a in pending)

    while True:
        pending = [(where, a) for where, a in pending
                   if not _resolves(_host_port(a)[0])]
        now = time.monotonic()
        if not pending or now >= deadline:
            break
        if now >= report_at:
            report_at += every
            print(f"tfmulti: this worker ({_me(cluster)}) is waiting for "
                  f"hostname(s) to resolve: {names()}; {until(began, timeout_seconds)}.",
                  file=sys.stderr, flush=True)
        time.sleep(min(_RETRY_SECONDS, max(0.0, deadline - now)))
    if pending:
        raise ValueError(
            f"The cluster's hostname(s) did not resolve within "
            f"{timeout_seconds:g} s: {names()}. Fix the address in TF_CONFIG "
            "(or the SLURM/Kubernetes variables it came from); on "
            "Kubernetes the pods need a headless Service of that name. "
            f"The wait is {BOUND_NAMES}.")


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
    connections, then SIGKILLs this process. While it waits it prints a
    line naming the peers whose port does not answer, on
    `report_schedule(timeout_seconds)`; once the block ends without an
    error this process prints that it joined.
    """
    me = cluster.cluster[cluster.task_type][cluster.task_index]
    first, every = report_schedule(timeout_seconds)
    began = time.monotonic()
    watchdog = subprocess.Popen(
        [sys.executable, _WATCHDOG, str(os.getpid()), str(timeout_seconds),
         f"{first:g}", f"{every:g}", _me(cluster),
         *[f"{where}|{a}" for where, a in _addresses(cluster) if a != me]],
        stdin=subprocess.PIPE)
    try:
        yield
        tasks = sum(len(a) for a in cluster.cluster.values())
        print(f"tfmulti: this worker ({_me(cluster)}) {JOINED_MARKER} of "
              f"{tasks} tasks after {time.monotonic() - began:.1f} s.",
              file=sys.stderr, flush=True)
    finally:
        try:
            watchdog.stdin.write(b"done\n")
            watchdog.stdin.close()
        except BrokenPipeError:
            pass
        watchdog.wait()
