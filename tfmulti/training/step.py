"""The train step: K micro-batches, one gradient all-reduce, one update.

Reusable with any loss: `TrainStep` takes `compute_loss(x, y, sample_weight)`
returning this replica's share of one micro-batch's loss (summed over the
replicas it is that micro-batch's loss) and the predictions. The step
averages over the K micro-batches, accumulates gradients locally, reduces
them once per update, clips by the reduced norm and applies them with an
optimizer that does not reduce again.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import tensorflow as tf

from tfmulti.data import balanced as balanced_lib
from tfmulti.training import communication
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import xla as xla_lib


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """How gradients become an update.

    Attributes:
      grad_accum_steps: K; K micro-batches of global batch B make one update
        equal to one step with global batch K*B.
      clip_global_norm: clip the REDUCED gradient to this global norm.
      allreduce_dtype: None, "float16" or "bfloat16": dtype of gradients on
        the wire.
    """

    grad_accum_steps: int = 1
    clip_global_norm: float | None = None
    allreduce_dtype: str | None = None

    def __post_init__(self):
        k = self.grad_accum_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"`grad_accum_steps` should be an int >= 1, got {k!r}. Use 1 "
                "for no accumulation.")
        c = self.clip_global_norm
        if c is not None and (isinstance(c, bool) or
                              not isinstance(c, (int, float)) or not c > 0
                              or not math.isfinite(c)):
            # inf clips every gradient to inf/inf = NaN: every update would
            # be skipped (silently, under loss scaling).
            raise ValueError(
                f"`clip_global_norm` should be a positive number or None, got "
                f"{c!r}; it must be finite (clipping to inf makes every "
                "gradient NaN). Pass None for no clipping.")
        d = self.allreduce_dtype
        if d is not None and d not in gradients_lib.ALLREDUCE_DTYPES:
            raise ValueError(
                f"`allreduce_dtype` is {d!r}; use None (the gradients' own "
                f"dtype) or one of {list(gradients_lib.ALLREDUCE_DTYPES)}.")


def unpack_batch(batch):
    """(x, y) or (x, y, sample_weight) -> (x, y, sample_weight or None)."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return (batch[0], batch[1], batch[2] if len(batch) == 3 else None)
    raise ValueError(
        "Each batch should be a tuple (x, y) or (x, y, sample_weight); got "
        f"{type(batch).__name__} "
        f"{len(batch) if isinstance(batch, (tuple, list)) else ''}. Map the "
        "dataset to such tuples.")


def first_tensor(x):
    """The first tensor of a (nested) batch: its rows are the examples."""
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _equal_shares(strategy, batch) -> bool:
    """Whether every replica surely holds global_batch / N examples: known
    at trace time when the static batch sizes of this process's replicas
    agree (drop_remainder=True, a divisible global batch).

    Other workers' shapes are not visible here; their static shapes come
    from the same input pipeline (the same element spec on every worker),
    so equal static sizes here mean equal sizes there, and the update keeps
    its one all-reduce. A partial batch has no static size anywhere.
    """
    local = strategy.experimental_local_results(batch)
    sizes = set()
    for part in local:
        shape = first_tensor(part).shape
        sizes.add(None if shape.rank in (None, 0) else shape[0])
    return len(sizes) == 1 and None not in sizes


def _accepts_global_batch(compute_loss) -> bool:
    try:
        return "global_batch" in inspect.signature(compute_loss).parameters
    except (TypeError, ValueError):
        return False


class TrainStep:
    """One optimizer update over K micro-batches, called in cross-replica
    context (inside a `tf.function`) with a distributed iterator.

    A partial or uneven batch (the last batch of an epoch split 3,3,2,2 over
    4 replicas; 64 examples on 3 replicas) must give the one-device update:
    each replica's loss is its share of the micro-batch's ACTUAL global
    batch. When the shares cannot be known at trace time, the step sums the
    replicas' batch sizes (one scalar all-reduce) and passes the sum to
    `compute_loss` as `global_batch`, if it takes that keyword; with equal
    static shares it passes None and costs nothing.

    Args:
      strategy: the `tf.distribute.Strategy` the variables live in.
      model: the Keras model (its `trainable_variables` are updated).
      optimizer: a Keras optimizer built on those variables, whose own
        reduction `gradients.disable_optimizer_reduction` has replaced.
      compute_loss: `compute_loss(x, y, sample_weight) -> (loss, y_pred)`,
        called in replica context; `loss` is this replica's share of the
        micro-batch loss (`tf.nn.compute_average_loss` with the global batch).
        If it takes a keyword `global_batch`, it gets None (every replica
        holds global/N examples) or the micro-batch's actual global batch
        size (a float32 scalar) to divide by instead.
      options: `GradientOptions`.
      metrics: Keras metrics updated with `(y, y_pred, sample_weight)`.
      communication_options: `tf.distribute.experimental.CommunicationOptions`
        for the gradient all-reduce.
      reducer: who reduces the gradients and counts the traffic (see
        `communication`); default: one synchronous all-reduce per update.
      jit_compile: compile each replica's forward and backward with XLA
        (the all-reduce and the update stay outside; see `xla.py`).
      sharding: an `optimizer_sharding.ShardedOptimizer` that applies the
        reduced, clipped gradients in place of `optimizer` (ZeRO-1), or at
        its stage 2 reduce-scatters and applies its shard.
      timer: a `replica_timing.ReplicaTimer` that sums each replica's
        forward and backward seconds (load balancing), or None.
    """

    def __init__(self, strategy, model, optimizer, compute_loss, *,
                 options: GradientOptions = GradientOptions(), metrics=(),
                 communication_options=None, reducer=None,
                 jit_compile: bool = False, sharding=None, timer=None):
        if not gradients_lib.reduces_gradients(optimizer):
            raise ValueError(
                "`optimizer` still sums gradients across replicas itself, so "
                "TrainStep would reduce them twice. Call tfmulti.training."
                "disable_optimizer_reduction(optimizer) first.")
        self._strategy = strategy
        self._model = model
        self._optimizer = optimizer
        self._compute_loss = compute_loss
        self._takes_global_batch = _accepts_global_batch(compute_loss)
        # Set at trace time by __call__ for the batch being traced.
        self._equal_shares = True
        self._known_global_batch = None
        self._options = options
        self._metrics = tuple(metrics)
        self._communication_options = communication_options
        self._sharding = sharding
        self.reducer = reducer or communication.SynchronousReducer(
            strategy, communication_options=communication_options,
            allreduce_dtype=options.allreduce_dtype)
        self._variables = list(model.trainable_variables)
        self.jit_compile = bool(jit_compile)
        self._timer = timer
        self._replica_gradients = (
            xla_lib.PerReplicaCompiled(self._local_gradients)
            if self.jit_compile else self._local_gradients)
        self._accumulators = []
        if options.grad_accum_steps > 1:
            # Per-replica (sync-on-read) sums: each replica accumulates its
            # own local gradient; only the update reduces them.
            with strategy.scope():
                self._accumulators = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                name="grad_accumulator",
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.SUM)
                    for v in self._variables]

    @property
    def options(self) -> GradientOptions:
        return self._options

    def _global_batch(self, x):
        if self._equal_shares:
            return None
        if self._known_global_batch is not None:
            # A balanced cut: the slices of a static global batch sum to
            # it every step, so no all-reduce of their sizes (one
            # collective fewer per step, on the slowest worker's path).
            return tf.constant(self._known_global_batch, tf.float32)
        local = tf.cast(tf.shape(first_tensor(x))[0], tf.float32)
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, local,
            options=self._communication_options)

    @property
    def model(self):
        return self._model

    def _shares(self, batch):
        # Computed outside `_replica_gradients`: an XLA-compiled replica
        # function cannot hold the all-reduce.
        if not self._takes_global_batch:
            return None
        return self._global_batch(unpack_batch(batch)[0])

    def _local_gradients(self, batch, global_batch=None):
        x, y, sample_weight = unpack_batch(batch)
        if self._timer is not None:
            x = self._timer.start(x, after=self._variables)
        kwargs = ({"global_batch": global_batch}
                  if self._takes_global_batch else {})
        with tf.GradientTape() as tape:
            loss, y_pred = self._compute_loss(x, y, sample_weight, **kwargs)
            loss = loss / self._options.grad_accum_steps
            # A LossScaleOptimizer's scale (or `loss_scale_factor`); the
            # optimizer divides it out again in `apply`.
            scaled = self._optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self._variables)
        if self._timer is not None:
            grads = self._timer.stop(grads, x)
        for metric in self._metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        return loss, grads

    def _accumulate(self, batch, loss_so_far):
        loss, grads = self._replica_gradients(batch, self._shares(batch))
        for acc, g in zip(self._accumulators, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        return loss + loss_so_far

    def _update(self, batch, loss_so_far):
        loss, grads = self._replica_gradients(batch, self._shares(batch))
        if self._accumulators:
            grads = [None if g is None else tf.convert_to_tensor(g) +
                     acc.read_value()
                     for g, acc in zip(grads, self._accumulators)]
            # Ordered after the reads above by automatic control deps.
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
        if self._sharding is not None and self._sharding.stage == 2:
            # ZeRO-2: each replica gets (and clips, by the norm summed over
            # the shards) only its shard of the reduced gradient.
            self._sharding.apply_shard(
                self.reducer.reduce_scatter(grads, self._sharding),
                clip_norm=self._options.clip_global_norm)
            return loss + loss_so_far
        grads = gradients_lib.clip_scaled(self.reducer.reduce(grads),
                                          self._optimizer,
                                          self._options.clip_global_norm)
        if self._sharding is not None:
            self._sharding.apply(grads)
        else:
            self._optimizer.apply(grads, self._variables)
        return loss + loss_so_far

    def __call__(self, iterator):
        """Runs one update; returns this update's loss per replica.

        Summed over replicas (e.g. `strategy.reduce("SUM", ...)`), the result
        is the loss of the update's K*B examples.
        """
        loss = tf.constant(0.0)
        self._known_global_batch = (
            float(iterator.global_batch_size) if isinstance(
                iterator, balanced_lib.BalancedIterator) else None)
        self.reducer.before_update()
        # K-1 micro-steps only accumulate (no communication); the K-th
        # computes its gradient, adds the accumulated ones, reduces once and
        # applies. K=1 is a single fused step with no accumulator variables.
        for _ in range(self._options.grad_accum_steps - 1):
            batch = next(iterator)
            self._equal_shares = _equal_shares(self._strategy, batch)
            loss = self._strategy.run(self._accumulate, args=(batch, loss))
        batch = next(iterator)
        self._equal_shares = _equal_shares(self._strategy, batch)
        # The reducer may trace the update more than once (PowerSGD's dense
        # warm-up sits under a tf.cond around it).
        loss = self.reducer.run_update(lambda: self._strategy.run(
            self._update, args=(batch, loss)))
        self.reducer.after_update()
        return loss
