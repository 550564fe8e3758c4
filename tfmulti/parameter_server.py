"""ParameterServerStrategy for Keras 3: the roles of an asynchronous job.

In a parameter-server job only the chief runs Python training code (it owns
a `tf.distribute.coordinator.ClusterCoordinator` that schedules steps on the
workers); the `worker` and `ps` tasks run a `tf.distribute.Server` and block.
`create_strategy("parameter_server")` does both: on the chief it returns the
strategy, on a worker or parameter server it serves until the job kills it,
so one command line (the TensorFlow tutorial's pattern) starts every role.

Keras 3 dropped `model.fit` under this strategy (keras-team/keras#18624); the
Keras 3 variables themselves work (BUILD_NOTES, issue 16): tfmulti trains
with its own asynchronous loop (`tfmulti.training.async_trainer`).
"""

from __future__ import annotations

import logging
import sys

import tensorflow as tf

from tfmulti import cluster as cluster_lib

_log = logging.getLogger(__name__)

# Roles that serve instead of training.
SERVING_TYPES = ("worker", "ps")


def serve(cluster: cluster_lib.ClusterConfig) -> None:
    """Runs this task's TensorFlow server until the process is killed.

    For the `worker` and `ps` tasks of a parameter-server job; the chief's
    coordinator sends them work. Never returns: the launcher (or SLURM,
    Kubernetes) ends these processes when the chief is done.
    """
    if cluster.task_type not in SERVING_TYPES:
        raise ValueError(
            f"`task.type` is {cluster.task_type!r}; only {SERVING_TYPES} "
            "tasks serve. The chief creates the strategy and trains.")
    server = tf.distribute.Server(
        tf.train.ClusterSpec({t: list(a) for t, a in cluster.cluster.items()}),
        job_name=cluster.task_type, task_index=cluster.task_index,
        protocol="grpc", start=True)
    print(f"tfmulti: {cluster.task_type} {cluster.task_index} serving at "
          f"{cluster.cluster[cluster.task_type][cluster.task_index]}",
          flush=True)
    server.join()
    sys.exit(0)  # join() returns only if the server is stopped


def create(cluster: cluster_lib.ClusterConfig, *,
           variable_partitioner=None,
           stall_timeout_seconds: float | None = None
           ) -> tf.distribute.Strategy:
    """The chief's ParameterServerStrategy; serves forever on other roles.

    Args:
      cluster: a `ClusterConfig` with a chief, workers and parameter servers.
      variable_partitioner: a `tf.distribute.experimental.partitioners`
        partitioner, or None. It shards plain `tf.Variable`s; Keras 3 layers
        get a sharded variable that Keras 3 cannot train (the Trainer
        refuses it; BUILD_NOTES, issue 16).
      stall_timeout_seconds: how long `Trainer.fit` waits with EVERY worker
        unreachable before it raises `WorkersLostError` (TensorFlow alone
        waits up to an hour for one to return); None or `math.inf`: as
        TensorFlow. `create_strategy` passes its default (600 s). One
        failed worker is never an error: its closures run on the others.

    Returns:
      A `tf.distribute.ParameterServerStrategy` with a `ClusterCoordinator`
      attached as `strategy.tfmulti_coordinator` (on the chief only).
    """
    cluster_lib.check_parameter_server_roles(cluster.cluster)
    if cluster.task_type in SERVING_TYPES:
        serve(cluster)
    if cluster.task_type != "chief":
        raise ValueError(
            f"`task.type` is {cluster.task_type!r}: in a parameter-server "
            "job it has no part in training. Run an evaluator with "
            "strategy 'one_device' reading the chief's checkpoints.")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({t: list(a) for t, a in cluster.cluster.items()}),
        task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=variable_partitioner)
    strategy.tfmulti_coordinator = (
        tf.distribute.coordinator.ClusterCoordinator(strategy))
    strategy.tfmulti_stall_timeout_seconds = stall_timeout_seconds
    _log.info("tfmulti: ParameterServerStrategy with %d worker(s) and %d "
              "parameter server(s)", len(cluster.cluster["worker"]),
              len(cluster.cluster["ps"]))
    return strategy


def coordinator(strategy) -> tf.distribute.coordinator.ClusterCoordinator:
    """The ClusterCoordinator of a ParameterServerStrategy (one per strategy).

    `create` attaches one; a strategy made elsewhere gets one here.
    """
    found = getattr(strategy, "tfmulti_coordinator", None)
    if found is None:
        found = tf.distribute.coordinator.ClusterCoordinator(strategy)
        strategy.tfmulti_coordinator = found
    return found


def stall_timeout(strategy) -> float | None:
    """The `stall_timeout_seconds` given to `create` (None, TensorFlow's
    own wait, for a strategy made elsewhere)."""
    return getattr(strategy, "tfmulti_stall_timeout_seconds", None)


def is_parameter_server(strategy) -> bool:
    """Whether `strategy` is a ParameterServerStrategy."""
    return isinstance(strategy, tf.distribute.ParameterServerStrategy)
