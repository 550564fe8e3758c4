"""Keras `fit`, `evaluate` and `predict` of a `PipelinedModel`.

`tfmulti.keras.distributed(pipe)` returns `pipe.model` (the unsplit model,
whose variables group 0 of the pipeline trains in place) compiled with the
pipeline's optimizer, and with three instance attributes that Keras's own
TensorFlow trainer calls: `train_step` runs the pipelined step
(`PipelineRunner.step_on_batch`, the Trainer's too: stages on their devices,
M micro-batches, D groups), `test_step` and `predict_step` run the forward
pass stage by stage. Everything else is Keras's: epochs, `steps_per_epoch`,
`steps_per_execution`, callbacks, History, the loss tracker and compiled
metrics. The pipeline runs under TensorFlow's default strategy (its devices
are its own), where Keras's train function has none of the MirroredStrategy
defects `tfmulti.keras.fit` works around.

Checkpoints (`tfmulti.keras.BackupAndRestore`) save the unsplit model and
the pipeline's optimizer view (`pipeline/checkpoint.py`), the Trainer's
format: they resume under the Trainer and in a one-device process.
"""

from __future__ import annotations

import functools
import inspect

import keras
import tensorflow as tf

from tfmulti import compat
from tfmulti.pipeline import runner as pipeline_runner
from tfmulti.pipeline import unsupported
from tfmulti.training import data_checks
from tfmulti.training import step as step_lib

# The instance attribute holding the PipelineRunner on the unsplit model.
_STATE = "_tfmulti_pipelined_fit"


def adapter_of(model):
    """The `PipelineRunner` of a model made by `distributed(pipe)`, or
    None."""
    return getattr(model, _STATE, None)


def checkpoint_optimizer(model):
    """What to save as `optimizer=` for `model`, and what to call after a
    restore: the pipeline's optimizer view and its re-sync for a pipelined
    model, else `(model.optimizer, None)`."""
    adapter = adapter_of(model)
    if adapter is None:
        return model.optimizer, None
    return adapter.optimizer_view, adapter.after_restore


def _refuse(**options):
    unsupported.check("for a PipelinedModel trained with Keras `fit`",
                      **options)


def _reducing(loss):
    """The pipeline's per-example loss as Keras compiles a loss: averaged
    over the batch. Evaluation computes it (`_test_step`), and a `.keras`
    file of the model keeps it, so the file trains when loaded."""
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        config["reduction"] = "sum_over_batch_size"
        return type(loss).from_config(config)
    return loss  # a function of per-example losses: Keras averages it


def _compile(model, optimizer=None, loss=None, *, metrics=None,
             steps_per_execution=1, jit_compile=False, run_eagerly=False,
             loss_weights=None, weighted_metrics=None, auto_scale_loss=True):
    """`model.compile` for a pipelined model: metrics and
    `steps_per_execution` are the caller's; the optimizer and loss are the
    PipelinedModel's."""
    adapter = adapter_of(model)
    pipe = adapter.pipe
    if optimizer is not None and optimizer is not adapter.optimizer:
        raise ValueError(
            f"`optimizer`={optimizer!r} was given to compile, but a "
            "PipelinedModel updates each stage with its own copy of the "
            "optimizer it was made with. Pass the optimizer to "
            "PipelinedModel(...) and leave `optimizer` out of compile.")
    if loss is not None and loss is not pipe.loss:
        raise ValueError(
            f"`loss`={loss!r} was given to compile, but the PipelinedModel "
            "computes its loss on the last stage. Pass the loss to "
            "PipelinedModel(...) and leave `loss` out of compile.")
    _refuse(jit_compile=jit_compile, loss_weights=loss_weights)
    if not isinstance(steps_per_execution, int) or isinstance(
            steps_per_execution, bool) or steps_per_execution < 1:
        raise ValueError(f"`steps_per_execution` should be a positive int, "
                         f"got {steps_per_execution!r}.")
    # No loss scaling: the stage optimizers are plain.
    type(model).compile(
        model, optimizer=adapter.optimizer, loss=_reducing(pipe.loss),
        metrics=metrics, weighted_metrics=weighted_metrics,
        steps_per_execution=steps_per_execution, jit_compile=False,
        run_eagerly=run_eagerly, auto_scale_loss=False)


def _track_loss(model, x, loss):
    """The "loss" Keras reports: the batch mean, weighted by batch size."""
    batch = tf.shape(keras.tree.flatten(x)[0])[0]
    compat.loss_tracker(model).update_state(loss, sample_weight=batch)


def _train_step(model, data):
    # Keras's `train_step` updates these after its update: the loss
    # tracker with the batch's mean loss, the compiled metrics.
    loss, y, outputs = adapter_of(model).step_on_batch(data)
    x = step_lib.unpack_batch(data)[0]
    _track_loss(model, x, loss)
    return model.compute_metrics(x, y, outputs, sample_weight=None)


def _test_step(model, data):
    # Keras's `test_step`, with the forward pass stage by stage.
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = adapter_of(model).forward(x)
    loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                              sample_weight=sample_weight, training=False)
    _track_loss(model, x, loss)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _predict_step(model, data):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return adapter_of(model).forward(x)


def _check_training_data(pipe, x):
    if not isinstance(x, tf.data.Dataset):
        raise ValueError(
            f"`x` is a {type(x).__name__}; Keras `fit` of a PipelinedModel "
            "trains from a tf.data.Dataset of (x, y) batches of a fixed "
            "size (batch(..., drop_remainder=True)), which the pipeline "
            "splits into micro-batches. Pass such a dataset.")
    size = data_checks.batch_size(x.element_spec)
    if size is None:
        raise ValueError(
            f"`x` yields batches of no static size (element_spec "
            f"{x.element_spec}); the pipeline splits each batch into equal "
            "micro-batches. Batch the dataset with drop_remainder=True.")
    pipe.train_step_fn(int(size))  # raises if M x D does not divide it


def _fit(model, *args, **kwargs):
    bound = inspect.signature(type(model).fit).bind(model, *args, **kwargs)
    arguments = bound.arguments
    _refuse(**{name: arguments[name] for name in (
        "class_weight", "sample_weight", "validation_split")
        if name in arguments})
    adapter = adapter_of(model)
    _check_training_data(adapter.pipe, arguments.get("x"))
    # Keras ignores it for datasets, and warns when it is True (its
    # default).
    arguments.setdefault("shuffle", False)
    if adapter.optimizer is not model.optimizer:
        raise ValueError(
            f"`model` {model.name!r} was compiled with another optimizer "
            f"({model.optimizer!r}) than its PipelinedModel's; compile it "
            "without `optimizer`.")
    # Weights set or loaded into the model since the last fit reach the
    # other data-parallel groups.
    adapter.pipe.sync_groups()
    return type(model).fit(*bound.args, **bound.kwargs)


def distributed(pipe, *, grad_accum_steps, clip_global_norm, allreduce_dtype,
                jit_compile, sync, compression) -> keras.Model:
    """`tfmulti.keras.distributed` for a `PipelinedModel` (see there).

    Returns:
      `pipe.model`, compiled with the pipeline's optimizer (no metrics,
      `steps_per_execution`=1). Compile it again for metrics or
      `steps_per_execution`: `km.compile(metrics=[...],
      steps_per_execution=K)`, without optimizer or loss.

    Raises:
      ValueError: an option the pipelined step does not implement, named.
    """
    adapter = pipeline_runner.PipelineRunner(
        pipe, optimizer=None, loss=None, strategy=None,
        grad_accum_steps=grad_accum_steps, clip_global_norm=clip_global_norm,
        allreduce_dtype=allreduce_dtype, mixed_precision=None,
        on_nonfinite="raise", jit_compile=jit_compile, sync=sync,
        compression=compression)
    model = pipe.model
    setattr(model, _STATE, adapter)
    # Instance attributes shadow the class's methods for this model only;
    # Keras's trainer looks them up when it makes its functions.
    model.compile = functools.partial(_compile, model)
    model.train_step = functools.partial(_train_step, model)
    model.test_step = functools.partial(_test_step, model)
    model.predict_step = functools.partial(_predict_step, model)
    model.fit = functools.partial(_fit, model)
    model.compile()
    return model
