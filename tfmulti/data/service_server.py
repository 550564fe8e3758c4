"""The tf.data service's servers: a dispatcher and data workers.

    python -m tfmulti.data.service_server dispatcher|worker|local ...

runs TensorFlow's own `DispatchServer`/`WorkerServer` until SIGTERM and
prints `tfmulti: data service ROLE at ADDRESS` once each serves;
`tfmulti-launch --data_workers N` and the cluster templates start them this
way. A module of its own, apart from the training side
(`tfmulti.data.service`) that `import tfmulti` loads, so that `python -m`
runs it once (runpy warns about a module it finds already imported).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time


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


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m tfmulti.data.service_server`."""
    result = argparse.ArgumentParser(
        prog="python -m tfmulti.data.service_server",
        description="Runs tf.data service servers until SIGTERM/SIGINT; "
                    "prints `tfmulti: data service ROLE at ADDRESS` once "
                    "each serves.")
    result.add_argument("role", choices=["dispatcher", "worker", "local"],
                        help="`local`: a dispatcher and --workers data "
                             "workers in this one process")
    result.add_argument("--port", type=int, default=0,
                        help="port to serve on (0: a free one)")
    result.add_argument("--dispatcher", default=None,
                        help="the dispatcher's host:port (role worker)")
    result.add_argument("--work_dir", default=None,
                        help="dispatcher journal directory: fault-tolerant "
                             "mode, a restart resumes its jobs")
    result.add_argument("--workers", type=int, default=1,
                        help="data workers (role local)")
    result.add_argument("--worker_address", default=None,
                        help="the host name or IP training processes reach "
                             "this data worker at; default: this "
                             "machine's hostname, or localhost when the "
                             "dispatcher is on loopback")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.role == "worker" and not args.dispatcher:
        parser().error("`--dispatcher` is required for role worker, e.g. "
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
