"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al.
2019), as PyTorch's DDP communication hook `powerSGD_hook`.

Each gradient with at least 2 dimensions is viewed as a matrix M (m x n: the
last dimension is n, a Dense kernel's outputs or a conv kernel's filters)
and, where r(m + n) is at most m*n / `min_compression_rate`, replaced on the
wire by two thin factors: P = M Q (m x r) is summed over replicas and
orthonormalised, then Q = M^T P (n x r) is summed, and P Q^T is the reduced
gradient. The rest (biases, norms, small matrices) go dense. The dense
tensors and the P factors share one packed all-reduce, the Q factors a
second one. Error feedback: what compression dropped from this replica's
share is added to its next gradient. Warm start: Q persists between steps.
Dense warm-up (PyTorch's `start_powerSGD_iter`): the first `start_iter`
updates are plain all-reduces; error feedback starts from zero at the
switch.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmulti.training import communication
from tfmulti.training import gradients as gradients_lib


# Dense updates before compression starts, by default. Measured on the small
# CNN (2 workers x 2 replicas, Adam 1e-3, docs/communication.md): compressed
# from the first update rank 4 ended 4.8 points below synchronous at 624
# updates of 64, and 16 dense updates still left 1.65; the model first has
# to leave its plateau at chance (about 100-150 updates of 64) on full
# gradients. PyTorch's own default is 1000, which a run of the recipe's
# length would never reach.
DEFAULT_START_ITER = 100


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """Compress large gradient matrices to rank `rank` (the Trainer's
    `compression=`).

    Attributes:
      rank: r, the rank of each compressed matrix (PyTorch's
        `matrix_approximation_rank`).
      min_compression_rate: compress a matrix only if m*n >= this * r(m+n)
        (PyTorch's default 2); smaller ones are sent dense.
      warm_start: reuse Q from the previous step (else a fresh random Q).
      error_feedback: add what compression dropped to the next gradient.
      seed: seed of the initial Q (the same on every replica).
      start_iter: updates made with the plain (dense) all-reduce before
        compression starts (PyTorch's `start_powerSGD_iter`): the early
        gradients change fast and a low-rank approximation of them loses
        most; 0 compresses from the first update. The default,
        `DEFAULT_START_ITER`, is for runs of a few hundred updates like the
        recipe's (which still end below synchronous: docs/communication.md
        has the figures); a run of thousands of updates can start sooner
        (32 of 1248 did) and keep more of the saving.
    """

    rank: int = 4
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0
    start_iter: int = DEFAULT_START_ITER

    def __post_init__(self):
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"`rank` should be an int >= 1, got {r!r}.")
        c = self.min_compression_rate
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
            raise ValueError(f"`min_compression_rate` should be a positive "
                             f"number, got {c!r}. Use 1 to compress every "
                             "matrix a rank-r factorisation makes smaller.")
        for name in ("warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` should be a bool, got "
                                 f"{getattr(self, name)!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"`seed` should be an int, got {self.seed!r}.")
        w = self.start_iter
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(
                f"`start_iter` should be an int >= 0 (dense updates before "
                f"compression starts; 0 compresses from the first), got "
                f"{w!r}.")


def matrix_shape(shape) -> tuple[int, int] | None:
    """(m, n) of the matrix view of a tensor of `shape`; None if 0-D/1-D."""
    dims = [int(d) for d in shape]
    if len(dims) < 2:
        return None
    n = dims[-1]
    m = 1
    for d in dims[:-1]:
        m *= d
    return m, n


def compresses(shape, options: PowerSGD) -> bool:
    """Whether a gradient of `shape` is sent compressed."""
    mn = matrix_shape(shape)
    if mn is None:
        return False
    m, n = mn
    rank = min(options.rank, m, n)
    return m * n >= options.min_compression_rate * rank * (m + n)


class PowerSGDReducer(communication.Reducer):
    """The reducer (see `communication`) for `PowerSGD`.

    Args:
      strategy: the strategy the variables live in.
      variables: the trainable variables (gradients come in this order).
      options: `PowerSGD`.
      communication_options: for the all-reduces.
    """

    def __init__(self, strategy, variables, options: PowerSGD, *,
                 communication_options=None):
        self._strategy = strategy
        self._options = options
        self._comm = communication_options
        self._inter_worker = communication.num_workers(strategy) > 1
        self.traffic = communication.Traffic()
        self._compressed = [i for i, v in enumerate(variables)
                            if compresses(v.shape, options)]
        self._traced = (0, 0)
        self._traced_dense_bytes = 0
        # Set while the dense warm-up branch of `run_update` is traced.
        self._tracing_dense = False
        with strategy.scope():
            # Updates made so far (dense ones included): decides when
            # compression starts, and is checkpointed with the rest.
            self._updates = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="powersgd_updates",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self._q = []
            self._errors = []
            for k, i in enumerate(self._compressed):
                m, n = matrix_shape(variables[i].shape)
                rank = min(options.rank, m, n)
                self._q.append(keras.Variable(
                    self._initial_q(n, rank, k), trainable=False,
                    name="powersgd_q"))
                # Each replica's own residual (assigned in replica context,
                # where Keras variables keep one value per replica).
                self._errors.append(keras.Variable(
                    tf.zeros((m, n), variables[i].dtype), trainable=False,
                    name="powersgd_error"))

    def _initial_q(self, n, rank, k):
        return tf.random.stateless_normal(
            (n, rank), seed=(self._options.seed, k), dtype=tf.float32)

    def run_update(self, update):
        """Runs `update()` (the step's `strategy.run` of its update, in
        cross-replica context): with a dense warm-up, under a `tf.cond` on
        the update count, traced once with the plain all-reduce and once
        compressed.

        The cond sits around the whole `strategy.run`: a `tf.cond` inside
        the replica function cannot hold MirroredStrategy's or
        MultiWorkerMirroredStrategy's `merge_call` (the optimizer's update
        goes through one too).
        """
        if not self._options.start_iter:
            return update()

        def dense():
            self._tracing_dense = True
            try:
                return update()
            finally:
                self._tracing_dense = False

        return tf.cond(self._updates < self._options.start_iter, dense,
                       update)

    def reduce(self, grads):
        """Sums `grads` over every replica, large matrices compressed
        (replica context)."""
        if self._tracing_dense:
            # The warm-up: tfmulti's ordinary all-reduce of every gradient.
            self._traced_dense_bytes = communication.payload_bytes(grads)
            return gradients_lib.all_reduce_sum(grads, options=self._comm)
        context = tf.distribute.get_replica_context()
        compressed = set(self._compressed)
        dense_ids = [i for i, g in enumerate(grads)
                     if g is not None and i not in compressed]
        dense = [tf.convert_to_tensor(grads[i]) for i in dense_ids]
        matrices, ps = [], []
        for k, i in enumerate(self._compressed):
            g = tf.convert_to_tensor(grads[i])
            m = tf.reshape(g, self._errors[k].shape)
            if self._options.error_feedback:
                m = m + tf.convert_to_tensor(self._errors[k])
            q = tf.convert_to_tensor(self._q[k]) if self._options.warm_start \
                else self._initial_q(*self._q[k].shape, k)
            matrices.append(m)
            ps.append(tf.matmul(m, tf.cast(q, m.dtype)))
        first = dense + ps
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, first,
                                    options=self._comm) if first else []
        dense_sum, p_sums = summed[:len(dense)], summed[len(dense):]
        p_hats = [tf.linalg.qr(p)[0] for p in p_sums]
        qs = [tf.matmul(m, p, transpose_a=True)
              for m, p in zip(matrices, p_hats)]
        q_sums = context.all_reduce(tf.distribute.ReduceOp.SUM, qs,
                                    options=self._comm) if qs else []
        self._traced = (int(bool(first)) + int(bool(qs)),
                        communication.payload_bytes(first) +
                        communication.payload_bytes(qs))
        out = list(grads)
        for i, g in zip(dense_ids, dense_sum):
            out[i] = g
        replicas = self._strategy.num_replicas_in_sync
        for k, i in enumerate(self._compressed):
            approx = tf.matmul(p_hats[k], q_sums[k], transpose_b=True)
            if self._options.error_feedback:
                # This replica's share of the sum is approx / replicas; the
                # residuals of all replicas sum to exactly what was dropped.
                self._errors[k].assign(matrices[k] - approx / replicas)
            if self._options.warm_start:
                self._q[k].assign(tf.cast(q_sums[k], self._q[k].dtype))
            out[i] = tf.reshape(approx, grads[i].shape)
        return out

    def after_update(self):
        """Counts this update's all-reduces (cross-replica context): one
        dense one during the warm-up, the compressed ones after."""
        calls, nbytes = self._traced
        dense = self._updates < self._options.start_iter
        self._updates.assign_add(1)
        if self._strategy.num_replicas_in_sync == 1:
            return
        if self._options.start_iter:
            calls = tf.where(dense, 1, calls)
            nbytes = tf.where(dense, self._traced_dense_bytes, nbytes)
        self.traffic.add(calls, nbytes, inter_worker=self._inter_worker)

    def trackables(self) -> dict:
        """Checkpoint state: the Q matrices, the error-feedback buffers
        (replica 0's on the chief; every replica's in `worker_state`) and
        the update count (where the dense warm-up ends)."""
        state = tf.Module(name="powersgd")
        state.q = self._q
        state.errors = self._errors
        state.updates = self._updates
        return {"powersgd": state}

    def state_variables(self) -> list:
        """Every replica's own error-feedback buffer, the Q matrices and the
        update count (see `worker_state`)."""
        return [*self._q, *self._errors, self._updates]

    def compressed_shapes(self, variables) -> list:
        """(m, n, rank) of every compressed gradient, for byte accounting."""
        out = []
        for i in self._compressed:
            m, n = matrix_shape(variables[i].shape)
            out.append((m, n, min(self._options.rank, m, n)))
        return out
