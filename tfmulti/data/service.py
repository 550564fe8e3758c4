"""tf.data service: preprocessing on data workers instead of the trainer.

TensorFlow's own engine (`tf.data.experimental.service`): a dispatcher hands
out splits of a dataset to data workers, which run the pipeline and stream
elements back to the training process. tfmulti uses DYNAMIC sharding: every
split goes to one data worker, so an element is produced at most once per
iteration, all of them when no data worker fails; the elements a killed
data worker had in flight are lost (not repeated) for that epoch.

This is the training process's side: `resolve_address` (the `service`
argument or `TFMULTI_DATA_SERVICE`), `check_reachable` (a bounded probe, so
a missing dispatcher is an error naming its address instead of TensorFlow's
retry loop that never ends), `distribute` and the count of what arrived.
The servers are `tfmulti.data.service_server`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
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
            "`python -m tfmulti.data.service_server dispatcher` prints), or leave "
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
        "--data_workers N` does, or `python -m tfmulti.data.service_server "
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
