"""tf.data service: preprocessing on data workers instead of the trainer.

TensorFlow's own engine (`tf.data.experimental.service`): a dispatcher hands
out splits of a dataset to data workers, which run the pipeline and stream
elements back to the training process. tfmulti uses DYNAMIC sharding: every
split goes to one data worker, so an element is produced at most once per
iteration, all of them when no data worker fails; the elements a killed
data worker had in flight are lost (not repeated) for that epoch.

Client side: `resolve_address` (the `service` argument or
`TFMULTI_DATA_SERVICE`), `check_reachable` (a bounded probe, so a missing
dispatcher is an error naming its address instead of TensorFlow's retry
loop that never ends) and `distribute`. Server side: `python -m
tfmulti.data.service dispatcher|worker|local ...` runs the real
`DispatchServer`/`WorkerServer` until SIGTERM; `tfmulti-launch
--data_workers N` and the cluster templates start it that way.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import time

# The dispatcher's address, `host:port` or `grpc://host:port`, for jobs that
# do not pass `service=` (tfmulti-launch --data_workers sets it).
ENV_VAR = "TFMULTI_DATA_SERVICE"
# How long a training process waits for the dispatcher's port at start
# (tfmulti-launch starts both at once; importing TF took 20 s at load 25).
CONNECT_TIMEOUT_SECONDS = 60.0
_ADDRESS = re.compile(r"^(?:grpc://)?(\[[0-9a-fA-F:]+\]|[\w.-]+):(\d{1,5})$")


def resolve_address(service: str | None) -> str | None:
    """The dispatcher address to use, `grpc://host:port`, or None.

    Args:
      service: an address (`host:port` or `grpc://host:port`), None to read
        `TFMULTI_DATA_SERVICE`, or "" for no service even if that is set.

    Raises:
      ValueError: an address that is not `host:port`.
    """
    what = "service"
    if service is None:
        service, what = os.environ.get(ENV_VAR) or None, ENV_VAR
        if service is None:
            return None
    if not isinstance(service, str):
        raise ValueError(
            f"`service` should be the tf.data service dispatcher's address "
            f"as a string, got {service!r}.")
    if service == "":
        return None
    match = _ADDRESS.match(service.strip())
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(
            f"`{what}` is {service!r}, which is not a dispatcher address. "
            "Give `host:port` or `grpc://host:port` (the address "
            "`python -m tfmulti.data.service dispatcher` prints), or leave "
            "it unset to read the data locally.")
    return f"grpc://{match.group(1)}:{match.group(2)}"


def check_reachable(address: str, *, timeout: float | None = None) -> None:
    """Waits up to `timeout` seconds (default `CONNECT_TIMEOUT_SECONDS`)
    for the dispatcher's port to accept connections.

    TensorFlow itself retries an unreachable dispatcher for as long as the
    job runs; this turns that into an error at start.

    Raises:
      ConnectionError: nothing accepts connections at `address`.
    """
    host, port = address.split("://")[-1].rsplit(":", 1)
    host = host.strip("[]")
    if timeout is None:
        timeout = CONNECT_TIMEOUT_SECONDS
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise ConnectionError(
        f"No tf.data service dispatcher is reachable at `{address}` "
        f"(waited {timeout:.0f} s: {error}). Start one (`tfmulti-launch "
        "--data_workers N` does, or `python -m tfmulti.data.service "
        "dispatcher --port PORT` plus workers), or unset `service` / "
        f"{ENV_VAR} to read the data in the training process.")


def distribute(dataset, address: str, *, transfer_batch: int):
    """`dataset` produced by the data workers at `address`, DYNAMIC sharding,
    as batches of up to `transfer_batch` elements (unbatch them to get the
    elements back).

    Each call to iterate starts an anonymous job: every element of
    `dataset` at most once (all of them without faults), spread over the
    data workers. Everything in `dataset` runs on the data workers, so it
    must be a graph (no `py_function`); take/skip/enumerate apply per data
    worker, not to the whole dataset.

    Why batches: the service sends one response per element, and receiving
    them cost the training process more CPU than the preprocessing it moved
    away (measured, BUILD_NOTES: 20-26 ms per batch of 64 images against
    37 ms to make them locally; 1.0-1.5 ms when 64 travel together). A data
    worker batches only its own elements and keeps a short last batch, so
    unbatched the stream holds exactly the elements it would otherwise.
    """
    import tensorflow as tf
    service = tf.data.experimental.service
    return dataset.batch(transfer_batch).apply(service.distribute(
        processing_mode=service.ShardingPolicy.DYNAMIC, service=address))


# One entry per service epoch that delivered fewer elements than its pipeline
# holds: {"pipeline", "epoch", "expected", "delivered", "lost", "training"}.
_losses: list[dict] = []


def losses() -> list[dict]:
    """The epochs (of this process's pipelines) that lost elements: a data
    worker died with them in flight. Empty when nothing was lost."""
    return list(_losses)


def count_delivered(batches, *, expected: int, pipeline_id: int,
                    training: bool):
    """`batches` (one service epoch of `distribute`'s batches) that, at its
    end, logs and records in `losses()` how many of `expected` elements
    never arrived.

    Runs in the training process, a Python call per batch.
    """
    import tensorflow as tf
    state = {"count": 0, "epoch": 0}

    def count(*batch):
        def bump(size):
            state["count"] += int(size)
            return 0
        size = tf.shape(tf.nest.flatten(batch)[0])[0]
        tick = tf.py_function(bump, [size], tf.int32)
        with tf.control_dependencies([tick]):
            return tf.nest.map_structure(tf.identity, batch)

    def settle(_):
        def report():
            delivered, state["count"] = state["count"], 0
            state["epoch"] += 1
            if delivered < expected:
                entry = {"pipeline": pipeline_id, "epoch": state["epoch"],
                         "expected": expected, "delivered": delivered,
                         "lost": expected - delivered, "training": training}
                _losses.append(entry)
                logging.getLogger(__name__).warning(
                    "tfmulti: the tf.data service delivered %d of %d "
                    "elements of input pipeline %d in its epoch %d: %d lost "
                    "with a data worker that failed (DYNAMIC sharding "
                    "visits each element at most once)%s", delivered,
                    expected, pipeline_id, state["epoch"],
                    expected - delivered, "" if training else
                    "; this EVALUATION is not exact-once")
            return 0
        return tf.py_function(report, [], tf.int32)

    # Empty, of the same structure, without a second service iterator (its
    # creation alone would start another job on the data workers).
    spec = batches.element_spec
    empty = tf.data.Dataset.range(0).map(lambda _: tf.nest.map_structure(
        lambda s: tf.zeros([d or 0 for d in s.shape] if s.shape.rank
                           is not None else [], s.dtype), spec))
    end = tf.data.Dataset.range(1).map(settle).flat_map(lambda _: empty)
    return batches.map(count).concatenate(end)


def start_dispatcher(port: int = 0, work_dir: str | None = None):
    """A `DispatchServer` on `port` (0: a free one), fault tolerant with a
    journal in `work_dir` when given (a restart resumes from it)."""
    import tensorflow as tf
    service = tf.data.experimental.service
    return service.DispatchServer(service.DispatcherConfig(
        port=port, work_dir=work_dir, fault_tolerant_mode=bool(work_dir)))


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def worker_host(dispatcher: str, worker_address: str | None = None) -> str:
    """The host training processes reach a data worker at.

    The dispatcher tells readers where each data worker is; TensorFlow's
    default, `localhost`, is right only when they share the machine. So
    with a dispatcher on another host the default is this machine's name
    (`socket.gethostname()`, what SLURM and Kubernetes resolve), on
    loopback `localhost`; `worker_address` (a host name or IP: the port
    is the worker's own) overrides it.
    """
    if worker_address:
        return worker_address
    host = dispatcher.split("://")[-1].rsplit(":", 1)[0]
    return "localhost" if (host in _LOOPBACK or host.startswith("127.")) \
        else socket.gethostname()


def start_worker(dispatcher: str, port: int = 0,
                 worker_address: str | None = None):
    """A `WorkerServer` on `port` serving the dispatcher at `dispatcher`,
    reached by readers at `worker_host(dispatcher, worker_address)`."""
    import tensorflow as tf
    service = tf.data.experimental.service
    host = worker_host(dispatcher, worker_address)
    return service.WorkerServer(service.WorkerConfig(
        dispatcher_address=dispatcher.split("://")[-1], port=port,
        # TensorFlow puts the bound ports in for %port% and %dts_port%.
        worker_address=f"{host}:%port%",
        data_transfer_address=f"{host}:%dts_port%"))


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfmulti.data.service",
        description="Runs tf.data service servers until SIGTERM/SIGINT; "
                    "prints `tfmulti: data service ROLE at ADDRESS` once "
                    "each serves.")
    parser.add_argument("role", choices=["dispatcher", "worker", "local"],
                        help="`local`: a dispatcher and --workers data "
                             "workers in this one process")
    parser.add_argument("--port", type=int, default=0,
                        help="port to serve on (0: a free one)")
    parser.add_argument("--dispatcher", default=None,
                        help="the dispatcher's host:port (role worker)")
    parser.add_argument("--work_dir", default=None,
                        help="dispatcher journal directory: fault-tolerant "
                             "mode, a restart resumes its jobs")
    parser.add_argument("--workers", type=int, default=1,
                        help="data workers (role local)")
    parser.add_argument("--worker_address", default=None,
                        help="the host name or IP training processes reach "
                             "this data worker at; default: this "
                             "machine's hostname, or localhost when the "
                             "dispatcher is on loopback")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.role == "worker" and not args.dispatcher:
        _parser().error("`--dispatcher` is required for role worker, e.g. "
                        "--dispatcher=127.0.0.1:5050")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfmulti import compat  # imports TensorFlow, as the servers do
    servers = []
    if args.role in ("dispatcher", "local"):
        dispatcher = start_dispatcher(args.port, args.work_dir)
        servers.append(dispatcher)
        address = f"127.0.0.1:{dispatcher.target.rsplit(':', 1)[1]}"
        print(f"tfmulti: data service dispatcher at {address}", flush=True)
    # role local: the dispatcher took --port; its workers take free ones.
    workers = {"worker": [args.port], "local": [0] * args.workers}.get(
        args.role, [])
    for port in workers:
        dispatcher_address = args.dispatcher or address
        servers.append(start_worker(dispatcher_address, port,
                                    args.worker_address))
        bound = compat.data_worker_address(servers[-1]).rsplit(":", 1)[1]
        # The address the dispatcher hands to readers.
        print(f"tfmulti: data service worker at "
              f"{worker_host(dispatcher_address, args.worker_address)}:"
              f"{bound}", flush=True)
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.append(True))
    while not stop:
        time.sleep(0.2)
    # The servers' own stop() waits for in-flight streams and heartbeats
    # (over 30 s measured); the dispatcher's journal is written as it goes,
    # so nothing is lost by leaving at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
