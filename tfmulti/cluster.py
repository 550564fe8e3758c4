"""The cluster a job runs in: TF_CONFIG, SLURM, Kubernetes or a local one.

Everything is read into one frozen `ClusterConfig`, validated once, so a typo
in TF_CONFIG fails at start-up with a message instead of hanging at "Waiting
for the cluster, timeout = inf" (tf#41257).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any, Mapping

from tfmulti.scheduler_env import kubernetes_tf_config, slurm_tf_config

# Chief and worker train, an evaluator only reads checkpoints; parameter
# servers (`ps`) hold the variables of a ParameterServerStrategy job, whose
# chief coordinates and whose workers compute.
TASK_TYPES = ("chief", "worker", "evaluator", "ps")
_TRAINING_TYPES = ("chief", "worker")
_EXAMPLE = ('{"cluster": {"worker": ["host0:12345", "host1:12345"]}, '
            '"task": {"type": "worker", "index": 0}}')



class ConfigMismatchError(ValueError):
    """Workers of one job were started with different configurations (raised
    by `tfmulti.training.agreement`, and at variable creation by
    `tfmulti.initial_values`)."""

@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster and this process's place in it.

    Attributes:
      cluster: task type -> tuple of "host:port" addresses; empty for a
        single process.
      task_type: this process's task type ("worker" for a single process).
      task_index: this process's index within `task_type`.
    """

    cluster: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=dict)
    task_type: str = "worker"
    task_index: int = 0

    def __post_init__(self):
        cluster = _validated_cluster(self.cluster)
        object.__setattr__(self, "cluster", cluster)
        if not cluster:
            if (self.task_type, self.task_index) != ("worker", 0):
                raise ValueError(
                    f"`task` is {{'type': {self.task_type!r}, 'index': "
                    f"{self.task_index!r}}} but `cluster` is empty. Give the "
                    f"cluster's addresses, e.g. {_EXAMPLE}.")
            return
        if self.task_type not in cluster:
            raise ValueError(
                f"`task.type` is {self.task_type!r}, which is not a task type "
                f"of the cluster (it has {sorted(cluster)}). Set `task.type` "
                "to one of those, or add its addresses to `cluster`.")
        index = self.task_index
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"`task.index` should be an int, got {index!r}. Set it to "
                "this process's position in the cluster's address list.")
        count = len(cluster[self.task_type])
        if not 0 <= index < count:
            raise ValueError(
                f"`task.index` is {index} but the cluster has {count} "
                f"{self.task_type!r} task(s), so it must be in [0, "
                f"{count - 1}]. Give each process a distinct index in range.")

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        """Addresses of the training tasks, chief first, in rank order."""
        return tuple(a for t in _TRAINING_TYPES
                     for a in self.cluster.get(t, ()))

    @property
    def num_ps(self) -> int:
        """Number of parameter servers (0 outside a parameter-server job)."""
        return len(self.cluster.get("ps", ()))

    @property
    def num_workers(self) -> int:
        """Number of training processes (chief and workers); 1 if alone."""
        return max(1, len(self.worker_addresses))

    @property
    def is_chief(self) -> bool:
        """Whether this process writes the job's checkpoints and summaries.

        The `chief` task where the cluster has one, else worker 0.
        """
        if not self.cluster:
            return True
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def worker_rank(self) -> int:
        """This process's position among the training tasks (chief = 0)."""
        if self.task_type in ("evaluator", "ps") or not self.cluster:
            return 0
        offset = len(self.cluster.get("chief", ())) if (
            self.task_type == "worker") else 0
        return offset + self.task_index

    def tf_config(self) -> dict[str, Any]:
        """This config as a TF_CONFIG dict ({} for a single process)."""
        if not self.cluster:
            return {}
        return {"cluster": {t: list(a) for t, a in self.cluster.items()},
                "task": {"type": self.task_type, "index": self.task_index}}


def _validated_cluster(cluster: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(cluster, Mapping):
        raise ValueError(
            f"`cluster` should map task types to address lists, got "
            f"{cluster!r}. Example: {_EXAMPLE}.")
    result = {}
    seen = {}
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise ValueError(
                f"`cluster` has task type {task_type!r}; tfmulti's strategies "
                f"support {list(TASK_TYPES)}. Rename it to one of those.")
        if isinstance(addresses, str) or not isinstance(
                addresses, (list, tuple)):
            raise ValueError(
                f"`cluster.{task_type}` should be a list of 'host:port' "
                f"strings, got {addresses!r}.")
        if task_type == "chief" and len(addresses) > 1:
            raise ValueError(
                f"`cluster.chief` has {len(addresses)} addresses "
                f"{list(addresses)}; there can be only one chief. Move the "
                "others to `cluster.worker`.")
        for i, address in enumerate(addresses):
            where = f"`cluster.{task_type}[{i}]`"
            _check_address(where, address)
            if address in seen:
                raise ValueError(
                    f"{where} and {seen[address]} are both {address!r}: two "
                    "tasks cannot share one address. Give each task its own "
                    "host:port.")
            seen[address] = where
        if addresses:
            result[task_type] = tuple(addresses)
    if result and not any(t in result for t in _TRAINING_TYPES):
        raise ValueError(
            f"`cluster` has no 'chief' or 'worker' task ({cluster!r}); "
            "at least one training task is needed.")
    if "ps" in result:
        check_parameter_server_roles(result)
    return result


_PS_EXAMPLE = ('{"cluster": {"chief": ["host0:2222"], "worker": '
               '["host1:2222", "host2:2222"], "ps": ["host3:2222"]}, '
               '"task": {"type": "chief", "index": 0}}')


def check_parameter_server_roles(cluster: Mapping[str, Any]) -> None:
    """Raises a ValueError unless `cluster` has the roles of a
    parameter-server job: one `chief` (the coordinator that runs the
    training loop), at least one `worker` and at least one `ps`."""
    for role, why in (
            ("chief", "the coordinator that runs the training loop"),
            ("worker", "the tasks that compute the steps"),
            ("ps", "the parameter servers that hold the variables")):
        if not cluster.get(role):
            raise ValueError(
                f"A parameter-server job needs a `cluster.{role}` ({why}), "
                f"but `cluster` is {dict(cluster)!r}. Add its addresses, "
                f"e.g. {_PS_EXAMPLE}; or, for synchronous training without "
                "parameter servers, remove `cluster.ps` and use strategy "
                "'multi_worker'.")


def _check_address(where: str, address: Any) -> None:
    if not isinstance(address, str):
        raise ValueError(f"{where} should be a 'host:port' string, got "
                         f"{address!r}.")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not (
            0 < int(port) < 65536):
        raise ValueError(
            f"{where} is {address!r}, which has no valid port. Write it as "
            "'host:port', e.g. 'node01:23456'.")


def cluster_config(tf_config: str | Mapping[str, Any] | None = None, *,
                   environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """Reads and validates the cluster this process belongs to.

    The source, in order: `tf_config` if given; else the TF_CONFIG variable;
    else SLURM's variables (inside an `srun` step); else a Kubernetes indexed
    Job or StatefulSet described by TFMULTI_NUM_WORKERS (see
    `kubernetes_tf_config`); else a single process.

    Args:
      tf_config: a TF_CONFIG dict or JSON string.
      environ: the environment to read (defaults to `os.environ`); tests
        pass a dict to simulate a cluster.

    Returns:
      A `ClusterConfig`.

    Raises:
      ValueError: the configuration is malformed; the message names the
        field, shows the value and says the fix.
    """
    environ = os.environ if environ is None else environ
    if tf_config is None:
        if environ.get("TF_CONFIG", "").strip():
            tf_config = environ["TF_CONFIG"]
        elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
            tf_config = slurm_tf_config(environ)
        elif "TFMULTI_NUM_WORKERS" in environ:
            tf_config = kubernetes_tf_config(environ)
        else:
            return ClusterConfig()
    if isinstance(tf_config, (str, bytes)):
        try:
            tf_config = json.loads(tf_config)
        except ValueError as e:
            raise ValueError(
                f"`TF_CONFIG` is not valid JSON ({e}): {tf_config!r}. Set it "
                f"to a JSON object such as {_EXAMPLE}.") from None
    if not isinstance(tf_config, Mapping):
        raise ValueError(f"`TF_CONFIG` should be a JSON object, got "
                         f"{tf_config!r}. Example: {_EXAMPLE}.")
    if not tf_config:
        return ClusterConfig()
    if "cluster" not in tf_config:
        raise ValueError(
            f"`TF_CONFIG` has no `cluster` field: {dict(tf_config)!r}. Add "
            f"the addresses of every task, e.g. {_EXAMPLE}.")
    task = tf_config.get("task")
    if not isinstance(task, Mapping) or "type" not in task:
        raise ValueError(
            f"`TF_CONFIG` has no `task` with a `type` (got task={task!r}). "
            "Say which task this process is, e.g. "
            '"task": {"type": "worker", "index": 0}.')
    return ClusterConfig(cluster=tf_config["cluster"],
                         task_type=task["type"],
                         task_index=task.get("index", 0))


def of_strategy(strategy) -> ClusterConfig:
    """The cluster `strategy` was built for (a single process if none).

    Read from the strategy's own cluster resolver, so it holds for a strategy
    made with an explicit `cluster` as much as for one made from TF_CONFIG.
    """
    # Here, not at the top: the launcher imports this module and must start
    # without TensorFlow.
    from tfmulti import compat
    resolver = compat.cluster_resolver(strategy)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec:
        return ClusterConfig()
    return ClusterConfig(cluster=spec, task_type=resolver.task_type,
                         task_index=int(resolver.task_id or 0))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_cluster(num_workers: int, *, host: str = "127.0.0.1",
                  ports: list[int] | None = None,
                  num_ps: int = 0) -> list[dict[str, Any]]:
    """TF_CONFIG dicts for the processes of a job on this machine.

    Args:
      num_workers: number of worker processes, at least 1.
      host: the address they listen on; loopback unless you mean otherwise.
      ports: ports to use, one per process; by default free ones are picked.
      num_ps: parameter servers; with any, the job also gets a `chief` (the
        coordinator of a ParameterServerStrategy job).

    Returns:
      One TF_CONFIG dict per process: without parameter servers worker i at
      index i; with them the chief first, then the workers, then the ps.
    """
    if isinstance(num_workers, bool) or not isinstance(
            num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` should be a positive int, got "
                         f"{num_workers!r}.")
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise ValueError(f"`num_ps` should be an int >= 0, got {num_ps!r}.")
    roles = ([("chief", 1)] if num_ps else []) + [("worker", num_workers)] + (
        [("ps", num_ps)] if num_ps else [])
    count = sum(n for _, n in roles)
    if ports is None:
        ports = _distinct_free_ports(host, count)
    if len(ports) != count:
        raise ValueError(f"`ports` has {len(ports)} entries for {count} "
                         "processes; give one port per process.")
    addresses = iter(f"{host}:{p}" for p in ports)
    cluster = {role: [next(addresses) for _ in range(n)] for role, n in roles}
    ClusterConfig(cluster=cluster)  # validates the addresses
    return [{"cluster": cluster, "task": {"type": role, "index": i}}
            for role, n in roles for i in range(n)]


def _distinct_free_ports(host: str, count: int) -> list[int]:
    # Holding every socket open until all are bound keeps the OS from handing
    # the same port out twice.
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
