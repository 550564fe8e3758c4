"""Inner loops: N steps inside one `tf.function`, as Orbit builds them.

A Python loop around a `tf.function` of one step pays the call overhead every
step; Keras's `steps_per_execution` wraps each step in a `tf.cond`, which
MirroredStrategy cannot run. Here a `tf.range` loop calls the step N times
with no conditional around its synchronisation points, and the per-step
losses are summed across replicas once per loop, not once per step.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import watchdog
from tfmulti import replica_statistics
from tfmulti.training import xla as xla_lib


def _check_num_steps(num_steps):
    if not isinstance(num_steps, tf.Tensor):
        raise ValueError(
            f"`num_steps` should be a `tf.Tensor`, got {num_steps!r}. Passing "
            "a Python value can cause unnecessary retracing; pass "
            "tf.constant(n, tf.int32).")


def sum_over_replicas(strategy, local):
    """Sums a per-worker tensor (already summed over this worker's replicas)
    over all workers, in one reduction. Call in cross-replica context."""
    num_local = len(strategy.extended.worker_devices)
    # Replica ids run worker by worker, so `id % num_local == 0` picks each
    # worker's first replica: exactly one copy per worker enters the sum.
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.identity(local) if (
            ctx.replica_id_in_sync_group % num_local == 0)
        else tf.zeros_like(local))
    if not tf.executing_eagerly():  # timed by the call that runs the graph
        return strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)
    # Eager: an agreement between loops (preemption, schedules) waits on the
    # peers like a loop does.
    with watchdog.calling(strategy, "eager all-reduce"):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)


def create_train_loop(step_fn, *, strategy, metrics=(), before=(),
                      read=None):
    """Builds `train(iterator, num_steps)`: `num_steps` calls of `step_fn`.

    Args:
      step_fn: `step_fn(iterator)`, called in cross-replica context inside a
        `tf.function`; returns a per-replica scalar (e.g. a `TrainStep`'s
        loss share) whose sum over replicas is that step's value.
      strategy: the strategy `step_fn` runs under.
      metrics: Keras metrics that `step_fn` updates: reset at the start of
        each call and read at its end, inside the one `tf.function` (no
        eager collective per metric variable between loops).
      before: callables traced at the start of each call, before the first
        step (e.g. `numerics.WeightCheck.record`); results dropped.
      read: a callable traced after the last step, whose value the call
        returns in place of the per-step losses: Keras `fit` reads its
        metrics so, in the same function call, and skips the per-step loss
        array and its sum over replicas, which it does not use.

    Returns:
      `train(iterator, num_steps) -> tf.Tensor` of shape [num_steps]: per
      step, the sum over replicas of `step_fn`'s value; with `metrics`, a
      pair (that tensor, {metric name: result}); with `read`, its value.
      `num_steps` must be a scalar `tf.Tensor`, so that one trace serves
      every loop length.
    """

    num_local = len(strategy.extended.worker_devices)

    @tf.function
    def loop(iterator, num_steps):
        for metric in metrics:
            metric.reset_state()
        for fn in before:
            fn()
        if read is None:
            # One array per local replica, written on that replica's
            # device: no cross-device copy per step, one sum after the loop.
            values = [tf.TensorArray(tf.float32, size=num_steps)
                      for _ in range(num_local)]
            for i in tf.range(num_steps):
                local = strategy.experimental_local_results(step_fn(iterator))
                values = [array.write(i, tf.cast(value, tf.float32))
                          for array, value in zip(values, local)]
            losses = sum_over_replicas(strategy, tf.add_n(
                [array.stack() for array in values]))
        else:
            for _ in tf.range(num_steps):
                step_fn(iterator)
        # Evaluation, get_weights and checkpoints then see one value of
        # BatchNorm's moving statistics, not replica 0's or each replica's.
        replica_statistics.average(strategy, getattr(step_fn, "model", None))
        if read is not None:
            return read()
        if not metrics:
            return losses
        return losses, {m.name: m.result() for m in metrics}

    def train(iterator, num_steps):
        _check_num_steps(num_steps)
        # A loop waiting on a stuck peer fails after `stall_timeout_seconds`;
        # an op XLA cannot compile fails here, at the first run, naming it.
        with watchdog.calling(strategy, loop), xla_lib.named_compile_errors(
                getattr(step_fn, "model", None)):
            return loop(iterator, num_steps)

    train.traced = loop
    return train


@tf.function
def _skip(iterator, num_batches):
    for _ in tf.range(num_batches):
        next(iterator)


def skip_batches(iterator, num_batches: int) -> None:
    """Advances `iterator` by `num_batches` batches without training on them.

    Resumes a deterministic input pipeline whose iterator cannot be
    checkpointed (TF 2.21's distributed iterators are not trackable).
    """
    if num_batches > 0:
        _skip(iterator, tf.constant(num_batches, tf.int64))

