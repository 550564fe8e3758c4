"""Sharded optimizer state (ZeRO stage 1): each replica keeps the optimizer
slots of 1/N of the parameters.

The trainable variables are flattened into one vector, padded to a multiple
of N and cut into N equal shards, so any layer sizes split evenly. Replica r
owns shard r: a working copy of those parameters and a Keras optimizer built
on that copy alone, both plain variables on replica r's device (created
outside the strategy's variable creator, so they are neither mirrored nor
sync-on-read). An update, in replica context, takes the REDUCED gradient,
slices this replica's shard, applies the optimizer to it, all-gathers the N
updated shards and writes the full parameters into the mirrored variables.

This is exact for element-wise optimizers (Adam, AdamW, SGD with momentum,
RMSprop, ...): a shard's update is the slice of the full update. The
gradient is still all-reduced and then sliced (CPU has no reduce-scatter
in the replica context), so stage 2 is not done here.

The unsharded view (`assign_to`, `load_from`) maps the shards back to the
slots of an ordinary optimizer built on the model's variables, so
checkpoints keep the unsharded format. The Trainer builds that optimizer's
slots in host memory, once per worker (`host_variables`), not mirrored on
every replica: it is the checkpoint's form, written at each save.

A `keras.optimizers.LossScaleOptimizer` (mixed precision, or the Trainer's
`on_nonfinite="skip"`) is sharded through its inner optimizer; its loss
scale stays whole. As in Keras's own apply, the finiteness check and the
unscaling run on the reduced gradient (the same on every replica), a
non-finite update is skipped on every shard, and the scale halves or grows.
"""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat

# Optimizers whose update of each element depends on that element's gradient,
# parameter and slots only (plus scalars such as the step): a shard's update
# is the slice of the full update.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
               "Adamax", "Nadam", "Lion", "Ftrl")


def inner(optimizer):
    """The optimizer whose state is sharded: a LossScaleOptimizer's inner
    one, else `optimizer` itself."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


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


class FlatLayout:
    """Where each variable's elements sit in the flat, padded vector.

    Args:
      shapes: the variables' shapes.
      num_shards: N.
    """

    def __init__(self, shapes, num_shards: int):
        self.shapes = [tf.TensorShape(s) for s in shapes]
        self.sizes = [int(s.num_elements()) for s in self.shapes]
        self.total = sum(self.sizes)
        self.num_shards = int(num_shards)
        self.shard_size = max(1, math.ceil(self.total / self.num_shards))
        self.padded = self.shard_size * self.num_shards

    def flatten(self, tensors):
        """The tensors as one padded vector of length `padded`."""
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        return tf.pad(flat, [[0, self.padded - self.total]])

    def shard(self, flat, index: int):
        """Shard `index` of a flat vector."""
        start = index * self.shard_size
        return flat[start:start + self.shard_size]

    def shard_of(self, tensors, index: int):
        """`shard(flatten(tensors), index)`, built from the pieces of the
        tensors that overlap shard `index` only: 1/N of the copying, which
        a replica does for its gradient and parameters at every update."""
        start = index * self.shard_size
        stop = start + self.shard_size
        pieces, offset = [], 0
        for tensor, size in zip(tensors, self.sizes):
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                pieces.append(tf.reshape(tensor, [-1])[low - offset:
                                                       high - offset])
            offset += size
        padding = stop - max(start, min(stop, self.total))
        if padding:
            pieces.append(tf.zeros([padding], tensors[0].dtype))
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)

    def unflatten(self, flat):
        """The padded vector back as tensors of the variables' shapes."""
        parts = tf.split(flat[:self.total], self.sizes)
        return [tf.reshape(p, s) for p, s in zip(parts, self.shapes)]


@contextlib.contextmanager
def _device_local_variables():
    # Under a strategy scope every tf.Variable becomes distributed; the
    # shards must be plain variables on one device each.
    def creator(next_creator, **kwargs):
        del next_creator
        return compat.plain_variable(**kwargs)
    with tf.variable_creator_scope(creator):
        yield


def host_device(strategy) -> str:
    """The CPU of this worker's host (where its replicas' devices live)."""
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


@contextlib.contextmanager
def host_variables(strategy):
    """Variables created inside are plain ones on this worker's host CPU,
    also under `strategy`'s scope: the unsharded optimizer a sharded run
    checkpoints lives there once per worker, not once per replica."""
    with tf.device(host_device(strategy)), _device_local_variables():
        yield


def _assign(strategy, variable, value):
    # In cross-replica context (a merge_call): `value` holds the replicas'
    # equal values. A mirrored variable takes each replica's own copy; a
    # plain (host) variable the first.
    variable = _tf_variable(variable)
    if isinstance(variable, tf.distribute.DistributedValues) and isinstance(
            value, tf.distribute.DistributedValues):
        strategy.extended.update(variable, lambda v, x: v.assign(x),
                                 args=(value,), group=False)
    else:
        # One local replica: merge_call passes the value itself, which
        # `update` would try to broadcast (MultiWorkerMirroredStrategy:
        # "destinations can not be empty").
        variable.assign(strategy.experimental_local_results(value)[0])


def _tf_variable(variable):
    # A Keras variable's TensorFlow (distributed) variable.
    return (variable.value if isinstance(variable, keras.Variable)
            else variable)


def _canonical(device) -> str:
    return tf.DeviceSpec.from_string(str(device)).to_string()


def _static_replica_id(context) -> int:
    value = tf.get_static_value(context.replica_id_in_sync_group)
    if value is None:
        raise RuntimeError(
            "The replica id is not a constant in this strategy; "
            "shard_optimizer_state needs MirroredStrategy or "
            "MultiWorkerMirroredStrategy.")
    return int(value)


class ShardedOptimizer:
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

    Raises:
      ValueError: the optimizer cannot be sharded (see `check_shardable`), or
        the variables mix dtypes.
    """

    def __init__(self, strategy, optimizer, variables):
        check_shardable(optimizer)
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
        self.layout = FlatLayout([v.shape for v in self._variables],
                                 self.num_shards)
        self.devices = tuple(_canonical(d)
                             for d in strategy.extended.worker_devices)
        config = optimizer.get_config()
        self.shards = []
        self.optimizers = []
        with _device_local_variables():
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

    def _local(self, context):
        # Replica ids run over the workers in rank order, each worker's
        # local replicas in the order of `worker_devices` (the replica
        # context of MultiWorkerMirroredStrategy names no device).
        index = _static_replica_id(context)
        local = index - self._first_index()
        if not 0 <= local < len(self.devices):
            raise RuntimeError(
                f"Replica {index} is not one of this worker's "
                f"{len(self.devices)} replicas from {self._first_index()}: "
                "shard_optimizer_state needs the same number of replicas on "
                "every worker.")
        return local, index

    def apply(self, grads):
        """Applies the reduced gradients; call in replica context.

        Args:
          grads: reduced (and clipped) gradients, one per variable, the same
            on every replica; still multiplied by the loss scale under a
            LossScaleOptimizer.
        """
        context = tf.distribute.get_replica_context()
        local, index = self._local(context)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, self._variables)]
        finite, scale_state = tf.constant(True), ()
        if self._loss_scale is not None:
            finite, scale_state, grads = self._unscale(grads)
        shard = self.shards[local]
        shard.assign(self.layout.shard_of([v.value for v in self._variables],
                                          index))

        if self._rate_source is not None:
            # A tensor: given a (callable) Keras variable, the setter would
            # make the shard optimizer track the model optimizer's.
            self.optimizers[local].learning_rate = tf.convert_to_tensor(
                self._rate_source.learning_rate)

        def update():
            self.optimizers[local].apply(
                [self.layout.shard_of(grads, index)], [shard])
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
                _assign(strategy, var, value)
            _assign(strategy, self._iterations, iterations)
            if scale_state:
                _assign(strategy, self._loss_scale.step_counter,
                        scale_state[0])
                _assign(strategy, self._loss_scale.dynamic_scale,
                        scale_state[1])
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

    def _unscale(self, grads):
        """Keras's LossScaleOptimizer on the reduced gradient: whether to
        apply, the next (step counter, scale), the unscaled gradients."""
        lso = self._loss_scale
        finite = lso.check_finite(grads)
        counter = tf.convert_to_tensor(lso.step_counter)
        scale = tf.convert_to_tensor(lso.dynamic_scale)
        grow = finite & tf.equal(counter, lso.dynamic_growth_steps - 1)
        next_counter = tf.where(finite & ~grow, counter + 1,
                                tf.zeros_like(counter))
        next_scale = tf.where(grow, scale * 2.0,
                              tf.where(finite, scale, scale * 0.5))
        return finite, (next_counter, next_scale), [g / scale for g in grads]

    # --- the unsharded view ------------------------------------------------

    def _scalar_names(self):
        # The shard optimizers' variables not built from the shard (the
        # step, the learning rate, Nadam's u_product) are shared scalars.
        prefix = self.shards[0].name + "_"
        return {v.name for v in self.optimizers[0].variables
                if not v.name.startswith(prefix)}

    def _scalars(self, optimizer):
        names = self._scalar_names()
        return [v for v in optimizer.variables if v.name in names]

    def _kinds(self):
        # The slot names of the shard optimizers ("momentum", "velocity").
        prefix = self.shards[0].name + "_"
        return [v.name[len(prefix):] for v in self.optimizers[0].variables
                if v.name.startswith(prefix)]

    def _local_slots(self, local):
        names = {v.name: v for v in self.optimizers[local].variables}
        return [names[f"{self.shards[local].name}_{k}"] for k in self._kinds()]

    def _full_slots(self, optimizer):
        # Keras names a slot "<variable path with _>_<kind>"; the
        # optimizer's variables correspond to ours by position.
        names = {v.name: v for v in optimizer.variables}
        built_on = compat.optimizer_built_variables(optimizer)
        if [tuple(v.shape) for v in built_on] != [
                tuple(v.shape) for v in self._variables]:
            raise ValueError(
                f"`optimizer` ({type(optimizer).__name__}) is built on "
                f"{len(built_on)} variables of other shapes than the "
                f"{len(self._variables)} sharded ones; build it with "
                "optimizer.build(model.trainable_variables).")
        out = []
        for kind in self._kinds():
            try:
                out.append([names[f"{v.path.replace('/', '_')}_{kind}"]
                            for v in built_on])
            except KeyError as e:
                raise ValueError(
                    f"`optimizer` ({type(optimizer).__name__}) has no slot "
                    f"{e} : build it on the same variables as the sharded "
                    "one (optimizer.build(model.trainable_variables)).") from e
        return out

    def gathered_slots(self):
        """Each slot kind as the full flat vector, gathered from all shards
        (call in cross-replica context; collective under multi-worker)."""
        if self._gather is None:
            @tf.function
            def gather():
                def replica():
                    context = tf.distribute.get_replica_context()
                    local, _ = self._local(context)
                    index = self._first_index() + local
                    return [self._all_gather(context, slot.value, index)
                            for slot in self._local_slots(local)]
                return self._strategy.run(replica)
            self._gather = gather
        per_replica = self._gather()
        return [self._strategy.experimental_local_results(p)[0]
                for p in per_replica]

    def assign_to(self, optimizer):
        """Writes the sharded state into `optimizer` (the same class, built on
        the model's variables), the unsharded form a checkpoint saves."""
        optimizer = inner(optimizer)
        full = self._full_slots(optimizer)
        flats = self.gathered_slots()
        for kind, flat in zip(full, flats):
            for slot, value in zip(kind, self.layout.unflatten(flat)):
                slot.assign(value)
        for mine, theirs in zip(self._scalars(self.optimizers[0]),
                                self._scalars(optimizer)):
            theirs.assign(mine.value)

    def load_from(self, optimizer):
        """Reads the state of `optimizer` (unsharded, built on the model's
        variables; e.g. restored from a checkpoint) into the shards."""
        optimizer = inner(optimizer)
        full = self._full_slots(optimizer)
        flats = [self.layout.flatten([s.value for s in kind]) for kind in full]
        scalars = [v.value for v in self._scalars(optimizer)]
        for local, opt in enumerate(self.optimizers):
            index = self._first_index() + local
            for slot, flat in zip(self._local_slots(local), flats):
                slot.assign(self.layout.shard(flat, index))
            for mine, value in zip(self._scalars(opt), scalars):
                mine.assign(value)

    def _first_index(self):
        # The global replica id of this worker's first replica.
        return cluster_lib.of_strategy(self._strategy).worker_rank * len(
            self.devices)

    def state_bytes_per_device(self):
        """Bytes of optimizer state (slots and scalars) on each device, read
        from where the shard optimizers' variables were placed."""
        return state_bytes_per_device(
            self._strategy, [v for opt in self.optimizers
                             for v in opt.variables])


def state_bytes_per_device(strategy, variables) -> dict:
    """Bytes of `variables` by the device each copy lives on: a mirrored
    variable counts once on every replica's device, a plain one on its own.

    Args:
      strategy: the strategy of any distributed variables among them.
      variables: Keras or TensorFlow variables (an optimizer's `variables`).
    """
    out = {}
    for variable in variables:
        variable = _tf_variable(variable)
        copies = (strategy.experimental_local_results(variable)
                  if isinstance(variable, tf.distribute.DistributedValues)
                  else [variable])
        for copy in copies:
            size = int(np.prod(copy.shape)) * tf.as_dtype(copy.dtype).size
            out[copy.device] = out.get(copy.device, 0) + size
    return out


def state_bytes(strategy, optimizer, sharding=None) -> tuple[dict, int]:
    """The bytes of `optimizer`'s state the replicas' devices hold, by
    device, and those of its host copy, read from where the variables live.

    Unsharded, every variable counts on the device(s) it lives on (a
    mirrored one on each replica's) and the host copy is 0. With
    `sharding` (the ShardedOptimizer applying `optimizer`'s updates), the
    devices hold the shards and `optimizer`'s mirrored scalars; its plain
    (host) variables are the unsharded checkpoint form, once per worker.

    Args:
      strategy: the strategy of the run.
      optimizer: the Keras optimizer the run was given (its `variables`).
      sharding: the `ShardedOptimizer`, or None.

    Returns:
      ({device: bytes}, host bytes).
    """
    variables = list(optimizer.variables)
    if sharding is None:
        return state_bytes_per_device(strategy, variables), 0
    mirrored = [v for v in variables if isinstance(
        _tf_variable(v), tf.distribute.DistributedValues)]
    host = [v for v in variables if not isinstance(
        _tf_variable(v), tf.distribute.DistributedValues)]
    per_device = state_bytes_per_device(
        strategy, mirrored + [v for opt in sharding.optimizers
                              for v in opt.variables])
    return per_device, sum(state_bytes_per_device(strategy, host).values())
