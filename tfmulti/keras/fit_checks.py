"""The argument checks of `tfmulti.keras.distributed`: what it refuses
before it changes anything on the model."""

from __future__ import annotations

import keras

from tfmulti import compat
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import reducers
from tfmulti.training import step as step_lib
from tfmulti.training import trainer_args as args_lib


def check_accumulation(optimizer):
    """Refuses Keras's `gradient_accumulation_steps` (a crash under a
    strategy), naming `distributed`'s own option."""
    gradients_lib.reject_keras_accumulation(
        optimizer, instead="call tfmulti.keras.distributed(model, "
        "grad_accum_steps={steps})")


def check_model(model):
    """Refuses a model `distributed` cannot train: not a compiled Keras
    model under a strategy, or one whose `train_step` it would bypass."""
    from tfmulti.pipeline import runner as pipeline_runner
    pipeline_runner.refuse_keras_fit(model)
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` should be a keras.Model, got "
                         f"{type(model).__name__}.")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            f"`model` {model.name!r} is not compiled with an optimizer. Call "
            "model.compile(optimizer=..., loss=..., steps_per_execution=...) "
            "under `strategy.scope()` first, then tfmulti.keras."
            "distributed(model).")
    if compat.model_strategy(model) is None:
        # TensorFlow's default strategy has no devices to loop over.
        raise ValueError(
            f"`model` {model.name!r} was built without a strategy. Create it "
            "and compile it under `with strategy.scope():`, with strategy = "
            "tfmulti.create_strategy(...) (\"one_device\" for one device).")
    own = type(model).train_step
    if own is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which "
            "tfmulti.keras.distributed would silently replace with tfmulti's "
            "step. Override `compute_loss` / `compute_metrics` instead, or "
            "use tfmulti.Trainer.")
    if "train_step" in vars(model):
        raise ValueError(
            f"`model.train_step` of {model.name!r} was replaced on the "
            "instance, which tfmulti.keras.distributed would silently "
            "bypass with tfmulti's step. Override `compute_loss` / "
            "`compute_metrics` instead, or use tfmulti.Trainer.")
    check_accumulation(model.optimizer)


def check_arguments(model, *, grad_accum_steps, clip_global_norm,
                    allreduce_dtype, sync, compression,
                    shard_optimizer_state):
    """`distributed`'s checks of a (not pipelined) model and its options.

    Returns:
      (the `step.GradientOptions`, whether the optimizer state is sharded).
    """
    check_model(model)
    options = step_lib.GradientOptions(
        grad_accum_steps=grad_accum_steps, clip_global_norm=clip_global_norm,
        allreduce_dtype=allreduce_dtype)
    reducers.check_options(sync, compression,
                           allreduce_dtype=allreduce_dtype)
    sharded = args_lib.check_sharding(
        shard_optimizer_state, strategy=model.distribute_strategy,
        optimizer=model.optimizer, pipelined=False, sync=sync,
        compression=compression)
    return options, sharded
