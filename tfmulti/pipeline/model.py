"""A Keras model trained as a pipeline of stages over devices (GPipe).

`PipelinedModel(model, ...)` cuts `model` into S stages (`split`), puts each
stage's variables on its device (`placement`), and trains with a step that
splits the global batch over D data-parallel groups and each group's share
into M micro-batches, runs the schedule (`schedule`) inside one
`tf.function`, sums each stage's gradients over the micro-batches and, with
D > 1, over the groups (`group_sum`), then applies them once. The update
equals one device's on the whole global batch.

The stages are sub-models over the unsplit model's own layers; group 0 of
the pipeline trains `model`'s variables in place, so `model` itself is the
checkpoint: `model.save_weights` / `load_weights` (or this class's
wrappers, which also refresh groups 1..D-1) interchange with an unsplit run.
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfmulti.pipeline import checkpoint as checkpoint_lib
from tfmulti.pipeline import options as options_lib
from tfmulti.pipeline.options import PipelineOptions
from tfmulti.pipeline import placement
from tfmulti.pipeline import group_sum
from tfmulti.pipeline import schedule as schedule_lib
from tfmulti.pipeline import split


# Set on a model that a PipelinedModel trains, so that entry points which
# would run it whole (Keras `fit`) refuse it by name.
PIPELINED_MARK = "_tfmulti_pipelined"


def _floating(tensors):
    return [t for t in tensors if t.dtype.is_floating]


class PipelinedModel:
    """A Keras model split into pipeline stages over devices.

    Example:
      tfmulti.simulate_devices(4)
      model = make_model()  # functional or Sequential
      pipe = tfmulti.pipeline.PipelinedModel(
          model, optimizer=keras.optimizers.Adam(1e-3),
          loss=keras.losses.SparseCategoricalCrossentropy(
              from_logits=True, reduction=None),
          num_stages=4, micro_batches=8)
      for x, y in dataset:
          loss = pipe.train_step(x, y)
    """

    def __init__(self, model: keras.Model, *, optimizer, loss: Callable,
                 num_stages: int, micro_batches: int = 1,
                 data_parallel: int = 1, cuts: Sequence[str] | None = None,
                 schedule: str = "gpipe", carry_skips: bool = False,
                 devices: Sequence[str] | None = None, verbose: bool = True):
        """Splits `model`, places its stages and builds the optimizers.

        Args:
          model: a built functional or Sequential Keras model (outside any
            strategy scope).
          optimizer: a Keras optimizer, not yet built, without
            global_clipnorm; stage 0 of group 0 uses it, every other stage
            and group a copy from its config (on its own device).
          loss: per-example loss `loss(y_true, y_pred)`, e.g. a Keras loss
            with `reduction=None`; averaged over the global batch.
          num_stages, micro_batches, data_parallel, cuts, schedule,
            carry_skips: see `PipelineOptions`.
          devices: device names to use (D * S of them); the logical GPUs,
            else the logical CPUs, by default.
          verbose: print the cut and the parameter bytes per device.
        """
        self.options = PipelineOptions(
            num_stages=num_stages, micro_batches=micro_batches,
            data_parallel=data_parallel,
            cuts=None if cuts is None else tuple(cuts), schedule=schedule,
            carry_skips=carry_skips)
        if getattr(loss, "reduction", None) not in (None, "none"):
            raise ValueError(
                f"`loss` reduces its values (reduction={loss.reduction!r}); "
                "the pipeline averages per-example losses over the global "
                "batch itself. Pass the loss with reduction=None.")
        if getattr(optimizer, "global_clipnorm", None):
            raise ValueError(
                f"`optimizer` has global_clipnorm="
                f"{optimizer.global_clipnorm}; each stage is updated on its "
                "own device, so the norm over all stages is not available "
                "to clip by. Use clipnorm (per variable) or clipvalue.")
        if getattr(optimizer, "built", False):
            raise ValueError(
                "`optimizer` is already built (its slots sit with the "
                "variables it was built on); pass a fresh optimizer, the "
                "pipeline builds it after placing each stage.")
        opts = self.options
        options_lib.check_batch_norm(model, opts)
        self.model = model
        self.loss = loss
        self.devices = placement.layout(
            list(devices) if devices is not None
            else placement.available_devices(),
            num_stages=opts.num_stages, data_parallel=opts.data_parallel)
        cut_names = opts.cuts
        if cut_names is None:
            cut_names = split.balanced_cuts(model, opts.num_stages,
                                            carry_skips=opts.carry_skips)
        self.cuts = tuple(cut_names)
        self.stages = split.split_model(model, self.cuts,
                                        carry_skips=opts.carry_skips)
        setattr(model, PIPELINED_MARK, True)
        for s, stage in enumerate(self.stages):
            placement.move_variables(stage.model.variables,
                                     self.devices[0][s])
        # vars[d][s]: Keras variables of stage s in group d.
        self._trainable = [[list(st.model.trainable_variables)
                            for st in self.stages]]
        self._non_trainable = [[list(st.model.non_trainable_variables)
                                for st in self.stages]]
        for d in range(1, opts.data_parallel):
            self._trainable.append([
                placement.copy_variables(v, self.devices[d][s])
                for s, v in enumerate(self._trainable[0])])
            self._non_trainable.append([
                placement.copy_variables(v, self.devices[d][s])
                for s, v in enumerate(self._non_trainable[0])])
        # optimizers[d][s]: one per stage and group, built and applied on
        # the stage's device. One optimizer over all stages would run every
        # update's math on the default device (tf.distribute's default
        # strategy does not colocate updates), copying each gradient and
        # variable there and back. Per-variable optimizers (SGD, Adam, ...)
        # update identically either way; each stage's `iterations` counts
        # the same steps.
        self.optimizers = [[None] * opts.num_stages
                           for _ in range(opts.data_parallel)]
        for d in range(opts.data_parallel):
            for s in range(opts.num_stages):
                # Under the device: a new optimizer creates its step counter
                # and learning rate at construction, its slots at build.
                with tf.device(self.devices[d][s]):
                    opt = optimizer if (d, s) == (0, 0) else type(
                        optimizer).from_config(optimizer.get_config())
                    opt.build(self._trainable[d][s])
                self.optimizers[d][s] = opt
        self._all_reduce = [group_sum.StageAllReduce(
            [self.devices[d][s] for d in range(opts.data_parallel)])
            for s in range(opts.num_stages)]
        self._steps = {}
        self._forward = None
        if verbose:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """The cut, and parameter bytes per device, as printable lines."""
        lines = [f"tfmulti.pipeline: {self.options.num_stages} stages x "
                 f"{self.options.data_parallel} group(s), "
                 f"{self.options.micro_batches} micro-batch(es), "
                 f"{self.options.schedule}; cuts after {list(self.cuts)}"]
        by_device = self.parameter_bytes_per_device()
        for s, stage in enumerate(self.stages):
            for d in range(self.options.data_parallel):
                device = self.devices[d][s]
                spec = tf.DeviceSpec.from_string(device)
                key = f"{spec.device_type}:{spec.device_index}"
                carried = (f", carries {list(stage.carried)}"
                           if stage.carried else "")
                lines.append(
                    f"  stage {s} group {d} on {key}: {len(stage.layer_names)}"
                    f" layers {stage.layer_names[0]}..{stage.layer_names[-1]}"
                    f", {by_device.get(key, 0)} parameter bytes{carried}")
        return "\n".join(lines)

    def parameter_bytes_per_device(self) -> dict[str, int]:
        """Bytes of model variables (all groups) on each device."""
        return placement.bytes_by_device(
            [v for group in self._trainable + self._non_trainable
             for vs in group for v in vs])

    def optimizer_bytes_per_device(self) -> dict[str, int]:
        """Bytes of optimizer slot variables on each device."""
        slots = []
        for opt in [o for group in self.optimizers for o in group]:
            scalars = {id(opt.iterations)}
            lr = getattr(opt, "_learning_rate", None)
            if isinstance(lr, keras.Variable):
                scalars.add(id(lr))
            slots.extend(v for v in opt.variables if id(v) not in scalars)
        return placement.bytes_by_device(slots)

    def _check_batch(self, batch_size: int) -> int:
        opts = self.options
        if batch_size % opts.data_parallel:
            raise ValueError(
                f"The global batch has {batch_size} examples, which "
                f"`data_parallel`={opts.data_parallel} groups cannot share "
                f"equally; use a global batch divisible by "
                f"{opts.data_parallel}.")
        per_group = batch_size // opts.data_parallel
        if per_group % opts.micro_batches:
            raise ValueError(
                f"`micro_batches`={opts.micro_batches} does not divide the "
                f"per-group batch of {per_group} (global batch {batch_size} "
                f"over `data_parallel`={opts.data_parallel}); use a global "
                f"batch divisible by "
                f"{opts.micro_batches * opts.data_parallel} or a number of "
                f"micro-batches that divides {per_group}.")
        return per_group // opts.micro_batches

    def train_step(self, x, y):
        """One update on the global batch (x, y).

        Args:
          x: the model's input (a tensor, or a list in `model.inputs`
            order), global batch first.
          y: targets for `loss`.

        Returns:
          The loss (mean over the global batch).
        """
        xs = [tf.convert_to_tensor(t) for t in keras.tree.flatten(x)]
        micro = self._check_batch(int(xs[0].shape[0]))
        if micro not in self._steps:
            self._steps[micro] = tf.function(
                lambda xs, y: self._step(xs, y, micro=micro)[0])
        return self._steps[micro](xs, tf.convert_to_tensor(y))

    def _step(self, xs, y, *, micro: int):
        opts = self.options
        S, M, D = opts.num_stages, opts.micro_batches, opts.data_parallel
        global_batch = micro * M * D
        order = schedule_lib.emission_order(opts.schedule, S, M)
        group_losses, stage_grads = [], [[None] * S for _ in range(D)]
        predictions = {}  # (d, m) -> the model's output on that slice
        new_non_trainable = [[None] * S for _ in range(D)]
        for d in range(D):
            acts = {}      # (s, m) -> list of tensors entering stage s
            tapes = {}     # (s, m) -> (tape, float inputs, targets)
            upstream = {}  # (s, m) -> gradients for stage s's float outputs
            grads = {}     # (s, m) -> gradients of stage s's variables
            last = [[] for _ in range(S)]  # previous action's outputs
            losses = []
            for m in range(M):
                start = (d * M + m) * micro
                acts[(0, m)] = [t[start:start + micro] for t in xs]
            for action in order:
                s, m = action.stage, action.micro_batch
                device = self.devices[d][s]
                # The stage's previous action first: the schedule's order.
                # The scope names every op of the action, so a profiler
                # trace shows which stage ran what (bench/pipeline_bubble).
                with tf.device(device), tf.control_dependencies(last[s]), \
                        tf.name_scope(f"pipe_g{d}_{action.kind}{s}_m{m}"):
                    if action.kind == "F":
                        outputs = self._forward_action(
                            d, s, m, acts, tapes, new_non_trainable,
                            losses, y=y, micro=micro,
                            global_batch=global_batch,
                            predictions=predictions)
                    else:
                        outputs = self._backward_action(d, s, m, tapes,
                                                        upstream, grads)
                last[s] = [o for o in outputs if o is not None][:1]
            for s in range(S):
                with tf.device(self.devices[d][s]):
                    stage_grads[d][s] = [
                        tf.add_n([grads[(s, m)][i] for m in range(M)])
                        for i in range(len(self._trainable[d][s]))]
            with tf.device(self.devices[d][S - 1]):
                group_losses.append(tf.add_n(losses))
        for s in range(S):
            if not self._trainable[0][s]:
                continue
            reduced = self._all_reduce[s]([stage_grads[d][s]
                                           for d in range(D)])
            for d in range(D):
                stage_grads[d][s] = reduced[d]
        for d in range(D):
            for s in range(S):
                for v, value in zip(self._non_trainable[d][s],
                                    new_non_trainable[d][s] or []):
                    v.assign(value)
                if self._trainable[d][s]:
                    with tf.device(self.devices[d][s]):
                        self.optimizers[d][s].apply_gradients(zip(
                            stage_grads[d][s], self._trainable[d][s]))
        # In batch order; unused (and pruned by tf.function) without
        # metrics.
        with tf.device(self.devices[0][S - 1]):
            outputs = tf.concat([predictions[(d, m)] for d in range(D)
                                 for m in range(M)], 0)
        return tf.add_n(group_losses), outputs

    def _forward_action(self, d, s, m, acts, tapes, new_non_trainable,
                        losses, *, y, micro, global_batch, predictions):
        """F(s, m) in group d; appends its share of the step's loss (and
        on the last stage, puts the model's output in `predictions`)."""
        opts = self.options
        stage = self.stages[s]
        inputs = acts.pop((s, m))
        float_inputs = _floating(inputs) if s > 0 else []
        variables = [v.value for v in self._trainable[d][s]]
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            tape.watch(float_inputs)
            tape.watch(variables)
            outputs, non_trainable, reg_losses = stage.model.stateless_call(
                variables, [v.value for v in self._non_trainable[d][s]],
                inputs, training=True, return_losses=True)
            outputs = keras.tree.flatten(outputs)
            reg = (tf.add_n(reg_losses) / (opts.micro_batches *
                                           opts.data_parallel)
                   if reg_losses else None)
            if s == opts.num_stages - 1:
                start = (d * opts.micro_batches + m) * micro
                per_example = self.loss(y[start:start + micro], outputs[0])
                size = tf.cast(tf.size(per_example), per_example.dtype)
                loss = tf.reduce_sum(per_example) * (micro / global_batch) / (
                    size)
                targets = [loss + reg if reg is not None else loss]
                losses.append(targets[0])
            else:
                targets = _floating(outputs) + ([reg] if reg is not None
                                                else [])
        if reg is not None and s < opts.num_stages - 1:
            losses.append(reg)
        new_non_trainable[d][s] = non_trainable
        tapes[(s, m)] = (tape, float_inputs, variables, targets,
                         reg is not None)
        if s < opts.num_stages - 1:
            acts[(s + 1, m)] = outputs
            return outputs
        predictions[(d, m)] = outputs[0]
        return [targets[0]]

    def _backward_action(self, d, s, m, tapes, upstream, grads):
        """B(s, m): gradients of stage s's inputs and variables."""
        tape, float_inputs, variables, targets, has_reg = tapes.pop((s, m))
        if s == self.options.num_stages - 1:
            output_gradients = None
        else:
            output_gradients = list(upstream.pop((s, m)))
            if has_reg:
                output_gradients.append(tf.ones_like(targets[-1]))
        result = tape.gradient(
            targets, float_inputs + variables,
            output_gradients=output_gradients,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        input_grads = result[:len(float_inputs)]
        grads[(s, m)] = result[len(float_inputs):]
        if s > 0:
            upstream[(s - 1, m)] = input_grads
        return list(input_grads) + list(grads[(s, m)])

    def __call__(self, x, training: bool = False):
        """The model's output, computed stage by stage on group 0."""
        if self._forward is None:
            self._forward = tf.function(self._forward_pass)
        return self._forward([tf.convert_to_tensor(t)
                              for t in keras.tree.flatten(x)])

    def _forward_pass(self, xs):
        tensors = xs
        for s, stage in enumerate(self.stages):
            with tf.device(self.devices[0][s]):
                tensors = keras.tree.flatten(stage.model(tensors,
                                                         training=False))
        return tensors[0] if len(tensors) == 1 else tensors

    def predict(self, x, *, batch_size: int = 256):
        """The model's outputs for `x` (a numpy array or tensor)."""
        xs = keras.tree.flatten(x)
        n = int(xs[0].shape[0])
        parts = [self([t[i:i + batch_size] for t in xs])
                 for i in range(0, n, batch_size)]
        return tf.concat(parts, 0).numpy()

    def sync_groups(self) -> None:
        """Copies group 0's variables (the model's) into groups 1..D-1."""
        for d in range(1, self.options.data_parallel):
            for group in (self._trainable, self._non_trainable):
                for src, dst in zip(group[0], group[d]):
                    for a, b in zip(src, dst):
                        b.assign(a.value)

    def train_step_fn(self, global_batch_size: int):
        """`step(xs, y) -> (loss, outputs)` for this global batch, to call
        inside a `tf.function`: `xs` the flat model inputs, `outputs` the
        model's output on the whole batch (in batch order)."""
        micro = self._check_batch(global_batch_size)
        return lambda xs, y: self._step(xs, y, micro=micro)

    def forward_fn(self):
        """`forward(x)`: the model's output computed stage by stage on group
        0, to call inside a `tf.function`."""
        return lambda x: self._forward_pass(
            [tf.convert_to_tensor(t) for t in keras.tree.flatten(x)])

    def checkpoint_optimizer(self):
        """The trackable that saves the optimizer state, and its layout.

        Returns:
          `(view, layout)` from `checkpoint.optimizer_view`: group 0's stage
          optimizers as one unsplit Keras optimizer (layout "unsplit"), or
          per stage ("per_stage") when their slots do not map.
        """
        return checkpoint_lib.optimizer_view(
            self.model, self._trainable[0], self.optimizers[0])

    def sync_after_restore(self) -> None:
        """After restoring group 0 (the model and the checkpointed
        optimizer state): every stage's step counter and learning rate from
        the first stage that has variables, and groups 1..D-1 from group 0.
        """
        first = next((o for o, v in zip(self.optimizers[0],
                                        self._trainable[0]) if v),
                     self.optimizers[0][0])
        scalars = checkpoint_lib._scalars(first)
        for opt in self.optimizers[0]:
            for a, b in zip(scalars, checkpoint_lib._scalars(opt)):
                if a is not b:
                    b.assign(a.value)
        for d in range(1, self.options.data_parallel):
            for source, target in zip(self.optimizers[0],
                                      self.optimizers[d]):
                checkpoint_lib.copy_optimizer_state(source, target)
        self.sync_groups()

    def save_weights(self, path: str) -> None:
        """Saves the unsplit model's weights (`model.save_weights`)."""
        self.model.save_weights(path)

    def load_weights(self, path: str) -> None:
        """Loads unsplit-model weights into every group."""
        self.model.load_weights(path)
        self.sync_groups()
