"""Per-worker, per-replica state saved beside the chief's checkpoint.

The chief's checkpoint holds one value per variable (its first replica's).
Under local SGD the workers' weights and inner-optimizer slots differ between
synchronisations, every replica's BatchNorm moving statistics are its own,
and every replica's PowerSGD error-feedback buffer is its own: a resumed run
equals an uninterrupted one only if each worker restores its OWN values of
every replica. So each worker also writes `worker_state/ckpt-<step>-worker<r>`
in `model_dir`: a `tf.train.Checkpoint` of every local component of those
variables (checksummed like any checkpoint), written in a private directory
and renamed into place, so a reader never sees half of one. A step is
restorable only when every worker's state for it is complete.
"""

from __future__ import annotations

import os
import shutil

import tensorflow as tf

from tfmulti import cluster as cluster_lib

DIRECTORY = "worker_state"


def _components(strategy, variable):
    """The variables holding each local replica's value of `variable`."""
    # Keras variables wrap the (distributed) tf.Variable.
    value = getattr(variable, "value", variable)
    if not isinstance(value, tf.Variable):
        value = variable
    return list(strategy.experimental_local_results(value))


class WorkerState:
    """One worker's per-replica values of `variables`, saved per step.

    Args:
      strategy: the strategy the variables live in.
      variables: Keras or tf variables; duplicates are saved once.
      worker_rank: this worker's rank (0 = chief).
      num_workers: workers in the job.
    """

    def __init__(self, strategy, variables, *, worker_rank: int,
                 num_workers: int):
        seen, unique = set(), []
        for v in variables:
            key = id(getattr(v, "value", v))
            if key not in seen:
                seen.add(key)
                unique.append(v)
        per_variable = [_components(strategy, v) for v in unique]
        replicas = max((len(c) for c in per_variable), default=0)
        root = tf.Module(name="worker_state")
        # replica i -> [its component of every variable]: the same structure
        # (and keys) on every worker and every run of the same model.
        root.replicas = [[c[i] if i < len(c) else c[0] for c in per_variable]
                         for i in range(replicas)]
        self._checkpoint = tf.train.Checkpoint(state=root)
        self.rank = int(worker_rank)
        self.num_workers = int(num_workers)

    @staticmethod
    def path(model_dir, step: int, rank: int) -> str:
        """The directory of worker `rank`'s state at `step`."""
        return os.path.join(os.fspath(model_dir), DIRECTORY,
                            f"ckpt-{int(step)}-worker{int(rank)}")

    def write(self, model_dir, step: int) -> str:
        """Writes this worker's state at `step`; atomic (a rename)."""
        final = self.path(model_dir, step, self.rank)
        partial = os.path.join(os.path.dirname(final),
                               f".partial-{os.path.basename(final)}-"
                               f"{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        self._checkpoint.write(os.path.join(partial, "state"))
        # A state saved at the same step by an earlier (killed) run is
        # replaced; between the two calls the step is incomplete, which a
        # reader treats as absent.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        return final

    def complete(self, model_dir, step: int) -> bool:
        """Whether every worker's state at `step` is in place."""
        return all(os.path.exists(os.path.join(
            self.path(model_dir, step, r), "state.index"))
            for r in range(self.num_workers))

    def restore(self, model_dir, step: int) -> None:
        """Restores this worker's state at `step` (after the chief's
        checkpoint, whose single values it overrides per replica)."""
        self._checkpoint.read(os.path.join(
            self.path(model_dir, step, self.rank), "state")
        ).assert_existing_objects_matched()

    def remove_own(self, model_dir) -> None:
        """Removes every state of this worker, and the directory once no
        worker has any left."""
        self.prune(model_dir, 1 << 62, ())
        try:
            os.rmdir(os.path.join(os.fspath(model_dir), DIRECTORY))
        except OSError:
            pass  # another worker's states are still there

    def prune(self, model_dir, step: int, kept_steps) -> None:
        """Removes this worker's states older than `step` whose chief's
        checkpoint is gone (rotated), and its leftovers of killed writes."""
        directory = os.path.join(os.fspath(model_dir), DIRECTORY)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        kept = set(kept_steps)
        mine = f"-worker{self.rank}"
        for name in names:
            if name.startswith(".partial-"):
                # No write of this worker is under way while it prunes.
                stale = mine + "-" in name
            else:
                try:
                    saved = int(name.split("-")[1])
                except (IndexError, ValueError):
                    continue
                stale = name.endswith(mine) and saved < step and (
                    saved not in kept)
            if stale:
                shutil.rmtree(os.path.join(directory, name),
                              ignore_errors=True)


def for_training(strategy, reducer, model, optimizer) -> WorkerState | None:
    """The `WorkerState` a run with `reducer` must save, or None when every
    worker and replica holds the same values (the synchronous update).

    Args:
      strategy: the strategy.
      reducer: the train step's reducer (see `communication`).
      model: the Keras model (all its variables, BatchNorm statistics too).
      optimizer: its optimizer (slots differ per worker under local SGD).
    """
    if reducer is None or not reducer.state_variables():
        return None
    cluster = cluster_lib.of_strategy(strategy)
    return WorkerState(
        strategy, list(model.variables) + list(optimizer.variables) +
        list(reducer.state_variables()), worker_rank=cluster.worker_rank,
        num_workers=cluster.num_workers)
