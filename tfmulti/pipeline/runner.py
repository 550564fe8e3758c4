"""The pipeline runner: what `tfmulti.Trainer` (and Keras `fit`,
`tfmulti.keras.pipelined`) needs to train a `PipelinedModel`.

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
from tfmulti.pipeline import unsupported
from tfmulti.training import step as step_lib
from tfmulti.training import synchronous


def is_pipelined(model) -> bool:
    return isinstance(model, model_lib.PipelinedModel)


def refuse_keras_fit(model) -> None:
    """Raises if `model` is the model inside a PipelinedModel.

    `tfmulti.keras.distributed` takes the PipelinedModel itself (its step
    runs stages and micro-batches on their own devices); given the model
    inside, it would run the whole model per replica.
    """
    if not is_pipelined(model) and getattr(model, model_lib.PIPELINED_MARK,
                                           False):
        raise ValueError(
            f"`model` {model.name!r} is the model inside a "
            "tfmulti.pipeline.PipelinedModel, which Keras `fit` would run "
            "whole, per replica. Pass the PipelinedModel itself: "
            "`km = tfmulti.keras.distributed(pipe)`, then `km.fit(...)`.")


class PipelineRunner:
    """The pipeline-specific parts of a `Trainer` over a `PipelinedModel`.

    Args:
      pipe: the `PipelinedModel` (it owns its optimizers and loss).
      optimizer, loss: what the Trainer was given: None, or the very
        objects `pipe` was built with.
      strategy: the Trainer's strategy argument (must be None or the
        default strategy).
      grad_accum_steps, clip_global_norm, allreduce_dtype, mixed_precision,
        on_nonfinite, jit_compile, sync, compression: the Trainer's
        options; those the pipelined step does not implement are refused
        (`unsupported.check`), by name.
    """

    def __init__(self, pipe, *, optimizer, loss, strategy, grad_accum_steps,
                 clip_global_norm, allreduce_dtype, mixed_precision,
                 on_nonfinite, jit_compile, sync=None, compression=None):
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
        unsupported.check(
            "for a PipelinedModel", grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype, mixed_precision=mixed_precision,
            on_nonfinite=on_nonfinite, jit_compile=jit_compile, sync=sync,
            compression=compression)
        self.pipe = pipe
        self.model = pipe.model
        self.optimizer = pipe.optimizers[0][0]
        self.optimizer_view, self.optimizer_layout = (
            pipe.checkpoint_optimizer())

    def step_on_batch(self, batch, *, global_batch_size=None):
        """One pipelined update on `batch`, inside a `tf.function`.

        The one per-batch step of both entry points: the Trainer's loop and
        Keras `fit` (`tfmulti.keras.pipelined`).

        Args:
          batch: `(x, y)`; sample weights are refused.
          global_batch_size: the batch's size; None reads the static size
            of the first input.

        Returns:
          `(loss, y, outputs)`: the mean loss over the global batch, the
          targets, and the model's output on the batch (in batch order).
        """
        x, y, sample_weight = step_lib.unpack_batch(batch)
        if sample_weight is not None:
            raise ValueError(
                "The training batches carry sample weights, which a "
                "PipelinedModel does not apply (its loss averages every "
                "example of the global batch). Map the dataset to (x, y) "
                "batches.")
        xs = [tf.convert_to_tensor(t) for t in keras.tree.flatten(x)]
        if global_batch_size is None:
            global_batch_size = xs[0].shape[0]
            if global_batch_size is None:
                raise ValueError(
                    "The training batches have no static size (input spec "
                    f"{xs[0].shape}); a PipelinedModel splits each batch "
                    "into equal micro-batches when the step is traced. "
                    "Batch the dataset with drop_remainder=True.")
        step = self.pipe.train_step_fn(int(global_batch_size))
        loss, outputs = step(xs, y)
        return loss, y, outputs

    def train_loop(self, global_batch_size, *, metrics=()):
        """`train(iterator, num_steps)` as `loop.create_train_loop` builds
        it: per-step losses, and `{name: result}` with `metrics`.

        One `tf.function` call per step: the step already runs every stage
        and micro-batch inside one function, so a loop around it adds one
        call overhead per (long) step.
        """
        self.pipe.train_step_fn(global_batch_size)  # checks the batch now

        @tf.function
        def one_step(iterator):
            loss, y, outputs = self.step_on_batch(
                next(iterator), global_batch_size=global_batch_size)
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

    def trainer_runner(self, parts, **options):
        """The Trainer's runner for this pipeline (`parts` and `options`:
        as `synchronous.SynchronousRunner` takes them)."""
        return PipelinedRunner(self, parts, **options)


class PipelinedRunner(synchronous.SynchronousRunner):
    """The synchronous runner (data, restore, loop, evaluation) with the
    pipeline's step, its stage-by-stage forward pass, its optimizer in the
    unsplit optimizer's checkpoint format, and its stages re-synced after a
    restore. No weight check: the pipelined step has its own loop.

    Args:
      pipeline: the model's `PipelineRunner`.
      parts, options: as `synchronous.SynchronousRunner` takes them.
    """

    checks_weights = False

    def __init__(self, pipeline: PipelineRunner, parts, **options):
        super().__init__(parts, **options)
        self.pipeline = pipeline
        self.forward = pipeline.forward

    def _train_fn(self, batch):
        if batch not in self.loops:
            self.loops[batch] = self.pipeline.train_loop(
                batch, metrics=self.parts.metrics)
        return self.loops[batch]

    def trackables(self) -> dict:
        return {**super().trackables(),
                "optimizer": self.pipeline.optimizer_view}

    def worker_state(self):
        return None

    def restored(self, position, *, batch, missing):
        self.pipeline.after_restore()
        super().restored(position, batch=batch, missing=missing)
