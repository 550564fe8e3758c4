"""Sharded optimizer state (ZeRO stages 1 and 2): each replica keeps the
optimizer slots of 1/N of the parameters; at stage 2 also only its 1/N of
the reduced gradient.

The trainable variables are flattened into one vector, padded to a multiple
of N and cut into N equal shards, so any layer sizes split evenly. Replica r
owns shard r: a working copy of those parameters and a Keras optimizer built
on that copy alone, both plain variables on replica r's device (created
outside the strategy's variable creator, so they are neither mirrored nor
sync-on-read). An update, in replica context, takes the REDUCED gradient,
slices this replica's shard, applies the optimizer to it, all-gathers the N
updated shards and writes the full parameters into the mirrored variables.

This is exact for element-wise optimizers (Adam, AdamW, SGD with momentum,
RMSprop, ...): a shard's update is the slice of the full update. Stage 1
all-reduces the gradient and slices it; stage 2 reduce-scatters it
(`reduce_scatter`: an all-to-all on CPU) and decides the clipping norm and
the loss scale's finiteness from sums over the shards (one small
all-reduce), so it makes the same updates.

The unsharded view (`assign_to`, `load_from`) maps the shards back to the
slots of an ordinary optimizer built on the model's variables, so
checkpoints keep the unsharded format. The Trainer builds that optimizer's
slots in host memory, once per worker, not mirrored on
every replica: it is the checkpoint's form, written at each save
(`unsharded_view`, `shard_placement.host_variables`).

A `keras.optimizers.LossScaleOptimizer` (mixed precision, or the Trainer's
`on_nonfinite="skip"`) is sharded through its inner optimizer; its loss
scale stays whole. As in Keras's own apply, the finiteness check and the
unscaling run on the reduced gradient (the same on every replica), a
non-finite update is skipped on every shard, and the scale halves or grows.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti.training import flat_layout, optimizer_memory, shard_placement
from tfmulti.training import reduce_scatter, unsharded_view
from tfmulti.training.unsharded_view import inner

# Optimizers whose update of each element depends on that element's gradient,
# parameter and slots only (plus scalars such as the step): a shard's update
# is the slice of the full update.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
               "Adamax", "Nadam", "Lion", "Ftrl")


def check_shardable(optimizer) -> None:
    """Raises ValueError, naming the optimizer, if its state cannot be sharded.

    Args:
      optimizer: a Keras 3 optimizer (a LossScaleOptimizer: its inner one is
        checked).
    """
    optimizer = inner(optimizer)
    name = type(optimizer).__name__
    cls = getattr(keras.optimizers, name, None)
    if name not in ELEMENTWISE or type(optimizer) is not cls:
        why = (" Adafactor factors the second moment over a weight's rows "
               "and columns, which a flat shard does not have."
               if name == "Adafactor" else "")
        raise ValueError(
            f"`optimizer` is {name}, whose state cannot be sharded: "
            f"shard_optimizer_state supports the element-wise Keras "
            f"optimizers {list(ELEMENTWISE)}.{why} Use one of those or "
            "shard_optimizer_state=False.")
    try:
        rate = optimizer.get_config()["learning_rate"]
    except Exception as e:  # noqa: BLE001 (Keras raises several kinds)
        rate = {"class_name": f"unserializable ({type(e).__name__}: {e})"}
    # Keras serializes a lambda rate as "__lambda__", a function as
    # "function"; schedules (tfmulti's ScaledLearningRate too) by class.
    if isinstance(rate, dict) and (
            rate.get("class_name") in ("__lambda__", "function") or
            rate.get("class_name", "").startswith("unserializable")):
        # The shards are clones made through get_config / from_config: a
        # callable rate (a lambda, a function) does not survive that.
        raise ValueError(
            f"`optimizer` ({name}) has a callable learning rate "
            f"({rate.get('class_name')}), which cannot be cloned for each "
            "shard. Pass a float or a keras.optimizers.schedules."
            "LearningRateSchedule, or shard_optimizer_state=False.")
    for attr, fix in (("clipnorm", "clip_global_norm"),
                      ("global_clipnorm", "clip_global_norm"),
                      ("use_ema", "no EMA"),
                      ("gradient_accumulation_steps", "grad_accum_steps")):
        value = getattr(optimizer, attr, None)
        if value:
            raise ValueError(
                f"`optimizer` ({name}) has `{attr}`={value!r}, which a "
                f"sharded update cannot reproduce (it would see one shard, "
                f"not the whole model). Use {fix} instead, or "
                "shard_optimizer_state=False.")
    if compat.excludes_from_weight_decay(optimizer):
        raise ValueError(
            f"`optimizer` ({name}) excludes variables from weight decay by "
            "name, and a flat shard has no variable names. Use "
            "shard_optimizer_state=False with exclusions.")


class ShardedOptimizer(unsharded_view.UnshardedView):
    """A Keras optimizer whose state is split over the replicas (ZeRO-1).

    Args:
      strategy: MirroredStrategy or MultiWorkerMirroredStrategy holding the
        variables.
      optimizer: the Keras optimizer to shard (its config is cloned once per
        local replica; its slots are not updated, its step counter
        `iterations` is advanced with every applied update, so what reads
        it, a schedule or the Trainer's count of skipped updates, sees
        the unsharded optimizer's count). A LossScaleOptimizer: its inner
        optimizer is sharded and its loss scale applied (see the module).
      variables: the trainable variables, all of one floating dtype.
      stage: 1 (the gradient arrives all-reduced, `apply`) or 2 (each
        replica reduce-scatters its local gradient, `scatter`, and applies
        its shard, `apply_shard`).
      communication_options: for the stage-2 reduce-scatter.
      wire_dtype: None, "float16" or "bfloat16": the stage-2 gradient on
        the wire (the Trainer's `allreduce_dtype`).

    Raises:
      ValueError: the optimizer cannot be sharded (see `check_shardable`), or
        the variables mix dtypes.
    """

    def __init__(self, strategy, optimizer, variables, *, stage=1,
                 communication_options=None, wire_dtype=None):
        check_shardable(optimizer)
        if stage not in (1, 2):
            raise ValueError(f"`stage` should be 1 or 2, got {stage!r}.")
        self.stage = stage
        # The optimizer this shards (a LossScaleOptimizer included).
        self.optimizer = optimizer
        self._loss_scale = (
            optimizer if isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer) else None)
        if self._loss_scale is not None and not self._loss_scale.built:
            # Its scale and step counter exist once built.
            raise ValueError(
                "`optimizer` is a LossScaleOptimizer that is not built; call "
                "optimizer.build(model.trainable_variables) first.")
        optimizer = inner(optimizer)
        self._iterations = optimizer.iterations
        # A rate held in a variable (not a schedule, which the shards
        # evaluate on their own step) may be set while training (Keras's
        # LearningRateScheduler, ReduceLROnPlateau): the shards follow it.
        self._rate_source = (
            optimizer if not isinstance(optimizer.get_config()[
                "learning_rate"], dict) else None)
        self._strategy = strategy
        self._variables = list(variables)
        dtypes = {v.dtype for v in self._variables}
        if len(dtypes) != 1:
            raise ValueError(
                f"`variables` mix dtypes {sorted(map(str, dtypes))}; "
                "shard_optimizer_state flattens them into one vector. Keep "
                "trainable variables in one dtype.")
        self.dtype = dtypes.pop()
        self.num_shards = strategy.num_replicas_in_sync
        self.layout = flat_layout.FlatLayout(
            [v.shape for v in self._variables], self.num_shards)
        self.devices = tuple(shard_placement.canonical(d)
                             for d in strategy.extended.worker_devices)
        config = optimizer.get_config()
        self.shards = []
        self.optimizers = []
        with shard_placement.device_local_variables():
            for i, device in enumerate(self.devices):
                with tf.device(device):
                    shard = keras.Variable(
                        np.zeros([self.layout.shard_size],
                                 dtype=np.dtype(self.dtype)),
                        name=f"zero_shard_{i}")
                    opt = type(optimizer).from_config(config)
                    compat.make_optimizer_local(opt)
                    opt.build([shard])
                self.shards.append(shard)
                self.optimizers.append(opt)
        self._gather = None
        self.reduce_scatter = reduce_scatter.ReduceScatter(
            strategy, self.layout, options=communication_options,
            wire_dtype=wire_dtype) if stage == 2 else None

    def scatter(self, grads):
        """Stage 2: this replica's shard of the gradients summed over every
        replica (replica context; `reduce_scatter` says how)."""
        _, index = self._local(tf.distribute.get_replica_context())
        return self.reduce_scatter(self._dense(grads), index)

    def _local(self, context):
        # Replica ids run over the workers in rank order, each worker's
        # local replicas in the order of `worker_devices` (the replica
        # context of MultiWorkerMirroredStrategy names no device).
        index = shard_placement.static_replica_id(context)
        local = index - self._first_index()
        if not 0 <= local < len(self.devices):
            raise RuntimeError(
                f"Replica {index} is not one of this worker's "
                f"{len(self.devices)} replicas from {self._first_index()}: "
                "shard_optimizer_state needs the same number of replicas on "
                "every worker.")
        return local, index

    def apply(self, grads):
        """Stage 1: applies the reduced gradients; call in replica context.

        Args:
          grads: reduced (and clipped) gradients, one per variable, the same
            on every replica; still multiplied by the loss scale under a
            LossScaleOptimizer.
        """
        context = tf.distribute.get_replica_context()
        local, index = self._local(context)
        grads = self._dense(grads)
        finite, scale_state = tf.constant(True), ()
        if self._loss_scale is not None:
            finite = self._loss_scale.check_finite(grads)
            scale_state = self._next_scale(finite)
            grads = [g / self._scale() for g in grads]
        self._update(context, local, index,
                     lambda: self.layout.shard_of(grads, index), finite,
                     scale_state)

    def apply_shard(self, grad_shard, *, clip_norm=None):
        """Stage 2: applies this replica's shard of the reduced gradient
        (`reduce_scatter.ReduceScatter`); call in replica context.

        What the unsharded step decides on the whole reduced gradient is
        decided here on sums over the shards, in one small all-reduce: the
        clipping norm (the sum of the shards' squared norms) and, under a
        LossScaleOptimizer, whether every element is finite.

        Args:
          grad_shard: the flat shard (`layout.shard_size` elements), still
            multiplied by the loss scale under a LossScaleOptimizer.
          clip_norm: clip the whole gradient to this global norm, or None.
        """
        context = tf.distribute.get_replica_context()
        local, index = self._local(context)
        sums = []
        if clip_norm is not None:
            sums.append(tf.reduce_sum(tf.square(grad_shard)))
        if self._loss_scale is not None:
            sums.append(tf.reduce_sum(tf.cast(
                ~tf.math.is_finite(grad_shard), grad_shard.dtype)))
        if sums:
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
        finite, scale_state = tf.constant(True), ()
        if clip_norm is not None:
            norm = tf.sqrt(sums[0])
            limit = clip_norm * self._scale()
            # tf.clip_by_global_norm's arithmetic: NaN when the norm is not
            # finite, so such an update is skipped (or NaN) as unsharded.
            factor = limit * tf.minimum(1.0 / norm, 1.0 / limit) + (
                norm - norm)
            grad_shard = grad_shard * factor
        if self._loss_scale is not None:
            finite = tf.equal(sums[-1], 0.0)
            if clip_norm is not None:
                finite = finite & tf.math.is_finite(norm)
            scale_state = self._next_scale(finite)
            grad_shard = grad_shard / self._scale()
        self._update(context, local, index, lambda: grad_shard, finite,
                     scale_state)

    def _dense(self, grads):
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                for g, v in zip(grads, self._variables)]

    def _scale(self):
        # The loss scale the gradients carry (1 without loss scaling).
        return tf.cast(self.optimizer.scale_loss(tf.constant(1.0)),
                       self.dtype)

    def _update(self, context, local, index, grad_shard, finite,
                scale_state):
        """Updates shard `index` with `grad_shard()` where `finite`, gathers
        the shards and writes the parameters, step and loss scale."""
        shard = self.shards[local]
        shard.assign(self.layout.shard_of([v.value for v in self._variables],
                                          index))

        if self._rate_source is not None:
            # A tensor: given a (callable) Keras variable, the setter would
            # make the shard optimizer track the model optimizer's.
            self.optimizers[local].learning_rate = tf.convert_to_tensor(
                self._rate_source.learning_rate)

        def update():
            self.optimizers[local].apply([grad_shard()], [shard])
            return tf.constant(True)
        # The branch holds no collective (the shard optimizer is local), so
        # a cond in replica context is safe; the gather below runs always.
        if self._loss_scale is None:
            update()
        else:
            tf.cond(finite, update, lambda: tf.constant(False))
        gathered = self._all_gather(context, shard.value, index)
        values = self.layout.unflatten(gathered)
        iterations = self._iterations.value + tf.cast(
            finite, self._iterations.dtype)

        def assign(strategy, values, iterations, scale_state):
            for var, value in zip(self._variables, values):
                shard_placement.assign(strategy, var, value)
            shard_placement.assign(strategy, self._iterations, iterations)
            if scale_state:
                shard_placement.assign(
                    strategy, self._loss_scale.step_counter, scale_state[0])
                shard_placement.assign(
                    strategy, self._loss_scale.dynamic_scale, scale_state[1])
        context.merge_call(assign, args=(values, iterations, scale_state))

    def _all_gather(self, context, shard, index):
        """The N shards concatenated, shard `index` from this replica.

        MultiWorkerMirroredStrategy with ONE replica per worker cannot
        all-gather inside a tf.function (TF 2.21: `ValueError: destinations
        can not be empty`, cross_device_ops.validate_destinations, reached
        from ReplicaContext.all_gather's merge_call). There, each replica
        places its shard in zeros and the vectors are summed: exact (every
        element has one non-zero term), at an all-reduce's cost.
        """
        if self.num_shards == 1:
            return shard
        if len(self.devices) == 1:
            size = self.layout.shard_size
            placed = tf.pad(shard, [[index * size,
                                     (self.num_shards - 1 - index) * size]])
            return context.all_reduce(tf.distribute.ReduceOp.SUM, placed)
        return context.all_gather(shard, axis=0)

    def _next_scale(self, finite):
        """Keras's LossScaleOptimizer after an update whose gradient was
        `finite` (or not): the next (step counter, scale)."""
        lso = self._loss_scale
        counter = tf.convert_to_tensor(lso.step_counter)
        scale = tf.convert_to_tensor(lso.dynamic_scale)
        grow = finite & tf.equal(counter, lso.dynamic_growth_steps - 1)
        next_counter = tf.where(finite & ~grow, counter + 1,
                                tf.zeros_like(counter))
        next_scale = tf.where(grow, scale * 2.0,
                              tf.where(finite, scale, scale * 0.5))
        return next_counter, next_scale

    def _first_index(self):
        # The global replica id of this worker's first replica.
        return cluster_lib.of_strategy(self._strategy).worker_rank * len(
            self.devices)

    def state_bytes_per_device(self):
        """Bytes of optimizer state (slots and scalars) on each device, read
        from where the shard optimizers' variables were placed."""
        return optimizer_memory.state_bytes_per_device(
            self._strategy, [v for opt in self.optimizers
                             for v in opt.variables])
