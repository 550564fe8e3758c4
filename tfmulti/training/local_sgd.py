"""Local SGD and DiLoCo: workers synchronise every H updates, not every one.

Lin et al. 2020 (post-local SGD) and Douillard et al. 2023 (DiLoCo). Replicas
on one worker still all-reduce their gradients every update over the fast
local link (their weights are MirroredVariables and stay identical); only
workers diverge. Every `every` updates each worker's parameter delta since
the last synchronisation (the anchor) is averaged over all workers in one
packed all-reduce, the slow link's only traffic; then either the average is
applied (plain averaging) or it is the pseudo-gradient of an outer optimizer
(DiLoCo: SGD with Nesterov momentum) stepping from the anchor.

Each worker's inner optimizer state (momentum, Adam moments) stays its own,
as in PyTorch's PostLocalSGDOptimizer and DiLoCo.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from tfmulti.training import communication


def _check_number(arg, value, *, low, low_ok, high=None, high_ok=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{arg}` should be a number, got {value!r}.")
    if value < low or (value == low and not low_ok) or (
            high is not None and (value > high or (
                value == high and not high_ok))):
        bounds = (f"{'>=' if low_ok else '>'} {low}" +
                  ("" if high is None else
                   f" and {'<=' if high_ok else '<'} {high}"))
        raise ValueError(f"`{arg}` should be {bounds}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """DiLoCo's outer optimizer: SGD on the averaged delta as pseudo-gradient.

    Attributes:
      learning_rate: outer step size (DiLoCo: 0.7); 1.0 with momentum 0 is
        plain averaging.
      momentum: outer momentum (DiLoCo: 0.9).
      nesterov: Nesterov momentum, as torch.optim.SGD(nesterov=True).
    """

    learning_rate: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self):
        _check_number("learning_rate", self.learning_rate, low=0,
                      low_ok=False)
        _check_number("momentum", self.momentum, low=0, low_ok=True, high=1,
                      high_ok=False)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"`nesterov` should be a bool, got "
                             f"{self.nesterov!r}.")


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Synchronise workers every `every` updates (the Trainer's `sync=`).

    Attributes:
      every: H, updates between synchronisations of the workers. H=1 without
        an outer optimizer is exactly the synchronous update (the gradient
        all-reduce spans every worker each step), whatever the optimizer.
      outer_optimizer: None (average the workers' weights) or `OuterSGD`
        (DiLoCo).
      warmup_steps: W synchronous updates before local steps begin
        (post-local SGD).
    """

    every: int = 8
    outer_optimizer: OuterSGD | None = None
    warmup_steps: int = 0

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or (
                self.every < 1):
            raise ValueError(
                f"`every` should be an int >= 1 (updates between "
                f"synchronisations of the workers), got {self.every!r}.")
        if self.outer_optimizer is not None and not isinstance(
                self.outer_optimizer, OuterSGD):
            raise ValueError(
                f"`outer_optimizer` should be None (plain averaging) or "
                f"tfmulti.OuterSGD(learning_rate=..., momentum=...), got "
                f"{self.outer_optimizer!r}.")
        w = self.warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"`warmup_steps` should be an int >= 0, got "
                             f"{w!r}.")

    @property
    def synchronous(self) -> bool:
        """Whether this is just the synchronous update."""
        return self.every == 1 and self.outer_optimizer is None


class LocalSGDReducer(communication.Reducer):
    """The reducer (see `communication`) for `LocalSGD`.

    Args:
      strategy: the strategy the variables live in.
      variables: the trainable variables.
      options: `LocalSGD`.
      communication_options: for the all-reduces.

    BatchNorm's moving statistics are not sent at synchronisations: they are
    exponential averages, linear in each replica's batch statistics, so
    averaging them once before they are read (the train loop does, at its
    end: `replica_statistics.average`) gives exactly what averaging them at
    every synchronisation would.
    """

    def __init__(self, strategy, variables, options: LocalSGD, *,
                 communication_options=None):
        self._strategy = strategy
        self._variables = list(variables)
        self._options = options
        self._comm = communication_options
        self._workers = communication.num_workers(strategy)
        self._local_replicas = len(strategy.extended.worker_devices)
        self._reduce_local = communication.worker_all_reduce_fn(
            strategy, communication_options)
        self._reduce_all = communication.global_all_reduce_fn(
            strategy, communication_options)
        self.traffic = communication.Traffic()
        self._traced_local_bytes = 0
        self._traced_warm_bytes = 0
        # This worker's own weights while evaluation reads the mean.
        self._saved = None
        outer = options.outer_optimizer
        with strategy.scope():
            # Keras variables: assigned in replica context (every replica
            # computes the same value), like the model's own weights.
            self._anchors = [keras.Variable(
                tf.zeros(v.shape, v.dtype), trainable=False,
                name="local_sgd_anchor") for v in self._variables]
            self._momentum = [keras.Variable(
                tf.zeros(v.shape, v.dtype), trainable=False,
                name="local_sgd_outer_momentum") for v in self._variables
            ] if outer is not None and outer.momentum else []
            # Updates made so far (warm-up included): its position in the
            # H-update period decides when to synchronise.
            self._updates = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="local_sgd_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _in_warmup(self):
        return self._updates < self._options.warmup_steps

    def reduce(self, grads):
        """Worker-local mean gradient (global during warm-up); replica
        context."""
        present = [i for i, g in enumerate(grads) if g is not None]
        values = [tf.convert_to_tensor(grads[i]) for i in present]
        self._traced_local_bytes = communication.payload_bytes(values)

        def local():
            # The loss was scaled by the GLOBAL batch: the sum over this
            # worker's replicas is its mean gradient / workers.
            return [g * self._workers for g in self._reduce_local(values)]

        def warm():
            return self._reduce_all(values)

        if self._workers == 1:
            reduced = warm()
        elif self._options.warmup_steps:
            self._traced_warm_bytes = self._traced_local_bytes
            reduced = tf.cond(self._in_warmup(), warm, local)
        else:
            reduced = local()
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def _replica_sync(self):
        values = [tf.convert_to_tensor(v) - a for v, a in
                  zip(self._variables, self._anchors)]
        # One packed all-reduce of the deltas.
        summed = self._reduce_all(values)
        replicas = self._strategy.num_replicas_in_sync
        outer = self._options.outer_optimizer
        for i, (v, a, s) in enumerate(zip(self._variables, self._anchors,
                                          summed)):
            # Every replica of a worker holds the same delta: the sum over
            # all replicas / replicas is the mean over workers.
            delta = s / replicas
            if outer is None:
                new = tf.convert_to_tensor(a) + delta
            else:
                grad = -delta
                step = grad
                if self._momentum:
                    m = self._momentum[i]
                    buf = outer.momentum * tf.convert_to_tensor(m) + grad
                    m.assign(buf)
                    step = grad + outer.momentum * buf if outer.nesterov \
                        else buf
                new = tf.convert_to_tensor(a) - outer.learning_rate * step
            v.assign(new)
            a.assign(new)
        return tf.constant(0, tf.int32)

    def _replica_anchor(self):
        for v, a in zip(self._variables, self._anchors):
            a.assign(tf.convert_to_tensor(v))
        return tf.constant(0, tf.int32)

    def before_update(self):
        """Anchors the starting weights before the first update
        (cross-replica context)."""
        tf.cond(self._updates <= self._options.warmup_steps,
                lambda: self._run(self._replica_anchor),
                lambda: tf.constant(0, tf.int32))

    def _run(self, fn):
        return self._strategy.experimental_local_results(
            self._strategy.run(fn))[0]

    def after_update(self):
        """Counts traffic; every H-th update after warm-up, synchronises the
        workers (cross-replica context)."""
        options = self._options
        self._updates.assign_add(1)
        updates = self._updates.read_value()
        replicas = self._strategy.num_replicas_in_sync
        inter_worker = self._workers > 1
        if not inter_worker:
            # One worker: its all-reduce is the whole reduction. Averaging
            # one worker's weights changes nothing, but DiLoCo's outer step
            # from the anchor still applies (the paper's k=1).
            if replicas > 1:
                self.traffic.add(1, self._traced_local_bytes,
                                 inter_worker=False)
            if options.outer_optimizer is None:
                return
        else:
            if options.warmup_steps:
                warm = updates <= options.warmup_steps
                self.traffic.add(tf.where(warm, 1, 0), tf.where(
                    warm, self._traced_warm_bytes, 0), inter_worker=True)
                local_calls = tf.where(warm, 0, 1)
            else:
                local_calls = tf.constant(1)
            if self._local_replicas > 1:
                self.traffic.add(local_calls,
                                 local_calls * self._traced_local_bytes,
                                 inter_worker=False)
        sync_bytes = communication.payload_bytes(self._variables)

        def sync():
            self._run(self._replica_sync)
            if replicas > 1:
                self.traffic.add(1, sync_bytes, inter_worker=inter_worker)
            return tf.constant(0, tf.int32)

        tf.cond(self._sync_due(updates), sync,
                lambda: tf.constant(0, tf.int32))

    def _sync_due(self, updates):
        """Whether the workers synchronise after update number `updates`."""
        options = self._options
        return tf.logical_and(
            updates > options.warmup_steps,
            (updates - options.warmup_steps) % options.every == 0)

    def evaluation_weights(self):
        """Context in which evaluation reads the weights: between
        synchronisations, the mean of the workers' weights, the local ones
        put back after.

        Each worker would otherwise evaluate its share of the data with its
        own weights and the metrics would mix the workers' models. The
        swap costs one all-reduce of the parameters (counted) and leaves
        the training trajectory as it was. At a synchronisation point, in
        the warm-up or on one worker, the weights are already the same
        everywhere: nothing is sent.
        """
        if self._workers == 1:
            return contextlib.nullcontext()
        return self._averaged_weights()

    @contextlib.contextmanager
    def _averaged_weights(self):
        if self._saved is None:
            # Made at the first evaluation, outside any tf.function: a
            # trainer that never evaluates between syncs never holds them.
            with self._strategy.scope():
                self._saved = [keras.Variable(
                    tf.zeros(v.shape, v.dtype), trainable=False,
                    name="local_sgd_local_weights") for v in self._variables]
            self._swap_in = tf.function(self._swap_in_fn)
            self._swap_out = tf.function(
                lambda: self._run(self._replica_restore))
        swapped = bool(self._swap_in().numpy())
        try:
            yield
        finally:
            if swapped:
                self._swap_out()

    def _swap_in_fn(self):
        updates = self._updates.read_value()
        # Past the warm-up and not just synchronised.
        apart = tf.logical_and(updates > self._options.warmup_steps,
                               tf.logical_not(self._sync_due(updates)))
        nbytes = communication.payload_bytes(self._variables)

        def swap():
            self._run(self._replica_average)
            self.traffic.add(1, nbytes, inter_worker=True)
            return tf.constant(True)

        return tf.cond(apart, swap, lambda: tf.constant(False))

    def _replica_average(self):
        values = [tf.convert_to_tensor(v) for v in self._variables]
        summed = self._reduce_all(values)
        replicas = self._strategy.num_replicas_in_sync
        for v, saved, value, s in zip(self._variables, self._saved, values,
                                      summed):
            saved.assign(value)
            v.assign(s / replicas)
        return tf.constant(0, tf.int32)

    def _replica_restore(self):
        for v, saved in zip(self._variables, self._saved):
            v.assign(tf.convert_to_tensor(saved))
        return tf.constant(0, tf.int32)

    def trackables(self) -> dict:
        """Checkpoint state: anchors, outer momentum, the update count."""
        state = tf.Module(name="local_sgd")
        state.anchors = self._anchors
        state.outer_momentum = self._momentum
        state.updates = self._updates
        return {"local_sgd": state}

    def state_variables(self) -> list:
        """What differs between workers or replicas besides the model and
        optimizer (see `worker_state`): anchors, outer momentum, updates."""
        return [*self._anchors, *self._momentum, self._updates]
