"""TF_CONFIG from a scheduler's environment: SLURM (`srun` steps) and
Kubernetes (an indexed Job or a StatefulSet), for `cluster.cluster_config`.

Each reads only environment variables, so a job needs no launcher inside
the scheduler; a variable that is missing or malformed is named with its
value and the fix.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

# The port every worker listens on unless TFMULTI_PORT says otherwise.
DEFAULT_PORT = 23456


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None or not value.strip().isdigit():
        raise ValueError(f"`{name}` should be a non-negative integer, got "
                         f"{value!r}. Run inside the job step that sets it.")
    return int(value)


def _port_var(environ: Mapping[str, str]) -> int:
    value = environ.get("TFMULTI_PORT")
    if value is None:
        return DEFAULT_PORT
    if not value.strip().isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"`TFMULTI_PORT` should be a port number in [1, "
                         f"65535], got {value!r}. Set it to the port every "
                         f"worker listens on, or unset it for {DEFAULT_PORT}.")
    return int(value)


def slurm_tf_config(environ: Mapping[str, str] | None = None, *,
                    port: int | None = None) -> dict[str, Any]:
    """Derives TF_CONFIG from SLURM's variables.

    Reads SLURM_PROCID (this task's rank), SLURM_NTASKS, the job step's
    nodes (SLURM_STEP_NODELIST, which `srun` sets, else SLURM_JOB_NODELIST;
    compressed lists such as `node[01-04,07]` are expanded) and, when there
    are more tasks than nodes, SLURM_STEP_TASKS_PER_NODE (else
    SLURM_TASKS_PER_NODE, e.g. `2(x4)`). The step's, because the rank and
    the task count are the step's: a training step that runs on part of the
    allocation (the rest serving tf.data, say) is a cluster of its nodes. Tasks are
    placed on nodes in block order, as `srun` does by default; the k-th task
    on a node listens on `port + k`. With TFMULTI_NUM_PS=P > 0 the job is a
    parameter-server job: task 0 is the `chief`, tasks 1..P the `ps`, the
    rest `worker`s.

    Args:
      environ: the environment to read (defaults to `os.environ`).
      port: base port; default TFMULTI_PORT or 23456.

    Returns:
      A TF_CONFIG dict with one `worker` per SLURM task.
    """
    # Here, not at the top: the launcher imports this module and must start
    # without TensorFlow.
    from tfmulti import compat
    environ = os.environ if environ is None else environ
    rank = _int_var(environ, "SLURM_PROCID")
    ntasks = _int_var(environ, "SLURM_NTASKS")
    if port is None:
        port = _port_var(environ)
    nodes_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                  "SLURM_NODELIST") if environ.get(v)),
                     "SLURM_JOB_NODELIST")
    nodelist = environ.get(nodes_var, "")
    try:
        hosts = compat.expand_slurm_hostlist(nodelist)
    except ValueError as e:
        raise ValueError(f"`{nodes_var}` is {nodelist!r}, which is not "
                         f"a SLURM host list ({e}).") from None
    if not nodelist or not hosts:
        raise ValueError(f"`{nodes_var}` is {nodelist!r}; run inside "
                         "a SLURM allocation (sbatch/salloc + srun).")
    if ntasks == len(hosts):
        per_node = [1] * len(hosts)
    else:
        spec_var = ("SLURM_STEP_TASKS_PER_NODE" if environ.get(
            "SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE")
        spec = environ.get(spec_var, "")
        try:
            per_node = compat.expand_slurm_tasks_per_node(spec)
        except ValueError:
            raise ValueError(
                f"`SLURM_NTASKS`={ntasks} differs from the {len(hosts)} nodes "
                f"of {nodelist!r} and `{spec_var}` is {spec!r}, "
                "which does not say how tasks are spread. Use one task per "
                "node (--ntasks-per-node=1).") from None
        if len(per_node) != len(hosts) or sum(per_node) != ntasks:
            raise ValueError(
                f"`{spec_var}`={spec!r} does not place "
                f"`SLURM_NTASKS`={ntasks} tasks on the {len(hosts)} nodes of "
                f"{nodelist!r}.")
    addresses = [f"{host}:{port + k}"
                 for host, n in zip(hosts, per_node) for k in range(n)]
    if not 0 <= rank < ntasks:
        raise ValueError(f"`SLURM_PROCID` is {rank} but `SLURM_NTASKS` is "
                         f"{ntasks}; it must be in [0, {ntasks - 1}].")
    if environ.get("TFMULTI_NUM_PS", "0").strip() not in ("", "0"):
        return _parameter_server_roles(
            addresses, rank, _int_var(environ, "TFMULTI_NUM_PS"))
    return {"cluster": {"worker": addresses},
            "task": {"type": "worker", "index": rank}}


def _parameter_server_roles(addresses, rank, num_ps):
    """Task 0 is the chief, the next `num_ps` tasks the parameter servers,
    the rest workers: the TF_CONFIG of a parameter-server job."""
    if len(addresses) < num_ps + 2:
        raise ValueError(
            f"`TFMULTI_NUM_PS` is {num_ps} but the job has {len(addresses)} "
            f"task(s); a parameter-server job needs {num_ps + 2}: a chief, "
            f"{num_ps} ps and at least one worker. Start more tasks or "
            "lower TFMULTI_NUM_PS.")
    cluster = {"chief": addresses[:1], "ps": addresses[1:1 + num_ps],
               "worker": addresses[1 + num_ps:]}
    if rank == 0:
        task = {"type": "chief", "index": 0}
    elif rank <= num_ps:
        task = {"type": "ps", "index": rank - 1}
    else:
        task = {"type": "worker", "index": rank - 1 - num_ps}
    return {"cluster": cluster, "task": task}


def kubernetes_tf_config(environ: Mapping[str, str] | None = None, *,
                         port: int | None = None) -> dict[str, Any]:
    """Derives TF_CONFIG for a Kubernetes indexed Job or StatefulSet.

    (A Kubeflow TFJob sets TF_CONFIG itself and needs none of this.)

    Reads TFMULTI_NUM_WORKERS, TFMULTI_WORKER_HOST (a pattern with `{index}`,
    e.g. `trainer-{index}.trainer` for pods behind a headless Service), and
    this pod's index from JOB_COMPLETION_INDEX (indexed Job) or the ordinal
    at the end of HOSTNAME (StatefulSet pod `trainer-3`).

    Args:
      environ: the environment to read (defaults to `os.environ`).
      port: the port every pod listens on; default TFMULTI_PORT or 23456.

    Returns:
      A TF_CONFIG dict with one `worker` per pod.
    """
    environ = os.environ if environ is None else environ
    num_workers = _int_var(environ, "TFMULTI_NUM_WORKERS")
    pattern = environ.get("TFMULTI_WORKER_HOST", "")
    if "{index}" not in pattern:
        raise ValueError(
            f"`TFMULTI_WORKER_HOST` is {pattern!r}; it should be a host "
            "pattern with '{index}', e.g. 'trainer-{index}.trainer'.")
    if port is None:
        port = _port_var(environ)
    if "JOB_COMPLETION_INDEX" in environ:
        index = _int_var(environ, "JOB_COMPLETION_INDEX")
    else:
        hostname = environ.get("HOSTNAME", "")
        match = re.search(r"-(\d+)$", hostname)
        if not match:
            raise ValueError(
                f"`HOSTNAME` is {hostname!r}, which ends in no pod ordinal, "
                "and `JOB_COMPLETION_INDEX` is unset. Run as an indexed Job "
                "(completionMode: Indexed) or a StatefulSet.")
        index = int(match.group(1))
    try:
        addresses = [f"{pattern.format(index=i)}:{port}"
                     for i in range(num_workers)]
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"`TFMULTI_WORKER_HOST` is {pattern!r}, which has a field other "
            f"than '{{index}}' or a stray brace ({type(e).__name__}: {e}). "
            "Use '{index}' as its only field, e.g. "
            "'trainer-{index}.trainer'.") from None
    return {"cluster": {"worker": addresses},
            "task": {"type": "worker", "index": index}}
