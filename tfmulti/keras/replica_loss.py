"""Keras's compiled loss on one replica's share of a batch.

Under a strategy Keras scales each replica's loss by 1/replicas, which is
one device's loss only when every replica holds the same number of
examples. `distributed` weights it by the replica's real share instead
(a last partial batch, an uneven split) and averages evaluation over the
real examples of a padded stream.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from tfmulti import compat
from tfmulti.keras import replica_logs as logs_lib
from tfmulti.training import step as step_lib


def forward(model, x, y, sample_weight, *, training):
    """Predictions and the compiled loss as Keras's own steps compute them;
    `_compute_loss` accepts a pre-3.3 `compute_loss(x, y, y_pred,
    sample_weight)` override as Keras does."""
    if compat.call_has_training_arg(model):
        y_pred = model(x, training=training)
    else:
        y_pred = model(x)
    return y_pred, compat.compute_compiled_loss(
        model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
        training=training)


def loss_reduction(model):
    """"sum_over_batch_size" or "sum" if every compiled loss reduces that
    way (or there is none), else None: how Keras's compiled loss treats a
    replica's batch. Read after the loss was built (at trace time)."""
    losses = compat.compiled_loss_objects(model)
    if losses is None:
        return None
    reductions = {getattr(loss, "reduction", None) for loss in losses}
    if not reductions:
        return "sum"
    if len(reductions) == 1 and reductions <= {"sum_over_batch_size",
                                               "sum"}:
        return reductions.pop()
    return None


def _warn_weighting_once(model, state, why):
    if state.warned_weighting:
        return
    state.warned_weighting = True
    warnings.warn(
        f"tfmulti.keras.distributed cannot weight a partial or uneven batch "
        f"by each replica's share for {model.name!r}: {why}. Each replica's "
        "loss keeps Keras's 1/replicas weight, so such a batch gives a "
        "different update than one device. Batch the training data with "
        "drop_remainder=True and a global batch divisible by the replicas.",
        UserWarning, stacklevel=2)


def compute_loss_fn(model, state):
    """The Trainer step's `compute_loss` for a compiled model: Keras's
    loss, loss tracker and metrics, the loss weighted by the replica's
    share of `global_batch` when given."""
    strategy = model.distribute_strategy
    num_replicas = strategy.num_replicas_in_sync
    custom_loss = logs_lib.overrides(model, "compute_loss")

    def compute_loss(x, y, sample_weight, global_batch=None):
        # What Keras's `train_step` does, minus the gradient: the compiled
        # loss is this replica's mean scaled by 1/replicas (Keras).
        y_pred, loss = forward(model, x, y, sample_weight, training=True)
        local = tf.cast(tf.shape(step_lib.first_tensor(x))[0], loss.dtype)
        if global_batch is None:
            tracked = loss * num_replicas
        else:
            global_batch = tf.cast(global_batch, loss.dtype)
            reduction = None if custom_loss else loss_reduction(model)
            if reduction == "sum_over_batch_size":
                # Weight the data term by this replica's real share: its
                # mean times local/global, not times 1/replicas. The
                # regularisation terms are the same on every replica and
                # keep 1/replicas.
                extra = tf.zeros_like(loss)
                for term in model.losses:
                    extra += tf.cast(compat.additional_loss(model, term),
                                     loss.dtype)
                loss = (loss - extra) * (
                    num_replicas * local / global_batch) + extra
            elif reduction is None:
                _warn_weighting_once(
                    model, state, "it overrides `compute_loss`" if custom_loss
                    else "its compiled losses do not all use the "
                    "'sum_over_batch_size' reduction")
            # Summed over replicas, value x weight is the batch's loss x its
            # size, as one device tracks it.
            tracked = tf.math.divide_no_nan(loss * global_batch, local)
        compat.loss_tracker(model).update_state(tracked, sample_weight=local)
        logs = model.compute_metrics(x, y, y_pred,
                                     sample_weight=sample_weight)
        if state.train_extras is not None:
            state.train_extras.capture(logs, x)
        return loss, y_pred
    return compute_loss


def train_metrics_logs(model):
    """The logs of `compute_metrics` in training (for the key discovery)."""
    def replica_fn(batch):
        x, y, sample_weight = step_lib.unpack_batch(batch)
        y_pred, _ = forward(model, x, y, sample_weight, training=True)
        return model.compute_metrics(x, y, y_pred,
                                     sample_weight=sample_weight)
    replica_fn.__name__ = "compute_metrics"
    return replica_fn


def masked_test_step(model, batch):
    """Keras's `test_step` on an evaluation stream of
    `tfmulti.distribute_dataset`, whose weights are 1 on real examples and
    0 on padding: the loss is averaged over the real examples only.

    Keras's 'sum_over_batch_size' divides the weighted sum by all the rows,
    padding included, and tracks the loss with the row count as its weight,
    so padding would pull the loss towards 0 by an amount that depends on
    the number of replicas. Here the weights are scaled to sum to the rows
    (the batch's loss is the mean over its real examples) and the loss is
    tracked with the real count. Metrics get the mask as their weights, as
    in Keras.
    """
    x, y, mask = batch
    if compat.call_has_training_arg(model):
        y_pred = model(x, training=False)
    else:
        y_pred = model(x)
    compiled = compat.compiled_loss(model)
    if compiled is not None and not compiled.built:
        # As its first call would; `loss_reduction` reads what it built.
        compiled.build(y, y_pred)
    rows = tf.cast(tf.shape(step_lib.first_tensor(x))[0], mask.dtype)
    real = tf.reduce_sum(mask)
    weights, count = mask, rows
    if loss_reduction(model) == "sum_over_batch_size":
        weights, count = mask * tf.math.divide_no_nan(rows, real), real
    loss = compat.compute_compiled_loss(model, x=x, y=y, y_pred=y_pred,
                                        sample_weight=weights, training=False)
    # Keras's loss carries a 1/replicas scale under a strategy; its own
    # `test_step` tracks it without.
    compat.loss_tracker(model).update_state(
        compat.unscaled_keras_loss(loss, model.distribute_strategy),
        sample_weight=count)
    return model.compute_metrics(x, y, y_pred, sample_weight=mask)

