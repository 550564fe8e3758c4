"""The one restore: of the Trainer (every runner) and of Keras `fit`'s
`tfmulti.keras.BackupAndRestore`.

Every worker restores the newest intact checkpoint, the workers agree that
it is the same one (an all-reduce of its position), the caller redoes what
its way of training needs (`after`), and an elastic resume (another number
of replicas or workers, another per-replica batch) is said in one line. Any
error closes the checkpointer (its `model_dir` lock) before it propagates.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import watchdog
from tfmulti.training import checkpoints as checkpoints_lib


def position(strategy, step: int, batch: int, batches_per_step: int, *,
             loss_finite: bool = True) -> checkpoints_lib.Position:
    """The position a run of `strategy` saves after `step` updates of
    `batches_per_step` global batches of `batch` examples."""
    return checkpoints_lib.Position(
        step=step, examples=step * batch * batches_per_step,
        global_batch_size=batch, batches_per_step=batches_per_step,
        num_replicas=strategy.num_replicas_in_sync,
        num_workers=cluster_lib.of_strategy(strategy).num_workers,
        loss_finite=loss_finite)


def restore(checkpointer, strategy, *, collective=True, after=None):
    """Restores `checkpointer`'s newest intact checkpoint.

    Args:
      checkpointer: a `checkpoints.Checkpointer` of what to restore.
      strategy: its strategy.
      collective: whether the workers restore together (False under a
        parameter-server strategy, where only the chief restores).
      after: `after(position)`, called once a checkpoint was restored and
        agreed on (e.g. a replay of the batches the restored updates used).

    Returns:
      The restored `checkpoints.Position`, or None (nothing to restore).
    """
    try:
        position = checkpointer.restore()
        if collective and cluster_lib.of_strategy(strategy).num_workers > 1:
            check_workers_agree(strategy, position)
        if position is not None and after is not None:
            after(position)
    except BaseException:
        checkpointer.close()
        raise
    return position


def restore_runner(runner, model_dir, strategy, *, batch: int,
                   batches_per_step: int, say=None):
    """The Trainer's restore from `model_dir` through its `runner` (what
    it checkpoints, how it redoes the data position), refusing another
    global batch; `say(line)` reports it.

    Returns:
      (the `checkpoints.Checkpointer`, the restored Position or None).
    """
    checkpointer = checkpoints_lib.Checkpointer(
        model_dir, strategy, optional=runner.optional,
        worker_state=runner.worker_state(), before_save=runner.before_save,
        **runner.trackables())

    def after(restored):
        if restored.global_batch_size not in (None, batch):
            raise ValueError(
                f"`model_dir` {model_dir!r} was trained with global "
                f"batch {restored.global_batch_size}, and this run's is "
                f"{batch}. Resume with `global_batch_size`="
                f"{restored.global_batch_size} (the per-replica batch is "
                "recomputed for the replicas you have), or use a new "
                "`model_dir`.")
        runner.restored(restored, batch=batch, missing=checkpointer.missing)

    restored = restore(checkpointer, strategy, after=after,
                       collective=runner.collective)
    if restored is not None and say is not None:
        say(restored_line(
            checkpointer, restored,
            position(strategy, restored.step, batch, batches_per_step),
            at=f" at step {restored.step}", elastic_note=(
                "; the learning-rate schedule continues at step "
                f"{restored.step}")))
    return checkpointer, restored


def restored_line(checkpointer, position, now, *, at: str = "",
                  elastic_note: str = "") -> str:
    """"restored PATH[at]" and, on an elastic resume, what changed from
    `position` to `now` (the position the run would save now), then
    `elastic_note`."""
    changes = position.changes_to(now)
    return (f"restored {checkpointer.restored_path}{at}" + (
        f" (elastic resume: {'; '.join(changes)}{elastic_note})"
        if changes else ""))


def check_workers_agree(strategy,
                        position: checkpoints_lib.Position | None) -> None:
    """Raises unless every worker restored the same position.

    One all-reduce: the positions agree iff their variance over the
    replicas is zero (ReduceOp has no MIN/MAX); float64 keeps it exact.
    Call on every worker at the same point.
    """
    position = position or checkpoints_lib.Position()
    values = [position.step, position.epoch or 0, position.batch or 0]
    local = tf.constant([1.0] + values + [v * v for v in values],
                        tf.float64)

    @tf.function
    def all_sums():
        return strategy.run(lambda: tf.distribute.get_replica_context(
        ).all_reduce(tf.distribute.ReduceOp.SUM, local))

    with watchdog.calling(strategy, all_sums):
        sums = strategy.experimental_local_results(all_sums())[0].numpy()
    n, firsts, squares = sums[0], sums[1:4], sums[4:]
    if any(n * s != f * f for f, s in zip(firsts, squares)):
        raise RuntimeError(
            f"This worker would resume at step {position.step} (epoch "
            f"{position.epoch}, batch {position.batch}), but the {n:.0f} "
            f"replicas average step {firsts[0] / n:g}: the workers do not "
            "read the same checkpoint. Put `model_dir` on a filesystem "
            "every worker can read (NFS, GCS, ...).")
