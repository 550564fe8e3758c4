"""TensorFlow's cluster resolvers: what tfmulti reads of a scheduler's
environment with TensorFlow's own parser."""

from __future__ import annotations


# --- SLURM's compressed host and task lists --------------------------------
# `SLURM_JOB_NODELIST` is compressed ("node[01-03,07]"), and so is
# `SLURM_TASKS_PER_NODE` ("2(x3),1"); TensorFlow's SlurmClusterResolver
# expands them with `expand_hostlist` / `expand_tasks_per_node`, functions
# of tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py
# that `tf.distribute.cluster_resolver` does not export. tfmulti builds its
# own TF_CONFIG (a port per task, no srun dependency) but parses hosts as
# TensorFlow does. Checked: TF 2.18.1, 2.21.0. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist; use: tests/test_cluster.py.
def expand_slurm_hostlist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list (ValueError if malformed)."""
    from tensorflow.python.distribute.cluster_resolver import (
        slurm_cluster_resolver)
    return slurm_cluster_resolver.expand_hostlist(nodelist)


def expand_slurm_tasks_per_node(spec: str) -> list[int]:
    """Tasks per node of `SLURM_TASKS_PER_NODE` ("2(x3),1"), same source."""
    from tensorflow.python.distribute.cluster_resolver import (
        slurm_cluster_resolver)
    return slurm_cluster_resolver.expand_tasks_per_node(spec)
