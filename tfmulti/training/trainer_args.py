"""The Trainer's argument checks: each names the argument, shows the value
and says the fix, before anything runs."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti import compat, parameter_server, strategies, zero_stage
from tfmulti.data import finiteness
from tfmulti.training import optimizer_sharding

MIXED_PRECISION = ("mixed_float16", "mixed_bfloat16")


def positive_int(arg, value, hint):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{arg}` should be an int >= 1, got {value!r}. "
                         f"{hint}")
    return value


def resolve_strategy(strategy, model):
    if strategy is not None:
        return strategy
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    for variable in model.variables:
        owner = compat.variable_strategy(variable)
        if owner is not None:
            return owner
    return tf.distribute.get_strategy()


def resolve_metric(metric, strategy):
    if isinstance(metric, keras.metrics.Metric):
        if strategies.outside_scope(strategy, metric.variables) is not None:
            raise ValueError(
                f"The metric {metric.name!r} was created outside the "
                f"scope of the strategy {type(strategy).__name__}, so "
                "its counts would not be summed across replicas and "
                "workers. Create it inside `with strategy.scope():`, or "
                f"pass its name (e.g. {metric.name!r}) and the Trainer "
                "creates it there.")
        return metric
    resolved = keras.metrics.get(metric)
    if isinstance(resolved, keras.metrics.Metric):
        return resolved
    if callable(resolved):
        name = metric if isinstance(metric, str) else resolved.__name__
        return keras.metrics.MeanMetricWrapper(resolved, name=name)
    raise ValueError(f"`metrics` has an entry {metric!r} that is not a "
                     "keras.metrics.Metric or a metric name.")


def async_warmup_steps(value, strategy):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"`async_warmup_steps` should be an int >= 0 (asynchronous "
            f"updates over which the rate warms up; 0: none), got {value!r}.")
    if not parameter_server.is_parameter_server(strategy):
        raise ValueError(
            f"`async_warmup_steps`={value} warms up asynchronous updates, but "
            f"the strategy is {type(strategy).__name__}, whose updates are "
            "synchronous. Drop it, or warm the optimizer's learning rate up "
            "(tfmulti.scaled_learning_rate(..., warmup_steps=...)).")
    return value


def check_eval_data(eval_data):
    finiteness.check_finite(eval_data, arg="eval_data", fix=(
        "Pass an exact-once evaluation stream: tfmulti.distribute_"
        "dataset(..., training=False), or a dataset without .repeat()."))


def check_precision(mixed_precision, model):
    """The Trainer's mixed-precision mode: `mixed_precision`, or the
    model's policy when None; it must match the model's."""
    model_policy = model.dtype_policy.name
    if mixed_precision is None:
        return model_policy if model_policy in MIXED_PRECISION else None
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(
            f"`mixed_precision` is {mixed_precision!r}; use None or one "
            f"of {list(MIXED_PRECISION)}.")
    if model_policy != mixed_precision:
        raise ValueError(
            f"`mixed_precision` is {mixed_precision!r} but the model was "
            f"built with dtype policy {model_policy!r}. Call keras."
            f"mixed_precision.set_global_policy({mixed_precision!r}) "
            "before building the model.")
    return mixed_precision


def check_optimizer_and_loss(optimizer, loss):
    if optimizer is None:
        raise ValueError("`optimizer` is required: a Keras optimizer "
                         "created under the strategy's scope.")
    if not callable(loss):
        raise ValueError(
            f"`loss` should be a callable loss(y_true, y_pred) returning "
            f"per-example losses, got {loss!r}.")


def check_reduction(sync, compression, *, asynchronous: bool):
    if (sync or compression) and asynchronous:
        # Asynchronous updates through the ps: no all-reduce to reduce.
        raise ValueError(
            f"`sync`={sync!r} / `compression`={compression!r} do not "
            "apply to ParameterServerStrategy; pass neither.")


def check_sharding(shard_optimizer_state, *, strategy, optimizer,
                   pipelined: bool, sync, compression) -> int:
    """`shard_optimizer_state`: the ZeRO stage (0, 1 or 2; True is 1), after
    refusing, before anything runs, what a sharded update cannot do."""
    stage = zero_stage.parse(shard_optimizer_state)
    if not stage:
        return 0
    fix = "Pass shard_optimizer_state=False"
    if pipelined:
        raise ValueError(
            f"`shard_optimizer_state`={stage} is not supported for a "
            "pipelined model: each pipeline stage already holds only its own layers' "
            f"optimizer state. {fix}.")
    if parameter_server.is_parameter_server(strategy):
        raise ValueError(
            f"`shard_optimizer_state`={stage} needs synchronous replicas, "
            "but the strategy is ParameterServerStrategy: the parameter servers "
            f"already hold the only copy of the optimizer state. {fix}.")
    if sync is not None:
        raise ValueError(
            f"`shard_optimizer_state`={stage} with `sync`={sync!r}: between "
            "synchronisations every worker keeps its own weights and "
            "optimizer state, while a sharded update writes the same "
            f"gathered weights on every replica. {fix}, or sync=None.")
    if compression is not None:
        raise ValueError(
            f"`shard_optimizer_state`={stage} with `compression`="
            f"{compression!r}: PowerSGD's dense warm-up puts the update "
            "under a tf.cond, which cannot hold the sharded update's "
            f"all-gather. {fix}, or compression=None.")
    if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                 tf.distribute.MultiWorkerMirroredStrategy)):
        raise ValueError(
            f"`shard_optimizer_state`={stage} shards over the replicas of a "
            f"MirroredStrategy or MultiWorkerMirroredStrategy; the strategy "
            f"is {type(strategy).__name__}. Use tfmulti.create_strategy("
            "'mirrored') or 'multi_worker', or pass "
            "shard_optimizer_state=False.")
    optimizer_sharding.check_shardable(optimizer)
    if getattr(optimizer_sharding.inner(optimizer), "built", False):
        raise ValueError(
            f"`optimizer` ({type(optimizer).__name__}) is already built, so "
            "its slots are mirrored on every replica, the memory "
            "`shard_optimizer_state` is there to save. Pass an unbuilt "
            "optimizer (created under the strategy's scope): the Trainer "
            "builds it.")
    return stage


def check_fit(*, steps, global_batch_size, eval_every, eval_data,
              checkpoint_every):
    """`Trainer.fit`'s arguments."""
    positive_int("steps", steps,
                 "It is the total number of optimizer updates to train for.")
    for name, value, hint in (
            ("global_batch_size", global_batch_size,
             "Pass the batch summed over all replicas."),
            ("eval_every", eval_every,
             "Or pass None to evaluate only at the end."),
            ("checkpoint_every", checkpoint_every,
             "Or pass None to save at evaluations and the end.")):
        if value is not None:
            positive_int(name, value, hint)
    if eval_data is not None:
        check_eval_data(eval_data)
