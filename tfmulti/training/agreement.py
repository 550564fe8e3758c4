"""Workers agree on their configuration before training, or all stop.

Workers given different settings (global batch 16 on one, 32 on the other)
trained on with exit 0 and weights matching neither; a different
`grad_accum_steps` or model shape died in a raw collective mismatch; workers
that do not share `model_dir` restored different steps. One all-reduce at
the start gathers every worker's fingerprint (each worker fills its own row
of a table, zeros elsewhere; the SUM is the whole table, exact in float64
for integers below 2**53), so every worker sees every value and all raise
the same error, naming the field and each worker's value.
"""

from __future__ import annotations

import zlib

import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import watchdog
from tfmulti.training import loop as loop_lib


# Defined with the cluster, so that strategy creation can raise it too.
ConfigMismatchError = cluster_lib.ConfigMismatchError


def shapes_fingerprint(variables) -> int:
    """An integer that differs when the variables' names or shapes do."""
    text = ";".join(f"{getattr(v, 'path', v.name)}{tuple(v.shape)}"
                    for v in variables)
    return zlib.crc32(text.encode())


def check_agreement(strategy, fields: dict[str, int], *,
                    fixes: dict[str, str] | None = None) -> None:
    """Raises `ConfigMismatchError` unless every worker has the same `fields`.

    One SUM all-reduce of a [workers, fields] float64 table; a no-op for a
    single worker. Call at the same point on every worker.

    Args:
      strategy: the strategy spanning the workers.
      fields: name -> integer value on this worker.
      fixes: name -> what to do when that field differs.
    """
    cluster = cluster_lib.of_strategy(strategy)
    workers = cluster.num_workers
    if workers == 1:
        return
    names = list(fields)
    row = np.zeros((workers, len(names)), np.float64)
    row[cluster.worker_rank] = [float(fields[n]) for n in names]
    local = len(strategy.extended.worker_devices)
    first = cluster.worker_rank * local

    table = tf.constant(row)

    @tf.function
    def gather():
        # Traced, like the Keras callbacks' position check: an eager
        # collective here raced the workers' other collectives (measured:
        # "Collective instance 115 expected type 1 ... got type 0").
        def replica_fn():
            context = tf.distribute.get_replica_context()
            # One replica per worker gives the row: the sum is the table.
            mine = tf.equal(context.replica_id_in_sync_group, first)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(
                mine, table, tf.zeros_like(table)))
        return strategy.run(replica_fn)

    # A peer that never arrives is a stall (`stall_timeout_seconds`), not a
    # hang.
    with watchdog.calling(strategy, gather):
        table = strategy.experimental_local_results(gather())[0].numpy()
    problems = []
    for j, name in enumerate(names):
        column = table[:, j]
        if np.all(column == column[0]):
            continue
        values = ", ".join(f"worker {i} has {int(v)}"
                           for i, v in enumerate(column))
        fix = (fixes or {}).get(name, "Start every worker with the same "
               "settings.")
        problems.append(f"`{name}` differs across workers ({values}). {fix}")
    if problems:
        raise ConfigMismatchError(
            "The workers of this job were started with different "
            "configurations, so training would silently give wrong weights: "
            + " ".join(problems))


def any_worker(strategy, flags):
    """Element-wise OR of `flags` over all workers (one all-reduce): the
    workers' common decision to stop, evaluate or save after a loop."""
    if cluster_lib.of_strategy(strategy).num_workers < 2:
        return flags
    summed = loop_lib.sum_over_replicas(
        strategy, tf.constant([float(f) for f in flags]))
    return [bool(v > 0) for v in summed.numpy()]
