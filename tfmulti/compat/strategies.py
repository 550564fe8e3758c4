"""TensorFlow's mirrored strategies as Keras 3 uses them: `reduce` of what
Keras passes, the strategy of a Keras object, collective keys, and the
checks tfmulti's strategies run on Keras's own steps."""

from __future__ import annotations

import sys
import warnings
import weakref

import keras
import tensorflow as tf

from tfmulti.compat.keras_losses import losses_unscaled_in
from tfmulti.compat.versions import keras_major


# --- MultiWorkerMirroredStrategy.reduce refuses what Keras 3 passes --------
# Symptom: Keras 3's TF trainer calls `strategy.reduce("MEAN", batch,
# axis=None)` on the nested (x, y) first batch and `reduce("MEAN", logs,
# axis=0)` on scalar logs; the stock strategy fails ("Attempt to convert a
# value (PerReplica ...) to a Tensor"; "Invalid reduction dimension 0 for
# input with 0 dimensions"). Upstream: keras-team/keras#20585,
# tensorflow/tensorflow#72388. Checked: TF 2.21.0, Keras 3.15.1.
# Guard: test_compat.py (multi_worker_reduce).
# What CollectiveReduceV2 can carry on every device type.
COLLECTIVE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64,
                     tf.int32, tf.int64)


class KerasMultiWorkerMirroredStrategy(
        tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose `reduce` accepts what Keras 3 passes:
    it maps over nested structures and reduces rank-0 values across replicas
    only, which is what a mean over axis 0 of a scalar per replica means."""

    def run(self, fn, args=(), kwargs=None, options=None):
        fn = check_keras_step(self, fn, args)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def reduce(self, reduce_op, value, axis=None):
        reduce_one = super().reduce

        def one(v):
            local = self.experimental_local_results(v)[0]
            one_axis = None if local.shape.rank == 0 else axis
            if local.dtype in COLLECTIVE_DTYPES:
                return reduce_one(reduce_op, v, axis=one_axis)
            # The first batch Keras reduces is often uint8 images, which
            # CollectiveReduceV2 has no kernel for: reduce in float32.
            as_float = self.run(lambda t: tf.cast(t, tf.float32), args=(v,))
            return tf.cast(reduce_one(reduce_op, as_float, axis=one_axis),
                           local.dtype)

        return tf.nest.map_structure(one, value)


def multi_worker_strategy_class():
    """The MultiWorkerMirroredStrategy class to build for this Keras."""
    return (KerasMultiWorkerMirroredStrategy if keras_major() >= 3
            else tf.distribute.MultiWorkerMirroredStrategy)


# --- A multi-worker strategy over logical CPUs ------------------------------
# MultiWorkerMirroredStrategy makes one replica per GPU, or a single one on
# a worker without GPUs: `CollectiveAllReduceExtended._initialize_local_
# devices` (tensorflow/python/distribute/collective_all_reduce_strategy.py)
# picks the devices, and the public constructor builds that stock extended.
# TensorFlow's own multi-worker tests simulate more replicas per worker with
# logical CPUs; this strategy overrides that method to replicate over
# `local_cpus` of them and is built through `tf.distribute.Strategy.
# __init__` with its own extended. Checked: TF 2.18.1, 2.21.0. Guard:
# test_compat.py::test_private_names_tfmulti_reads_still_exist; use:
# tfmulti.multi_worker_on_cpus in the multi-worker golden tests.
def multi_worker_on_local_cpus(resolver, options, local_cpus: int):
    """A MultiWorkerMirroredStrategy replicating over `local_cpus` logical
    CPUs of this worker (already configured)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy

    class Extended(collective_all_reduce_strategy.CollectiveAllReduceExtended):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            return tuple(f"{worker_device}/device:CPU:{i}"
                         for i in range(local_cpus)), "CPU"

    class Strategy(multi_worker_strategy_class()):
        def __init__(self, resolver, options):
            tf.distribute.Strategy.__init__(self, Extended(
                self, communication_options=options,
                cluster_resolver=resolver, devices=None))

    return Strategy(resolver, options)


# --- Which strategy a Keras object belongs to (private attributes) ---------
# Symptom: Keras 3 exposes no public "strategy of this optimizer / model /
# variable"; the TF backend keeps it in `_distribution_strategy` (optimizer),
# `_distribute_strategy` (model, and the tf.Variable under a Keras variable).
# An optimizer made outside the scope puts its slots under another scope
# (tensorflow/tensorflow#55713). ParameterServerStrategy keeps its cluster
# resolver in `_cluster_resolver` (the others expose `cluster_resolver`).
# Checked: Keras 3.15.1, TF 2.21.0.
# Guard: test_compat.py::test_private_strategy_attributes_still_exist.
def cluster_resolver(strategy):
    """The strategy's cluster resolver (ParameterServerStrategy keeps its
    own private), or None."""
    return getattr(strategy, "cluster_resolver", None) or getattr(
        strategy, "_cluster_resolver", None)


def optimizer_strategy(optimizer):
    """The strategy `optimizer` was created under, or None if unknown."""
    return getattr(optimizer, "_distribution_strategy", None)


def model_strategy(model):
    """The strategy `model` was built under (None: TF's default)."""
    return getattr(model, "_distribute_strategy", None)


def variable_strategy(variable):
    """The strategy owning a (Keras or TF) variable, or None."""
    return getattr(getattr(variable, "value", variable),
                   "_distribute_strategy", None)


# --- Keras reduces the first batch to build the model ----------------------
# Symptom: a global batch not divisible by the replicas (64 on 3) crashes
# `fit` and `evaluate` before the first step: "Inputs to operation AddN ...
# must have the same size and shape [22,10] != [21,10]". Cause:
# `keras/src/backend/tensorflow/trainer.py` `_maybe_symbolic_build` calls
# `strategy.reduce("MEAN", first_batch, axis=None)` only to get a batch
# whose shapes build the model. tfmulti's strategies answer that one caller
# with the first replica's batch and refuse everyone else with the shapes
# and the fix. Checked: Keras 3.15.1. Guard: tests/conformance/
# test_conformance.py::test_keras_still_reduces_the_first_batch.
KERAS_BUILD_CALLER = "_maybe_symbolic_build"


def called_by_keras_build() -> bool:
    """Whether the running `strategy.reduce` was called by Keras's build."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == KERAS_BUILD_CALLER:
            return True
        frame = frame.f_back
    return False


def local_batch_sizes(strategy, batch):
    """Static first dimension of the first tensor of `batch` per local
    replica (None where unknown), or None if `batch` is not per-replica."""
    leaves = [t for t in tf.nest.flatten(batch, expand_composites=False)
              if t is not None]
    if not leaves:
        return None
    local = strategy.experimental_local_results(leaves[0])
    sizes = []
    for t in local:
        shape = getattr(t, "shape", None)
        sizes.append(None if shape is None or shape.rank in (None, 0)
                     else shape[0])
    return sizes


def unequal_shapes_error(strategy, value) -> ValueError | None:
    """A clear error if `value`'s per-replica parts differ in shape."""
    for leaf in tf.nest.flatten(value):
        local = strategy.experimental_local_results(leaf)
        shapes = [tuple(getattr(t, "shape", ())) for t in local]
        if len(set(shapes)) > 1:
            n = strategy.num_replicas_in_sync
            total = sum(s[0] for s in shapes if s and s[0] is not None)
            return ValueError(
                f"The replicas hold values of different shapes {shapes}: the "
                f"global batch ({total}) is not divisible by the {n} "
                f"replicas. Use a global batch that is a multiple of {n} "
                f"(e.g. {total - total % n or n} or {total + n - total % n}).")
    return None


# --- Keras's train step weights each replica's loss by 1/replicas ----------
# Symptom: with a partial last batch (330 examples, batch 32: 10 examples
# split 3,3,2,2 over 4 replicas) or a global batch not divisible by the
# replicas, plain `fit` drifts from one device (4e-2 in two epochs, with
# sample weights). Cause: `keras/src/losses/loss.py` `reduce_values` takes
# each replica's mean and `scale_loss_for_distribution` multiplies it by
# 1/num_replicas whatever that replica's share (k#19891: loss and metrics
# change with the replica count). Keras cannot be told the shares without
# patching it: tfmulti's strategies warn once, at trace time, when Keras's
# stock train step sees per-replica batches of unequal or unknown size, and
# name the fix (`tfmulti.keras.distributed` weights exactly). Checked:
# Keras 3.15.1. Guard: tests/conformance/test_conformance.py::test_uneven_
# last_batch_plain_fit_warns_once (plain fit still differs and warns).
_warned_uneven = set()


def is_keras_train_step(fn) -> bool:
    """Whether `fn` is a Keras model's stock `train_step` (bound)."""
    model = getattr(fn, "__self__", None)
    return (getattr(fn, "__name__", None) == "train_step" and
            isinstance(model, keras.Model))


# Models (weakly held: a new model may reuse a freed one's id) already
# warned about their custom `train_step`'s logged loss.
_warned_custom_step = weakref.WeakSet()


def check_keras_step(strategy, fn, args):
    """What tfmulti's strategies check when Keras runs a step on them: a
    jit-compiled step (refused), a custom step's logged loss (warned), an
    uneven batch for Keras's own train step (warned). Returns the function
    to run: a train step followed by the average of its model's per-replica
    statistics (see the BatchNormalization workaround below)."""
    model = getattr(fn, "__self__", None)
    n = strategy.num_replicas_in_sync
    if n < 2 or not isinstance(model, keras.Model) or getattr(
            fn, "__name__", None) not in ("train_step", "test_step"):
        return fn
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util
    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        # keras-team/keras#21366: XLA compiles `strategy.run` itself, then
        # fails at run time: "Trying to access resource .../replica_1/...
        # located in device CPU:1 from device CPU:0".
        raise ValueError(
            f"`jit_compile`=True on {model.name!r} makes Keras compile its "
            f"whole step, `strategy.run` over the {n} replicas included, "
            "with XLA, which cannot reach the other replicas' variables. "
            "Compile with jit_compile=False, or call "
            "tfmulti.keras.distributed(model) after compile.")
    overridden = getattr(type(model), fn.__name__) is not getattr(
        keras.Model, fn.__name__)
    if overridden and fn.__name__ == "test_step":
        # Its losses are only logged, never differentiated: as on one device.
        return losses_unscaled_in(fn)
    if overridden and model not in _warned_custom_step:
        # Keras losses under a strategy return each replica's mean / N
        # (`scale_loss_for_distribution`); the keras-io guide's custom
        # `train_step` logs that value with `metric.update_state(loss)`.
        _warned_custom_step.add(model)
        warnings.warn(
            f"tfmulti: {type(model).__name__} overrides `{fn.__name__}`. "
            f"Under a strategy with {n} replicas a Keras loss (and "
            f"`self.compute_loss`) returns each replica's mean divided by "
            f"{n}: gradients come out right, but a loss logged from it "
            f"(e.g. `metric.update_state(loss)`) reads {n} times too small. "
            "Log `loss * self.distribute_strategy.num_replicas_in_sync`.",
            UserWarning, stacklevel=3)
    if fn.__name__ != "train_step":
        return fn
    warn_if_keras_step_uneven(strategy, fn, args)
    return statistics_averaged_after(fn)


# --- BatchNormalization keeps one moving average per replica ---------------
# Symptom: Keras 3 creates `moving_mean` / `moving_variance` with
# aggregation "none", so under a mirrored strategy each replica updates its
# own copy from its part of the batch; plain `fit` on 4 replicas left the
# copies 0.037 apart after one epoch, evaluation during training used each
# replica's copy, and a checkpoint held replica 0's. Checked: Keras 3.15.1.
# Workaround: `tfmulti.keras.distributed` and the Trainer average the copies
# once per loop; plain `fit` under a tfmulti strategy averages them after
# every train step (one small all-reduce per step, models with such
# variables only). Guard: test_compat.py (batchnorm_statistics_per_replica).
def statistics_averaged_after(train_step):
    """`train_step` followed by the replicas' mean of its model's
    per-replica statistics."""
    from tfmulti import replica_statistics
    return replica_statistics.averaged_after(train_step)


def warn_if_keras_step_uneven(strategy, fn, args) -> None:
    """Warns once per model if Keras's train step may get unequal shares."""
    n = strategy.num_replicas_in_sync
    if n < 2 or not args or not is_keras_train_step(fn):
        return
    model = fn.__self__
    sizes = local_batch_sizes(strategy, args[0])
    if sizes is None:
        return
    if None not in sizes and len(set(sizes)) == 1:
        return
    if id(model) in _warned_uneven:
        return
    _warned_uneven.add(id(model))
    what = ("unknown until run time (the last batch may be partial)"
            if None in sizes else f"{sizes}")
    warnings.warn(
        f"tfmulti: Keras `fit` weights each of the {n} replicas' mean loss "
        f"by 1/{n} whatever its share of the global batch, and the "
        f"per-replica batch sizes here are {what}: a partial or uneven "
        "batch gives a different update than one device. Batch the data "
        f"with drop_remainder=True and a global batch divisible by {n}, or "
        "call tfmulti.keras.distributed(model) after compile, which weights "
        "each replica by its real share.", UserWarning, stacklevel=3)


class KerasMirroredStrategy(tf.distribute.MirroredStrategy):
    """MirroredStrategy that tells Keras 3 users what it cannot do right:
    `run` warns once when Keras's own train step gets per-replica batches of
    unequal or unknown size; `reduce` answers Keras's first-batch build when
    the global batch is not divisible by the replicas and refuses other
    callers with the shapes."""

    def run(self, fn, args=(), kwargs=None, options=None):
        fn = check_keras_step(self, fn, args)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def reduce(self, reduce_op, value, axis=None):
        if axis is None:
            error = unequal_shapes_error(self, value)
            if error is not None:
                if called_by_keras_build():
                    # Keras only needs a batch whose shapes build the model.
                    return tf.nest.map_structure(
                        lambda v: self.experimental_local_results(v)[0],
                        value)
                raise error
        return super().reduce(reduce_op, value, axis=axis)


def mirrored_strategy_class():
    """The MirroredStrategy class to build for this Keras."""
    return (KerasMirroredStrategy if keras_major() >= 3
            else tf.distribute.MirroredStrategy)


# Which strategies the Keras fixes act on (keras_models.py): only those
# tfmulti made, so a stock strategy keeps stock Keras behaviour.
def made_by_tfmulti(strategy) -> bool:
    """Whether `strategy` came from tfmulti (`create_strategy`,
    `multi_worker_on_cpus`), which marks every strategy it makes with its
    communication options: the Keras fixes change nothing else."""
    return getattr(strategy, "_tfmulti_communication_options",
                   None) is not None


def tfmulti_replica_context():
    """The replica context of a tfmulti strategy with more than one
    replica, or None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync < 2 or not made_by_tfmulti(
            ctx.strategy):
        return None
    return ctx
