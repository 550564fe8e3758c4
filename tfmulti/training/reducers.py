"""`sync=` and `compression=` options -> the reducer a train step uses."""

from __future__ import annotations

from tfmulti.training import communication, local_sgd, powersgd


def check_options(sync, compression, *, allreduce_dtype=None) -> None:
    """Raises ValueError for a bad `sync` / `compression` or combination."""
    if sync is not None and not isinstance(sync, local_sgd.LocalSGD):
        raise ValueError(
            f"`sync` should be None (synchronous) or tfmulti.LocalSGD("
            f"every=H, ...), got {sync!r}.")
    if compression is not None and not isinstance(compression,
                                                  powersgd.PowerSGD):
        raise ValueError(
            f"`compression` should be None or tfmulti.PowerSGD(rank=r), got "
            f"{compression!r}.")
    local = sync is not None and not sync.synchronous
    if local and compression is not None:
        raise ValueError(
            f"`sync`={sync!r} and `compression`={compression!r} together are "
            "not supported: choose local SGD (fewer synchronisations) or "
            "PowerSGD (smaller ones).")
    if allreduce_dtype is not None and (local or compression is not None):
        raise ValueError(
            f"`allreduce_dtype`={allreduce_dtype!r} applies to the "
            "synchronous gradient all-reduce only; with `sync` or "
            "`compression` pass allreduce_dtype=None.")


def make_reducer(strategy, variables, *, sync=None, compression=None,
                 communication_options=None, allreduce_dtype=None):
    """The reducer for these options (see `communication`).

    Args:
      strategy: the strategy.
      variables: the trainable variables, in gradient order.
      sync: None or `LocalSGD`.
      compression: None or `PowerSGD`.
      communication_options: for every all-reduce.
      allreduce_dtype: wire dtype of the synchronous all-reduce.
    """
    check_options(sync, compression, allreduce_dtype=allreduce_dtype)
    if compression is not None:
        return powersgd.PowerSGDReducer(
            strategy, variables, compression,
            communication_options=communication_options)
    if sync is not None and not sync.synchronous:
        return local_sgd.LocalSGDReducer(
            strategy, variables, sync,
            communication_options=communication_options)
    return communication.SynchronousReducer(
        strategy, communication_options=communication_options,
        allreduce_dtype=allreduce_dtype)
