"""Independent numpy references for local SGD, DiLoCo and PowerSGD.

Written from the papers' algorithms, not from tfmulti's code, in float64, for
tests/test_communication_reference.py to hold tfmulti's reducers against:

- Local SGD (Stich 2019; Lin et al. 2020, post-local SGD): after `warmup_steps`
  synchronous updates, each worker takes `every` (H) steps of its own inner
  optimizer on its own data, then the workers' weights are averaged. Each
  worker's inner optimizer state (momentum, Adam moments and step count) is
  its own and is never averaged (as in Lin et al.'s and PyTorch's
  PostLocalSGDOptimizer). A worker is itself data-parallel over its
  replicas: its gradient is the mean over the examples of all its replicas.
- DiLoCo (Douillard et al. 2023, Algorithm 1): at a synchronisation the outer
  gradient is the mean over workers of (start-of-round weights - local
  weights), applied to the start-of-round weights by SGD with Nesterov
  momentum (torch.optim.SGD(nesterov=True): b = mu b + g; step g + mu b);
  the start of the first round is the end of the warm-up.
- PowerSGD (Vogels et al. 2019, Algorithm 1 with error feedback as in their
  Algorithm 2 and PyTorch's powerSGD_hook): each replica is one of the
  paper's workers. Per gradient of 2+ dimensions viewed as an m x n matrix
  (n = the last dimension, as tfmulti documents; for a Dense kernel this is
  also PyTorch's view), M = gradient + error; P = mean_w M_w Q; P = Gram-
  Schmidt(P); Q = mean_w M_w^T P; decompressed = P Q^T (the mean, so no
  further division); error_w = M_w - decompressed; Q is kept for the next
  update (warm start). The error is measured against the AGGREGATED
  decompressed matrix, as PyTorch's hook and the authors' code
  (epfml/powersgd) do; Algorithm 2's text reads DECOMPRESS(C(Delta_w)), the
  worker's own projection, which is not what either implementation does.
  PyTorch also re-orthogonalises Q before each use; that only changes P by
  an invertible r x r factor, so P's span, and with it decompressed =
  P P^T mean(M), is the same (this reference does not). Which tensors stay
  dense: 1-D tensors, and matrices where m n < min_compression_rate (m + n) r
  with r = min(rank, m, n), as tfmulti documents ("where that is at least
  2x smaller"). PyTorch's _should_compress compresses only where
  (m + n) r * min_compression_rate < m n, strictly: the two differ only at
  equality (a 6 x 12 kernel at rank 2, rate 2, which the test's model has:
  tfmulti compresses it, PyTorch would not). The
  first `start_iter` updates are plain all-reduces (PyTorch's
  start_powerSGD_iter); compression then starts from zero error and the
  initial Q (standard normal: tfmulti's draw is passed in).
- Inner optimizers: Keras 3's SGD (momentum, Nesterov) and Adam update rules
  (keras/src/optimizers/sgd.py, adam.py: epsilon added to sqrt(v), bias
  correction folded into the step size).

The model is a tanh MLP with a softmax cross-entropy loss, forward and
backward written out here; data are per-step, per-replica batches
`x[step, replica]`, `y[step, replica]` with replicas numbered worker-major
(replica g is local replica g % L of worker g // L).
"""

from __future__ import annotations

import numpy as np

# -- model -----------------------------------------------------------------


def mlp_losses_and_gradients(weights, x, y):
    """Per-example losses and the gradient of their MEAN.

    Args:
      weights: [kernel_1, bias_1, ..., kernel_k, bias_k] of a Dense stack,
        tanh between layers, logits out.
      x: (batch, features) inputs.
      y: (batch,) integer class labels.

    Returns:
      (per-example losses (batch,), list of gradients like `weights`).
    """
    activations = [np.asarray(x, np.float64)]
    layers = len(weights) // 2
    for i in range(layers):
        z = activations[-1] @ weights[2 * i] + weights[2 * i + 1]
        activations.append(np.tanh(z) if i < layers - 1 else z)
    logits = activations[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    losses = -log_probs[rows, y]
    delta = np.exp(log_probs)
    delta[rows, y] -= 1.0
    delta /= len(y)  # d(mean loss) / d logits
    grads = [None] * len(weights)
    for i in reversed(range(layers)):
        grads[2 * i] = activations[i].T @ delta
        grads[2 * i + 1] = delta.sum(axis=0)
        if i:
            delta = (delta @ weights[2 * i].T) * (1.0 - activations[i] ** 2)
    return losses, grads


def mean_gradient(weights, batches):
    """Mean loss and mean gradient over the examples of `batches` (a list of
    (x, y) of equal size), as data parallelism over them computes."""
    results = [mlp_losses_and_gradients(weights, x, y) for x, y in batches]
    losses = np.concatenate([r[0] for r in results])
    grads = [np.mean([r[1][i] for r in results], axis=0)
             for i in range(len(weights))]
    return losses, grads


# -- inner optimizers (Keras 3 update rules) ------------------------------


class SGD:
    """keras.optimizers.SGD: m = mu m - lr g; w += m (Nesterov: mu m - lr g)."""

    def __init__(self, learning_rate, momentum=0.0, nesterov=False):
        self.learning_rate, self.momentum = learning_rate, momentum
        self.nesterov = nesterov
        self.moments = None

    def apply(self, weights, grads):
        if self.momentum == 0:
            return [w - self.learning_rate * g for w, g in zip(weights, grads)]
        if self.moments is None:
            self.moments = [np.zeros_like(w) for w in weights]
        out = []
        for i, (w, g) in enumerate(zip(weights, grads)):
            m = self.momentum * self.moments[i] - self.learning_rate * g
            self.moments[i] = m
            out.append(w + (self.momentum * m - self.learning_rate * g
                            if self.nesterov else m))
        return out


class Adam:
    """keras.optimizers.Adam: alpha = lr sqrt(1 - b2^t) / (1 - b1^t);
    w -= alpha m / (sqrt(v) + epsilon)."""

    def __init__(self, learning_rate, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7):
        self.learning_rate, self.beta_1, self.beta_2 = (learning_rate, beta_1,
                                                        beta_2)
        self.epsilon = epsilon
        self.iterations = 0
        self.m = self.v = None

    def apply(self, weights, grads):
        if self.m is None:
            self.m = [np.zeros_like(w) for w in weights]
            self.v = [np.zeros_like(w) for w in weights]
        self.iterations += 1
        t = self.iterations
        alpha = (self.learning_rate * np.sqrt(1 - self.beta_2 ** t)
                 / (1 - self.beta_1 ** t))
        out = []
        for i, (w, g) in enumerate(zip(weights, grads)):
            self.m[i] = self.m[i] + (g - self.m[i]) * (1 - self.beta_1)
            self.v[i] = self.v[i] + (g * g - self.v[i]) * (1 - self.beta_2)
            out.append(w - alpha * self.m[i] / (np.sqrt(self.v[i])
                                                + self.epsilon))
        return out


# -- local SGD and DiLoCo ---------------------------------------------------


def local_sgd(initial_weights, x, y, *, steps, num_workers, every,
              warmup_steps, make_optimizer, outer_learning_rate=None,
              outer_momentum=0.0, outer_nesterov=True):
    """Local SGD (plain averaging) or, with `outer_learning_rate`, DiLoCo.

    Args:
      initial_weights: the model's weights, the same on every worker.
      x, y: data as `x[step, replica]`, `y[step, replica]` (replicas
        worker-major, `x.shape[1]` of them in all).
      steps: updates to make.
      num_workers: workers; the replicas split evenly among them.
      every: H, updates between synchronisations after the warm-up.
      warmup_steps: synchronous updates first (the gradient is the mean
        over every replica's examples, every worker applies it).
      make_optimizer: () -> a fresh inner optimizer (one per worker).
      outer_learning_rate, outer_momentum, outer_nesterov: DiLoCo's outer
        SGD; None learning rate averages the workers' weights instead.

    Returns:
      {"workers": each worker's final weights, "loss": per update, the mean
      per-example loss over every replica (each at its worker's weights)}.
    """
    replicas = x.shape[1]
    local = replicas // num_workers
    weights = [[np.asarray(w, np.float64) for w in initial_weights]
               for _ in range(num_workers)]
    optimizers = [make_optimizer() for _ in range(num_workers)]
    anchor = [w.copy() for w in weights[0]]
    outer_moments = [np.zeros_like(w) for w in anchor]
    history = []
    for step in range(1, steps + 1):
        s = step - 1
        if step <= warmup_steps:
            losses, grads = mean_gradient(
                weights[0], [(x[s, g], y[s, g]) for g in range(replicas)])
            for k in range(num_workers):
                weights[k] = optimizers[k].apply(weights[k], grads)
            history.append(losses.mean())
            anchor = [w.copy() for w in weights[0]]
            continue
        step_losses = []
        for k in range(num_workers):
            losses, grads = mean_gradient(
                weights[k], [(x[s, g], y[s, g])
                             for g in range(k * local, (k + 1) * local)])
            step_losses.append(losses)
            weights[k] = optimizers[k].apply(weights[k], grads)
        history.append(np.concatenate(step_losses).mean())
        if (step - warmup_steps) % every:
            continue
        if outer_learning_rate is None:
            merged = [np.mean([weights[k][i] for k in range(num_workers)],
                              axis=0) for i in range(len(anchor))]
        else:
            merged = []
            for i, start in enumerate(anchor):
                outer_grad = np.mean([start - weights[k][i]
                                      for k in range(num_workers)], axis=0)
                outer_moments[i] = outer_momentum * outer_moments[i] + (
                    outer_grad)
                direction = (outer_grad + outer_momentum * outer_moments[i]
                             if outer_nesterov else outer_moments[i])
                merged.append(start - outer_learning_rate * direction)
        weights = [[w.copy() for w in merged] for _ in range(num_workers)]
        anchor = [w.copy() for w in merged]
    return {"workers": weights, "loss": history}


# -- PowerSGD ----------------------------------------------------------------


def orthogonalize(p):
    """Gram-Schmidt on the columns of `p` (PyTorch's _orthogonalize at
    epsilon 0)."""
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i])
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def matrix_view(shape):
    """(m, n) of a gradient of `shape` viewed as a matrix, n its last
    dimension; None for a 1-D (or scalar) tensor."""
    if len(shape) < 2:
        return None
    return int(np.prod(shape[:-1])), int(shape[-1])


def compressed_rank(shape, rank, min_compression_rate):
    """The rank a gradient of `shape` is sent at, or None if it goes dense
    (compressed size x rate <= uncompressed: see the module docstring)."""
    view = matrix_view(shape)
    if view is None:
        return None
    m, n = view
    r = min(rank, m, n)
    return r if (m + n) * r * min_compression_rate <= m * n else None


class PowerSGDReducer:
    """Reduces every replica's gradients to one mean gradient, PowerSGD."""

    def __init__(self, shapes, *, replicas, rank, min_compression_rate,
                 start_iter, initial_q):
        """
        Args:
          shapes: the gradients' shapes.
          replicas: how many replicas (the paper's workers) reduce.
          rank, min_compression_rate, start_iter: as PyTorch's PowerSGDState
            (matrix_approximation_rank, min_compression_rate,
            start_powerSGD_iter).
          initial_q: {index of a compressed gradient: its initial (n, r) Q}.
        """
        self.ranks = [compressed_rank(s, rank, min_compression_rate)
                      for s in shapes]
        self.shapes = [tuple(s) for s in shapes]
        self.start_iter = start_iter
        self.updates = 0
        self.q = {i: np.asarray(q, np.float64) for i, q in initial_q.items()}
        missing = {i for i, r in enumerate(self.ranks) if r} - set(self.q)
        if missing:
            raise ValueError(f"no initial Q for compressed gradients "
                             f"{sorted(missing)}")
        self.errors = [[np.zeros(matrix_view(s)) if r else None
                        for s, r in zip(self.shapes, self.ranks)]
                       for _ in range(replicas)]

    @property
    def compressed(self):
        """Indices of the gradients sent as low-rank factors."""
        return [i for i, r in enumerate(self.ranks) if r]

    def reduce(self, grads):
        """`grads[replica][i]`: each replica's mean gradient over its own
        examples. Returns the reduced (mean) gradient of every variable."""
        self.updates += 1
        mean = [np.mean([g[i] for g in grads], axis=0)
                for i in range(len(self.shapes))]
        if self.updates <= self.start_iter:
            return mean
        out = list(mean)
        for i in self.compressed:
            ms = [g[i].reshape(matrix_view(self.shapes[i])) + e[i]
                  for g, e in zip(grads, self.errors)]
            p = orthogonalize(np.mean([m @ self.q[i] for m in ms], axis=0))
            q = np.mean([m.T @ p for m in ms], axis=0)
            decompressed = p @ q.T
            for m, e in zip(ms, self.errors):
                e[i] = m - decompressed
            self.q[i] = q
            out[i] = decompressed.reshape(self.shapes[i])
        return out


def powersgd(initial_weights, x, y, *, steps, make_optimizer, rank,
             min_compression_rate, start_iter, initial_q):
    """Synchronous data parallelism over `x.shape[1]` replicas with PowerSGD
    gradient all-reduces; one optimizer (the weights stay identical).

    Returns:
      {"weights": final weights, "loss": per update, the mean per-example
      loss over every replica, "reducer": the PowerSGDReducer}.
    """
    replicas = x.shape[1]
    weights = [np.asarray(w, np.float64) for w in initial_weights]
    reducer = PowerSGDReducer(
        [w.shape for w in weights], replicas=replicas, rank=rank,
        min_compression_rate=min_compression_rate, start_iter=start_iter,
        initial_q=initial_q)
    optimizer = make_optimizer()
    history = []
    for s in range(steps):
        results = [mlp_losses_and_gradients(weights, x[s, g], y[s, g])
                   for g in range(replicas)]
        history.append(np.concatenate([r[0] for r in results]).mean())
        weights = optimizer.apply(weights, reducer.reduce(
            [r[1] for r in results]))
    return {"weights": weights, "loss": history, "reducer": reducer}


# -- data --------------------------------------------------------------------


def make_data(*, steps, replicas, batch, features, classes, seed=0):
    """Deterministic per-step, per-replica batches `x[step, replica]`
    (float32) and labels from a fixed random teacher (int32)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, replicas, batch, features)).astype("float32")
    teacher = rng.normal(size=(features, classes))
    y = np.argmax(x @ teacher + 0.5 * rng.normal(
        size=(steps, replicas, batch, classes)), axis=-1).astype("int32")
    return x, y
