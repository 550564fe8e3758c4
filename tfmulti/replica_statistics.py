"""Per-replica copies of a model's non-trainable state, made equal.

Keras 3 (checked up to 3.15) creates BatchNormalization's `moving_mean` and
`moving_variance` with aggregation "none". Under a mirrored strategy each
replica then updates its own copy from its own part of the batch: the
copies drift apart (0.037 after one epoch on 4 replicas), evaluation during
training uses each replica's copy, and `get_weights` / a checkpoint holds
replica 0's. So the accuracy printed during training is not the accuracy
of the saved model.

The moving statistics are an exponential average, linear in the batch
statistics, so the mean of the replicas' copies is exactly what one copy
updated with the mean of the replicas' batch statistics every step (an
ON_WRITE MEAN variable) would hold. `average` sets every copy to that mean;
the train loop calls it once at the end of each loop (one small all-reduce
per loop, not per step). Plain Keras `fit` under a tfmulti strategy gets it
after every step instead (`averaged_after`, through `tfmulti.compat`).
"""

from __future__ import annotations

import functools

import tensorflow as tf


def unsynchronized(model) -> list:
    """`model`'s non-trainable variables that each replica updates alone."""
    found = []
    for variable in model.non_trainable_variables:
        value = getattr(variable, "value", variable)
        # Floating only: a seed generator's integer state is the same on
        # every replica anyway.
        if (isinstance(value, tf.distribute.DistributedValues) and
                value.dtype.is_floating and
                value.synchronization != tf.VariableSynchronization.ON_READ
                and value.aggregation == tf.VariableAggregation.NONE):
            found.append(variable)
    return found


def average(strategy, model, *, communication_options=None):
    """Sets each replica's copy of `model`'s unsynchronized variables to
    their mean over all replicas (all workers' too).

    Call it in cross-replica context (inside a `tf.function`), on every
    worker at the same point: it holds a collective. Nothing to do on one
    replica or without such variables.
    """
    if model is None or strategy.num_replicas_in_sync == 1:
        return
    variables = unsynchronized(model)
    if not variables:
        return

    strategy.run(lambda: _average_in_replica(
        variables, communication_options=communication_options))


def _average_in_replica(variables, *, communication_options=None):
    context = tf.distribute.get_replica_context()
    # Read in replica context, a variable with aggregation NONE is this
    # replica's copy, and assigning it writes only that copy.
    means = context.all_reduce(
        tf.distribute.ReduceOp.MEAN,
        [tf.identity(v.value) for v in variables],
        options=communication_options)
    for variable, mean in zip(variables, means):
        variable.assign(mean)


def averaged_after(train_step):
    """Keras's plain `fit` step (a model's bound `train_step`, run in
    replica context on two or more replicas: `compat.check_keras_step`
    wraps it only then), followed by the average of the model's
    unsynchronized variables: every step, as the step is all tfmulti sees
    of plain `fit`. Automatic control dependencies read each variable after
    the step's own update of it."""
    model = train_step.__self__

    @functools.wraps(train_step)
    def step(*args, **kwargs):
        logs = train_step(*args, **kwargs)
        variables = unsynchronized(model)
        if variables:
            _average_in_replica(variables)
        return logs

    return step
