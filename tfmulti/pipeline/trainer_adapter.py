"""What `tfmulti.Trainer` needs to train a `PipelinedModel`.

The Trainer keeps its controller, actions, checkpoints, evaluation,
summaries, preemption handling and callbacks; only four things differ for a
pipeline, and they live here: the inner loop (the pipelined step instead of
`TrainStep` under a strategy), the forward pass for evaluation (stage by
stage), the optimizer trackable in the checkpoint (`checkpoint.
optimizer_view`: the unsplit optimizer's format), and re-syncing the stages
and groups after a restore. The pipeline runs under TensorFlow's default
strategy: its devices are its own, not a strategy's replicas.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.pipeline import model as model_lib
from tfmulti.training import step as step_lib


def is_pipelined(model) -> bool:
    return isinstance(model, model_lib.PipelinedModel)


def refuse_keras_fit(model) -> None:
    """Raises if `model` is a PipelinedModel or the model inside one.

    Keras `fit` runs one `train_step` on one whole model per replica; the
    pipeline's step runs stages and micro-batches on their own devices, so
    `tfmulti.keras.distributed` does not take it: the Trainer does.
    """
    pipelined = is_pipelined(model) or getattr(
        model, model_lib.PIPELINED_MARK, False)
    if pipelined:
        raise ValueError(
            f"`model` {getattr(model, 'name', type(model).__name__)!r} is "
            "pipelined (tfmulti.pipeline.PipelinedModel), which Keras "
            "`model.fit` through `tfmulti.keras.distributed` cannot train: "
            "Keras runs the whole model per replica. Train it with "
            "`tfmulti.Trainer(pipe, model_dir=...).fit(dataset, steps=N)`: "
            "same checkpoints, evaluation, callbacks and preemption "
            "handling.")


def _refuse(name, value, default, why):
    if value != default:
        raise ValueError(
            f"`{name}`={value!r} is not supported for a PipelinedModel "
            f"({why}); leave `{name}` at {default!r}.")


class TrainerAdapter:
    """The pipeline-specific parts of a `Trainer` over a `PipelinedModel`.

    Args:
      pipe: the `PipelinedModel` (it owns its optimizers and loss).
      optimizer, loss: what the Trainer was given: None, or the very
        objects `pipe` was built with.
      strategy: the Trainer's strategy argument (must be None or the
        default strategy).
      grad_accum_steps, clip_global_norm, allreduce_dtype, mixed_precision,
        on_nonfinite, jit_compile: the Trainer's options; those the
        pipelined step does
        not implement are refused here, by name.
    """

    def __init__(self, pipe, *, optimizer, loss, strategy, grad_accum_steps,
                 clip_global_norm, allreduce_dtype, mixed_precision,
                 on_nonfinite, jit_compile):
        if optimizer is not None and optimizer is not pipe.optimizers[0][0]:
            raise ValueError(
                "`optimizer` was given to the Trainer, but a PipelinedModel "
                "builds one optimizer per stage from the optimizer it was "
                "made with. Pass the optimizer to PipelinedModel(...) and "
                "`optimizer`=None to the Trainer.")
        if loss is not None and loss is not pipe.loss:
            raise ValueError(
                f"`loss`={loss!r} was given to the Trainer, but the "
                "PipelinedModel computes its loss on the last stage. Pass "
                "the loss to PipelinedModel(...) and `loss`=None to the "
                "Trainer.")
        if strategy is not None and strategy is not (
                tf.distribute.get_strategy()):
            raise ValueError(
                f"`strategy`={type(strategy).__name__} was given with a "
                "PipelinedModel, which places its stages on its own devices "
                "(and its data-parallel groups with `data_parallel`). Pass "
                "`strategy`=None.")
        _refuse("grad_accum_steps", grad_accum_steps, 1,
                "use more `micro_batches`: they accumulate the gradient")
        _refuse("clip_global_norm", clip_global_norm, None,
                "each stage is updated on its own device; use the "
                "optimizer's clipnorm or clipvalue")
        _refuse("allreduce_dtype", allreduce_dtype, None,
                "the groups sum stage gradients in float32")
        _refuse("mixed_precision", mixed_precision, None,
                "no loss scaling across stages")
        _refuse("on_nonfinite", on_nonfinite, "raise",
                "no update is skipped across stages")
        _refuse("jit_compile", jit_compile, False,
                "the stages run as separate device functions, not one XLA "
                "cluster")
        self.pipe = pipe
        self.model = pipe.model
        self.optimizer = pipe.optimizers[0][0]
        self.optimizer_view, self.optimizer_layout = (
            pipe.checkpoint_optimizer())

    def train_loop(self, global_batch_size, *, metrics=()):
        """`train(iterator, num_steps)` as `loop.create_train_loop` builds
        it: per-step losses, and `{name: result}` with `metrics`.

        One `tf.function` call per step: the step already runs every stage
        and micro-batch inside one function, so a loop around it adds one
        call overhead per (long) step.
        """
        step = self.pipe.train_step_fn(global_batch_size)

        @tf.function
        def one_step(iterator):
            x, y, sample_weight = step_lib.unpack_batch(next(iterator))
            if sample_weight is not None:
                raise ValueError(
                    "The training batches carry sample weights, which a "
                    "PipelinedModel does not apply (its loss averages every "
                    "example of the global batch). Map the dataset to (x, y) "
                    "batches.")
            loss, outputs = step([tf.convert_to_tensor(t) for t in
                                  keras.tree.flatten(x)], y)
            for metric in metrics:
                metric.update_state(y, outputs)
            return loss

        def train(iterator, num_steps):
            for metric in metrics:
                metric.reset_state()
            losses = tf.stack([one_step(iterator)
                               for _ in range(int(num_steps))])
            if not metrics:
                return losses
            return losses, {m.name: m.result() for m in metrics}

        return train

    def forward(self, x):
        """The model's output for evaluation, stage by stage."""
        return self.pipe.forward_fn()(x)

    def after_restore(self) -> None:
        self.pipe.sync_after_restore()
