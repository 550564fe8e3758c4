"""ParameterServerStrategy's coordinator and variables: what it keeps
private about failed workers, retried closures and sharded variables."""

from __future__ import annotations


# --- The coordinator keeps its workers' failures and retries private -------
# TensorFlow's ClusterCoordinator (tensorflow/python/distribute/coordinator/
# cluster_coordinator.py) has no public "which workers failed" or "how many
# closures were retried": each `Worker` sets `_is_dead_with_error` when a
# closure fails with a worker error (cleared when it is back), and a retried
# closure goes back through `put_back` of the coordinator's private
# `_CoordinatedClosureQueue` (`coordinator._cluster.closure_queue`). Without
# them tfmulti joins unbounded and reports no retry count, as TensorFlow
# does. Checked: TF 2.18.1, 2.21.0. Guard: test_compat.py::
# test_private_names_tfmulti_reads_still_exist; use: test_parameter_server.py.
def coordinator_workers(coordinator) -> list | None:
    """The coordinator's workers, if each says whether it failed; else
    None."""
    workers = list(getattr(getattr(coordinator, "_cluster", None),
                           "workers", None) or ())
    if not workers or not all(hasattr(w, "_is_dead_with_error")
                              for w in workers):
        return None
    return workers


def worker_failed(worker) -> bool:
    """Whether the coordinator holds `worker` failed now."""
    return bool(worker._is_dead_with_error)


def count_retries(coordinator, on_retry) -> bool:
    """Calls `on_retry()` for every closure the coordinator puts back to
    run again (once per coordinator). Returns whether it could."""
    queue = getattr(getattr(coordinator, "_cluster", None), "closure_queue",
                    None)
    put_back = getattr(queue, "put_back", None)
    if not callable(put_back):
        return False
    if not getattr(put_back, "_tfmulti_counted", False):
        def counted(closure):
            on_retry()
            return put_back(closure)
        counted._tfmulti_counted = True
        queue.put_back = counted
    return True


# --- Sharded variables have no public class --------------------------------
# A variable partitioned over the parameter servers (`variable_partitioner`)
# is a `ShardedVariable` (tensorflow/python/distribute/sharded_variable.py),
# not exported by `tf.distribute`. Checked: TF 2.18.1, 2.21.0. Guard:
# test_compat.py::test_private_names_tfmulti_reads_still_exist.
def is_sharded_variable(value) -> bool:
    """Whether `value` is split over the parameter servers."""
    from tensorflow.python.distribute import sharded_variable
    return isinstance(value, sharded_variable.ShardedVariable)
