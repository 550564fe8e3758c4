"""Load balancing for the Trainer: the shares, the data cut and the timing.

`Balancer` ties together the policy (`tfmulti.balance`), the re-split of
each global batch by a share variable (`tfmulti.data.balanced`) and each
replica's compute time (`replica_timing`). The step is unchanged but for
the timer: each replica's loss is its summed per-example loss over the
global batch (TrainStep all-reduces the slices' sizes when they are not
known at trace time), so every update is the update of the full global
batch.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmulti import balance as balance_lib
from tfmulti import cluster as cluster_lib
from tfmulti.data import balanced as balanced_lib
from tfmulti.training import replica_timing


class Balancer:
    """The shares of one training run.

    Args:
      strategy: the strategy.
      balance: the parsed `balance` (see `balance.parse_balance`): "auto"
        or a list of per-replica weights.
      options: `balance.PolicyOptions` for "auto".
    """

    def __init__(self, strategy, balance, *,
                 options: balance_lib.PolicyOptions = (
                     balance_lib.PolicyOptions())):
        self._strategy = strategy
        self.auto = balance == balance_lib.AUTO
        self._weights = None if self.auto else list(balance)
        self._options = options
        self.timer = replica_timing.ReplicaTimer(strategy)
        self.policy = None
        self._counts = None
        self.shares_history = []

    def iterator(self, data, global_batch_size=None):
        """A `BalancedIterator` over `data`: a `tf.data.Dataset` of global
        batches, or an unbatched `dataset_fn` with `global_batch_size`."""
        if callable(data) and not isinstance(data, tf.data.Dataset):
            if global_batch_size is None:
                raise ValueError(
                    "`train_data` is a dataset_fn, so pass "
                    "`global_batch_size` too: the batch that `balance` "
                    "shares among the replicas.")
            data = balanced_lib.global_batches(
                data, global_batch_size=global_batch_size)
        if not isinstance(data, tf.data.Dataset):
            raise ValueError(
                "With `balance`, `train_data` should be a tf.data.Dataset of "
                "GLOBAL batches or an unbatched dataset_fn(input_context) "
                f"with `global_batch_size`; got {type(data).__name__}. A "
                "distributed dataset is already split evenly and cannot be "
                "re-split.")
        size = balanced_lib.static_batch_size(data)
        if size is None:
            # BalancedIterator names the problem.
            return balanced_lib.BalancedIterator(self._strategy, data, None)
        if global_batch_size is not None and global_batch_size != size:
            raise ValueError(
                f"`global_batch_size` is {global_batch_size} but the "
                f"dataset's batches hold {size} examples. Fix one of them.")
        replicas = self._strategy.num_replicas_in_sync
        self.policy = balance_lib.SharePolicy(
            replicas, size, initial=self._weights, options=self._options)
        if self._counts is None:
            self._counts = balanced_lib.create_counts(
                self._strategy, self.policy.counts)
        else:
            self._counts.assign(self.policy.counts)
        self.shares_history = []
        return balanced_lib.BalancedIterator(self._strategy, data,
                                             self._counts)

    @property
    def counts(self) -> list[int]:
        return list(self.policy.counts)

    def after_loop(self, step: int) -> dict:
        """Gathers the loop's per-replica compute times (a collective: every
        worker calls it after every loop), moves the shares under "auto",
        and returns the loop's balance logs: each replica's share and
        compute seconds per step, and the barrier idle fraction."""
        seconds, examples = self.timer.gather()
        used = list(self.policy.counts)
        steps = examples.sum() / self.policy.global_batch_size
        per_step = seconds / steps if steps > 0 else seconds
        logs = {"idle_fraction": balance_lib.idle_fraction(
            per_step.tolist())}
        for r, (count, s) in enumerate(zip(used, per_step)):
            logs[f"share_{r}"] = count / self.policy.global_batch_size
            logs[f"replica_seconds_{r}"] = float(s)
        # The first loop after a new iterator holds the tracing and the
        # first runs of every op: not a measure of speed.
        warm = bool(self.shares_history)
        if self.auto and warm and self.policy.update(seconds.tolist(),
                                                     examples.tolist()):
            self._counts.assign(self.policy.counts)
        self.shares_history.append(
            {"step": step, "counts": used,
             "seconds_per_step": [float(s) for s in per_step],
             "idle_fraction": logs["idle_fraction"]})
        return logs


def worker_shares(counts, strategy) -> list[int]:
    """Examples per worker per step for per-replica `counts` (replicas are
    numbered worker by worker)."""
    workers = cluster_lib.of_strategy(strategy).num_workers
    per = len(counts) // workers
    return [int(np.sum(counts[w * per:(w + 1) * per]))
            for w in range(workers)]


def for_trainer(strategy, balance, *, pipelined: bool, asynchronous: bool,
                jit_compile: bool) -> Balancer | None:
    """The Trainer's `Balancer` for its `balance` argument (None: none).

    Raises:
      ValueError: a bad `balance`, or one combined with a runner it cannot
        re-split.
    """
    cluster = cluster_lib.of_strategy(strategy)
    parsed = balance_lib.parse_balance(
        balance, num_replicas=strategy.num_replicas_in_sync,
        num_workers=cluster.num_workers)
    if parsed is None:
        return None
    for refused, why in (
            (pipelined, "a pipelined model splits by stage, not by batch"),
            (asynchronous, "ParameterServerStrategy workers do not wait "
             "for each other, so there is no barrier to balance"),
            (jit_compile, "jit_compile=True recompiles each replica's step "
             "for every new share and cannot hold the compute timer")):
        if refused:
            raise ValueError(f"`balance`={balance!r} is not supported "
                             f"here: {why}. Pass balance=None.")
    return Balancer(strategy, parsed)
