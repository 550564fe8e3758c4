"""Every version-guarded Keras / TensorFlow workaround, in one place.

Each workaround is one function or class below, headed by a short comment:
the upstream symptom, the upstream issue, the versions checked, and the test
in `tests/test_compat.py` that fails once an upstream release fixes it (then
delete the workaround and its test). New code touches no private Keras or
TensorFlow attribute outside this module: it calls an accessor here. The
older sites still outside it are listed, to move here, in
`tests/test_private_access.py`, which fails on a new one.

To add one: append a function or class with the same header at the end, and
a guard test in `tests/test_compat.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import types
import warnings
import weakref

import keras

import tensorflow as tf

# Checked on: TensorFlow 2.21.0, Keras 3.15.1.
SUPPORTED_KERAS_MAJOR = 3


def keras_major() -> int:
    """The installed Keras major version."""
    return int(keras.__version__.split(".")[0])


# --- Keras 3 optimizers all-reduce gradients themselves ---------------------
# Symptom: `TFOptimizer._backend_update_step` sums gradients across replicas
# (`_all_reduce_sum_gradients`) whenever it runs in replica context, after
# clipping each replica's LOCAL gradient; a custom step that reduces first
# gets N-times gradients, and clipping happens before the sum. No public
# switch (Keras 3 dropped `experimental_aggregate_gradients`). Upstream:
# keras-team/keras#20585 family. Checked: Keras 3.15.1.
# Guards: test_compat.py (optimizer_sums_replicas),
# test_trainer_errors.py::test_keras_still_has_the_replaced_reduction.
OPTIMIZER_REDUCE_METHOD = "_all_reduce_sum_gradients"


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


def replace_optimizer_reduction(optimizer) -> None:
    """Gives `optimizer` (an INSTANCE) an identity in place of its own
    cross-replica sum. Raises RuntimeError if this Keras has none."""
    if keras_major() != SUPPORTED_KERAS_MAJOR:
        raise RuntimeError(
            f"tfmulti's gradient reduction supports Keras "
            f"{SUPPORTED_KERAS_MAJOR}.x; this is Keras {keras.__version__}. "
            "Install keras>=3.15,<4.")
    if not callable(getattr(type(optimizer), OPTIMIZER_REDUCE_METHOD, None)):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `{OPTIMIZER_REDUCE_METHOD}`: "
            f"this Keras ({keras.__version__}) changed how its TensorFlow "
            "optimizer reduces gradients, and tfmulti cannot stop it from "
            "reducing them a second time. Use keras 3.15.")
    setattr(optimizer, OPTIMIZER_REDUCE_METHOD, _already_reduced)



# --- A Keras 3 optimizer that updates one device's variables alone ----------
# Symptom: Keras 3's TFOptimizer routes `update_step` and weight decay through
# `maybe_merge_call` + `strategy.extended.update`, which under a
# MirroredStrategy asserts the variable is a DistributedVariable; a sharded
# optimizer updates a plain variable on ONE replica's device, from that
# replica's context. The backend-neutral BaseOptimizer versions loop over
# `update_step` / `assign_sub` directly, and build slots without the
# strategy's `colocate_vars_with` (which refuses a plain variable). Checked: Keras 3.15.1.
# Guard: test_optimizer_sharding.py (test_local_update_methods_exist).
LOCAL_UPDATE_METHODS = ("_backend_update_step", "_apply_weight_decay",
                        "add_variable_from_reference")


def make_optimizer_local(optimizer) -> None:
    """Makes `optimizer` (an INSTANCE) update its variables in place, with
    no cross-replica merge. Raises RuntimeError if this Keras changed."""
    from keras.src.optimizers import base_optimizer
    for name in LOCAL_UPDATE_METHODS:
        base = getattr(base_optimizer.BaseOptimizer, name, None)
        if not callable(base) or not callable(
                getattr(type(optimizer), name, None)):
            raise RuntimeError(
                f"{type(optimizer).__name__} or Keras's BaseOptimizer has no "
                f"`{name}`: this Keras ({keras.__version__}) changed how an "
                "optimizer applies updates, and tfmulti cannot shard its "
                "state. Use keras 3.15 or shard_optimizer_state=False.")
        setattr(optimizer, name, types.MethodType(base, optimizer))


def optimizer_built_variables(optimizer):
    """The variables a built Keras 3 optimizer updates, in build order."""
    variables = getattr(optimizer, "_trainable_variables", None)
    if variables is None or not getattr(optimizer, "built", False):
        raise RuntimeError(
            f"{type(optimizer).__name__} is not built (or this Keras "
            f"{keras.__version__} keeps no `_trainable_variables`); call "
            "optimizer.build(model.trainable_variables) first.")
    return list(variables)


def plain_variable(**kwargs):
    """A tf.Variable made without any variable creator (so not distributed
    even inside a strategy scope), placed by the enclosing `tf.device`.
    Keyword arguments are tf.Variable's; sync/aggregation are dropped."""
    from tensorflow.python.ops import resource_variable_ops
    for key in ("synchronization", "aggregation",
                "experimental_enable_variable_lifting"):
        kwargs.pop(key, None)
    return resource_variable_ops.ResourceVariable(**kwargs)

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


# --- Which strategy a Keras object belongs to (private attributes) ---------
# Symptom: Keras 3 exposes no public "strategy of this optimizer / model /
# variable"; the TF backend keeps it in `_distribution_strategy` (optimizer),
# `_distribute_strategy` (model, and the tf.Variable under a Keras variable).
# An optimizer made outside the scope puts its slots under another scope
# (tensorflow/tensorflow#55713). Checked: Keras 3.15.1.
# Guard: test_compat.py::test_private_strategy_attributes_still_exist.
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


# --- Keras's train step internals that tfmulti's step reproduces -----------
# Symptom: `keras.Model.train_step` (TF backend) cannot be reused without
# its own gradient application, so tfmulti.keras.distributed re-does its loss
# part, which reads the private `_call_has_training_arg` and updates the
# private `_loss_tracker` exactly as Keras does. Checked: Keras 3.15.1.
# Guard: test_compat.py::test_private_strategy_attributes_still_exist.
def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (Keras's cached answer)."""
    return bool(getattr(model, "_call_has_training_arg", True))


def loss_tracker(model):
    """The metric Keras's `fit` reports as "loss"."""
    return model._loss_tracker


# --- Keras `fit` has no public initial epoch from a callback ---------------
# Symptom: a callback can only move `fit`'s start through the private
# `model._initial_epoch` (Keras's own BackupAndRestore does), and Keras
# never resets it: a later `fit` of the same model starts there too.
# Checked: Keras 3.15.1.
# Guard: test_compat.py::test_keras_keeps_initial_epoch_after_fit.
def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the running `fit` start at `epoch` (None: the caller's)."""
    model._initial_epoch = epoch or None


# --- Distributed iterators cannot be checkpointed --------------------------
# Symptom: iterators of `strategy.experimental_distribute_dataset` /
# `distribute_datasets_from_function` are not trackable in TF 2.21, so a
# resumed job replays the consumed batches instead of restoring the
# position. Checked: TF 2.21.0.
# Guard: test_compat.py (distributed_iterator_not_trackable).
def is_trackable(obj) -> bool:
    """Whether `obj` can go into a `tf.train.Checkpoint`."""
    return isinstance(obj, tf.__internal__.tracking.Trackable)


# --- tf.train.latest_checkpoint globs the directory ------------------------
# Symptom: `latest_checkpoint` checks the path from the `checkpoint` state
# file with a glob, so a `model_dir` containing `[` `]` (a sweep dir like
# `lr[0.1]`) never resumes; a junk state file hides intact checkpoints.
# Checked: TF 2.21.0.
# Guard: test_compat.py::test_latest_checkpoint_still_globs.
def checkpoint_prefixes(directory: str, *, basename: str = "ckpt"
                        ) -> list[tuple[int, str]]:
    """`(number, prefix)` of the complete `<basename>-N` checkpoints in
    `directory`, oldest first, read from the directory listing (no glob, no
    state file). A checkpoint is complete when its `.index` exists."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        stem, _, suffix = name.rpartition(".")
        head, _, number = stem.rpartition("-")
        if suffix == "index" and head == basename and number.isdigit():
            found.append((int(number), os.path.join(directory, stem)))
    return sorted(found)


# --- Keras losses divide by the replica count under a strategy -------------
# Symptom: `keras.losses.Loss.__call__` (`reduce_values`) multiplies the
# mean loss by 1/num_replicas in a replica context, so the compiled loss is
# already this replica's share; the value Keras's loss tracker wants is the
# unscaled mean. Checked: Keras 3.15.1.
# Guard: test_compat.py (keras_loss_scales_by_replicas).
def unscaled_keras_loss(loss, strategy):
    """The local mean loss from a Keras-compiled loss of this replica."""
    return loss * tf.cast(strategy.num_replicas_in_sync, loss.dtype)


# --- Collective instance keys bound at call time (MirroredStrategy) --------
# Symptom: TensorFlow's "Custom training with tf.distribute.Strategy"
# tutorial (optimizer built by its first `apply_gradients` inside
# `tf.function(strategy.run(...))`) and plain Keras `fit` with
# `steps_per_execution > 1` fail under MirroredStrategy: "InvalidArgument
# Error: You must feed a value for placeholder tensor 'cond/else/_1/cond/
# Placeholder' with dtype int32". Cause: `distribute/cross_device_utils.py`
# `_next_instance_key` takes each collective's instance key from
# `capture_call_time_value`, a placeholder fed when the OUTER function is
# called; a collective inside a function called from a `tf.cond` branch
# (tf.function's `fn_with_cond` for variables made on the first call,
# Keras's `tf.while_loop`/`tf.cond` around each step) leaves it unfed.
# Call-time keys let workers that retrace at different times agree; one
# process has no such peers, so keys fixed at trace time are as safe (TF
# did that before 2.5). Set on the launchers of tfmulti's mirrored
# strategies only, never globally. Checked: TF 2.21.0, Keras 3.15.1.
# Guard: tests/conformance/test_conformance.py::test_stock_mirrored_
# tutorial_still_fails.
_log = logging.getLogger(__name__)


def _trace_time_instance_keys():
    return False


def bind_collective_keys_at_trace_time(strategy) -> bool:
    """Makes `strategy`'s collectives take instance keys at trace time.

    Only for a single-process MirroredStrategy whose all-reduce is
    `CollectiveAllReduce` (TensorFlow's default on CPUs and GPUs).

    Returns:
      Whether the strategy was changed.
    """
    ops = getattr(strategy.extended, "_collective_ops", None)
    launchers = getattr(ops, "_launchers", None)
    if not launchers or not all(
            callable(getattr(l, "_use_unique_instance_key", None))
            for l in launchers):
        _log.warning(
            "tfmulti: this TensorFlow (%s) changed its collective launchers; "
            "a custom loop whose optimizer is built by its first step, and "
            "Keras fit with steps_per_execution > 1, may fail under "
            "MirroredStrategy. Call optimizer.build(model.trainable_variables)"
            " under strategy.scope() first, or use tfmulti.keras.distributed.",
            tf.__version__)
        return False
    for launcher in launchers:
        launcher._use_unique_instance_key = _trace_time_instance_keys
    return True


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
_KERAS_BUILD_CALLER = "_maybe_symbolic_build"


def called_by_keras_build() -> bool:
    """Whether the running `strategy.reduce` was called by Keras's build."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == _KERAS_BUILD_CALLER:
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


# --- Keras draws the same random numbers on every replica -----------------
# Symptom: under MirroredStrategy or MultiWorkerMirroredStrategy,
# `keras.random.*(seed=SeedGenerator)`, `keras.layers.Dropout` and every
# layer drawing from a `SeedGenerator` (or the global one) give the SAME
# numbers on every replica: N replicas repeat each of a per-replica batch's
# dropout masks N times where one device draws one per example, and the
# keras-io GAN's replicas generate N copies of the same latents. Cause:
# `keras/src/random/seed_generator.py` keeps its state in a variable with
# aggregation "none" (keras-team/keras#20612, for #20611): one copy per
# replica, all starting equal and advancing alike. TensorFlow's own
# `tf.random.Generator` gives each replica its own stream; tfmulti's
# strategies do the same for Keras: in a replica context of more than one
# replica, the drawn seed is folded with the replica's global id
# (`tf.random.experimental.stateless_fold_in`). An integer seed stays the
# user's fixed seed. Checked: Keras 3.15.1. Guard:
# tests/test_compat.py::test_stock_defect_is_still_present[keras_random_alike_on_every_replica].
def _made_by_tfmulti(strategy) -> bool:
    """Whether `strategy` came from tfmulti (`create_strategy`,
    `multi_worker_on_cpus`), which marks every strategy it makes with its
    communication options: the Keras fixes below change nothing else."""
    return getattr(strategy, "_tfmulti_communication_options",
                   None) is not None


def _tfmulti_replica_context():
    """The replica context of a tfmulti strategy with more than one
    replica, or None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync < 2 or not _made_by_tfmulti(
            ctx.strategy):
        return None
    return ctx


def draw_seeds_per_replica() -> bool:
    """Makes every Keras `SeedGenerator` draw per replica under tfmulti's
    strategies, once per process.

    Returns:
      Whether it was installed now (False: already, or this Keras keeps its
      seed generator elsewhere; then a warning says what it means).
    """
    try:
        from keras.src.random import seed_generator
        cls = seed_generator.SeedGenerator
        stock = cls.next
    except (ImportError, AttributeError):
        _log.warning(
            "tfmulti: this Keras (%s) moved its SeedGenerator; dropout and "
            "keras.random may draw the same numbers on every replica.",
            keras.__version__)
        return False
    if getattr(stock, "_tfmulti_per_replica", False):
        return False

    def next(self, ordered=True):  # noqa: A001 - Keras's method name
        seed = stock(self, ordered=ordered)
        ctx = _tfmulti_replica_context()
        if ctx is None:
            return seed
        return tf.cast(tf.random.experimental.stateless_fold_in(
            seed, ctx.replica_id_in_sync_group), seed.dtype)

    next._tfmulti_per_replica = True
    cls.next = next
    return True


# --- Keras cannot build a model without `call` under a strategy ------------
# Symptom: `fit` of a model that only overrides `train_step` and calls its
# sub-models there (the keras-io GAN) fails under any strategy before the
# first step: "RuntimeError: Unable to automatically build the model ...",
# and trains without one. Cause: `keras/src/backend/tensorflow/trainer.py`
# `_maybe_symbolic_build` builds symbolically whenever a strategy is set, by
# calling the model (`compute_output_spec(self, x)`), which a model without
# `call` cannot do. tfmulti's strategies mark such a model built when every
# layer under it is (nothing is left for the build to create); any other
# model, and any model under another strategy, goes to Keras's build
# unchanged. Checked: Keras 3.15.1. Guard:
# tests/test_compat.py::test_stock_defect_is_still_present[model_without_call_not_built].
def _built_without_call(model) -> bool:
    """Whether `model` (without a `call` of its own) needs no build: all its
    layers are built. Marks it built then."""
    if model.built:
        return True
    layers = list(model._flatten_layers(include_self=False))
    if not all(layer.built for layer in layers):
        return False
    model.built = True
    return True


def build_models_without_call() -> bool:
    """Wraps Keras's `_maybe_symbolic_build` (TensorFlow trainer) once: a
    model without `call` whose layers are built skips it under tfmulti's
    strategies.

    Returns:
      Whether it was wrapped now.
    """
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
        cls = tf_trainer.TensorFlowTrainer
        stock = getattr(cls, _KERAS_BUILD_CALLER)
    except (ImportError, AttributeError):
        return False
    if getattr(stock, "_tfmulti_call_less", False):
        return False

    def build(self, *args, **kwargs):
        if (_made_by_tfmulti(getattr(self, "_distribute_strategy", None))
                and type(self).call is keras.Model.call
                and _built_without_call(self)):
            return None
        return stock(self, *args, **kwargs)

    build._tfmulti_call_less = True
    setattr(cls, _KERAS_BUILD_CALLER, build)
    return True


# --- A tf.data service worker's bound address ------------------------------
# `tf.data.experimental.service.WorkerServer` has no public accessor for the
# address it bound (port 0 picks a free one); it keeps it in `_address`
# ("host:port"). Checked: TF 2.21.0. Guard: tests/test_data_service.py
# (every test starts data workers on port 0 and reads their address).
def data_worker_address(server) -> str:
    """The "host:port" a WorkerServer listens on."""
    return server._address


# --- Checkpoint readers glob the prefix ------------------------------------
# Symptom: `tf.train.Checkpoint.restore` and `tf.train.load_checkpoint` of a
# prefix whose path contains `[` `]` (or `*`, `?`) fail: "Unsuccessful
# TensorSliceReader constructor: Failed to find any matching files", and an
# escaped path is not found either; writing works. Checked: TF 2.21.0.
# Guard: test_compat.py::test_checkpoint_readers_still_glob.
_GLOB_CHARACTERS = frozenset("[]*?")


@contextlib.contextmanager
def readable_checkpoint(prefix: str):
    """Yields a prefix TensorFlow can read for checkpoint `prefix`: itself,
    or, when its path has glob characters, a temporary directory of
    symbolic links to its files."""
    if not _GLOB_CHARACTERS & set(prefix):
        yield prefix
        return
    directory, stem = os.path.split(prefix)
    with tempfile.TemporaryDirectory(prefix="tfmulti-ckpt-") as links:
        for name in os.listdir(directory):
            if name.startswith(stem + "."):
                os.symlink(os.path.join(directory, name),
                           os.path.join(links, name))
        yield os.path.join(links, stem)


# --- Deleting an autotuned tf.data iterator can stop the process ----------
# Symptom: deleting a tf.data iterator whose pipeline is autotuned joins its
# `tf_data_model` thread (`Model::OptimizeLoop`). The iterator's
# cancellation callback wakes that thread, but the CancellationManager
# marks itself cancelled only after running its callbacks (tsl
# cancellation.cc), so the woken thread can see "not cancelled" and sleep
# out the rest of its optimisation period (doubling up to 60 s). The Python
# thread dropping the last reference (usually the cyclic GC, in the middle
# of a later trace) holds the GIL meanwhile: the whole process sits at 0
# CPU for up to 60 s per iterator (gdb: the main thread in
# `~LogicalThreadWrapper` <- `RootDataset::Iterator::~Iterator`, joining
# the thread in `OptimizeLoop`'s timed wait). A distributed iterator holds
# several (its source on the host, one per device). Measured with
# tests/workers/iterator_deletion.py: plain iterators block on TF 2.18.1
# and 2.20.0 (7 and 5 of 30, 20-60 s each) but not on 2.21.0; distributed
# ones block on every version checked, 2.21.0 included (1-31 s). In
# distributed fit's golden run: one GC pause of 98-271 s in about half the
# runs on TF 2.18.1, 2.19.1 and 2.20.0. Checked: TF 2.18.1, 2.19.1, 2.20.0,
# 2.21.0.
# Workaround: the datasets of distributed input (what a MultiDeviceIterator
# iterates: its source on the host and its per-device datasets) run
# without autotune, so no model thread is joined. Installed once, when
# tfmulti first imports TensorFlow (this module). Other autotuned
# iterators in the process (plain `iter(dataset)`) are left alone.
# Guard: test_compat.py::test_distributed_iterator_deletion_still_blocks.
def _without_autotune(dataset):
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _distribute_without_autotune() -> None:
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi
    if getattr(mdi, "_tfmulti_without_autotune", False):
        return
    create_device_dataset = mdi._create_device_dataset
    owned_init = mdi.OwnedMultiDeviceIterator.__init__

    def device_dataset(*args, **kwargs):
        return _without_autotune(create_device_dataset(*args, **kwargs))

    def init(self, dataset=None, *args, **kwargs):
        if dataset is not None:
            dataset = _without_autotune(dataset)
        owned_init(self, dataset, *args, **kwargs)

    mdi._create_device_dataset = device_dataset
    mdi.OwnedMultiDeviceIterator.__init__ = init
    mdi._tfmulti_without_autotune = True


def distributed_input_autotuned() -> bool:
    """False once the workaround above is installed in this process."""
    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi
    return not getattr(mdi, "_tfmulti_without_autotune", False)


_distribute_without_autotune()


# --- A from-function dataset counts per-replica batches as steps -----------
# Symptom: `DistributedDatasetsFromFunction.cardinality` is the cardinality
# of the first worker's dataset, which yields one batch per REPLICA; with R
# replicas per worker Keras reads R times too many steps. Plain Keras
# `evaluate` then calls its test function past the end ("Your input ran out
# of data"), and in that last call the loss tracker's count update, whose
# `tf.shape(x)[0]` TensorFlow folds to a constant, races the end-of-data
# error and lands on some replicas: the loss's count came out 1029, 1050,
# 1071 or 1092 for 1008 rows on 4 replicas, a different loss each run.
# Checked: TF 2.21.0, Keras 3.15.1.
# Workaround: `tfmulti.distribute_dataset` sets the known count of global
# steps. Guard: test_compat.py (from_function_cardinality_per_replica).
def set_global_steps(distributed_dataset, strategy) -> None:
    """Makes a finite from-function dataset report global steps."""
    per_worker = int(getattr(distributed_dataset, "_cardinality", -1))
    replicas_here = len(strategy.extended.worker_devices)
    if per_worker >= 0 and replicas_here > 1:
        distributed_dataset._cardinality = per_worker // replicas_here


# --- Keras losses are scaled by 1/replicas in a custom `test_step` too ------
# Symptom: keras-io "Customizing what happens in fit() with TensorFlow",
# "Providing your own evaluation step": the guide's `test_step` logs
# `self.compute_loss(...)` with `metric.update_state(loss)`; under a
# strategy with N replicas `keras/src/losses/loss.py` `reduce_values` (and
# the TF trainer's `_aggregate_additional_loss`) multiply every loss by 1/N
# (`scale_loss_for_distribution`), which only the summed GRADIENT needs, so
# `evaluate` reports 1/N of one device's loss (0.556 for 2.226 on 4
# replicas), silently. Keras's own `test_step` undoes the scale with
# `unscale_loss_for_distribution`. Checked: Keras 3.15.1.
# Workaround: while a custom `test_step` runs (traced) under tfmulti's
# strategies or `tfmulti.keras.distributed`, both functions are the
# identity, so its losses are what one device computes. Guard: the stock
# scale, test_compat.py (keras_loss_scales_by_replicas); the stock guide's
# 1/N, tests/conformance/test_conformance.py::test_stock_guide_test_step_
# loss_still_scaled; these names, test_keras_fit_local.py::
# test_loss_scaling_functions_still_exist.
_LOSS_SCALE_FUNCTIONS = ("scale_loss_for_distribution",
                         "unscale_loss_for_distribution")
_unscaled_lock = threading.Lock()
_unscaled_depth = 0
_scaled_originals = {}


def _identity(value):
    return value


def _loss_module():
    from keras.src.losses import loss as loss_module
    missing = [n for n in _LOSS_SCALE_FUNCTIONS
               if not callable(getattr(loss_module, n, None))]
    if missing:
        raise RuntimeError(
            f"keras.src.losses.loss has no {missing}: this Keras "
            f"({keras.__version__}) changed how it scales losses for "
            "replicas, and tfmulti cannot report a custom test_step's loss "
            "as one device does. Use keras 3.15.")
    return loss_module


@contextlib.contextmanager
def unscaled_keras_losses():
    """Keras losses computed inside are not scaled for replicas (re-entrant,
    and shared by the replica threads of one `strategy.run`)."""
    global _unscaled_depth
    module = _loss_module()
    with _unscaled_lock:
        if _unscaled_depth == 0:
            for name in _LOSS_SCALE_FUNCTIONS:
                _scaled_originals[name] = getattr(module, name)
                setattr(module, name, _identity)
        _unscaled_depth += 1
    try:
        yield
    finally:
        with _unscaled_lock:
            _unscaled_depth -= 1
            if _unscaled_depth == 0:
                for name in _LOSS_SCALE_FUNCTIONS:
                    setattr(module, name, _scaled_originals.pop(name))


def losses_unscaled_in(fn):
    """`fn` (a step that computes losses only to log them) run inside
    `unscaled_keras_losses`."""
    def unscaled(*args, **kwargs):
        with unscaled_keras_losses():
            return fn(*args, **kwargs)
    unscaled.__name__ = getattr(fn, "__name__", "unscaled")
    return unscaled


# --- Keras 3 writes every file from every worker ---------------------------
# Symptom: under MultiWorkerMirroredStrategy every worker runs the same
# callbacks and saves, to the same paths: `keras.callbacks.BackupAndRestore`
# writes `latest.weights.h5` from each (h5py "BlockingIOError: [Errno 11]
# Unable to synchronously create file (unable to lock file ...)", then the
# peer's collectives abort), `TensorBoard` writes one event file per worker
# and split, `ModelCheckpoint` and `model.save("x.keras")` interleave their
# writes ("BadZipFile: Bad CRC-32 for file 'config.json'" in 2 of 5 runs),
# `CSVLogger` writes each row twice. tf.keras (Keras 2) wrote from the chief
# only and sent the others to temporary directories
# (`keras/distribute/distributed_file_utils.py`); Keras 3 dropped that
# (keras-team/keras#20601: multi-worker not supported). Checked: Keras 3.15.1.
# Workaround (`tfmulti.chief_writes`, installed when tfmulti makes a
# multi-worker strategy): `keras.Model.save` / `save_weights` / `export` and
# `keras.callbacks.CallbackList.set_model` / `on_train_begin` /
# `on_train_end` are wrapped; the wrappers change nothing unless the model's
# strategy is tfmulti's multi-worker one with more than one worker. Below:
# where each callback keeps the paths it writes (private, set by
# `set_model` or `__init__`). Guards: tests/test_keras_chief_writes.py
# (test_keras_callbacks_still_have_no_chief_logic,
# test_callback_write_paths_still_exist).
def callback_write_paths() -> dict:
    """{Keras callback class: the attributes holding the paths it writes,
    its root (a directory or file the others are in) first}."""
    return {
        keras.callbacks.BackupAndRestore: (
            "backup_dir", "_weights_path", "_training_metadata_path",
            "_prev_weights_path", "_prev_training_metadata_path"),
        # `set_model` derives the others from `log_dir`, and writes.
        keras.callbacks.TensorBoard: ("log_dir", "_log_write_dir",
                                      "_train_dir", "_val_dir"),
        keras.callbacks.CSVLogger: ("filename",),
    }


MODEL_WRITE_METHODS = ("save", "save_weights", "export")
_CALLBACK_LIST_HOOKS = ("set_model", "on_train_begin", "on_train_end")


def wrap_keras_writes(model_write, callback_list_hook) -> bool:
    """Wraps Keras's model writers and callback list hooks, once.

    `model_write(name, original, model, *args, **kwargs)` stands in for
    `keras.Model.<name>`; `callback_list_hook(name, original, callback_list,
    *args, **kwargs)` for `keras.callbacks.CallbackList.<name>`.

    Returns:
      Whether they were wrapped now (False: already wrapped).
    """
    if getattr(keras.Model, "_tfmulti_writes_wrapped", False):
        return False

    def wrap(cls, name, hook):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            return hook(name, original, self, *args, **kwargs)
        wrapped.__name__ = name
        wrapped.__doc__ = original.__doc__
        wrapped.__wrapped__ = original
        setattr(cls, name, wrapped)

    for name in MODEL_WRITE_METHODS:
        wrap(keras.Model, name, model_write)
    for name in _CALLBACK_LIST_HOOKS:
        wrap(keras.callbacks.CallbackList, name, callback_list_hook)
    keras.Model._tfmulti_writes_wrapped = True
    return True


# --- Telling another worker a file is written, without a collective --------
# Symptom: a script that saves on every worker and then loads the chief's
# file (TF's "Multi-worker training with Keras", "Model saving and
# loading") can read it on a non-chief before the chief has written it;
# a collective barrier would hang a script that saves from the chief only
# (`if is_chief: model.save(...)`, which needs none in Keras 3). TF's
# coordination service (on in MultiWorkerMirroredStrategy) has a key-value
# store with a blocking read, reachable only through the private
# `context.context().{set,get}_config_key_value`. Checked: TF 2.21.0.
# Guard: tests/test_keras_chief_writes.py::test_coordination_key_value_
# still_private (use: ::test_tutorial_save_then_load_on_every_worker).
def publish_key(key: str, value: str = "1") -> None:
    """Sets `key` in the cluster's coordination service."""
    from tensorflow.python.eager import context
    context.context().set_config_key_value(key, value)


def wait_for_key(key: str, timeout_seconds: float) -> bool:
    """Blocks until `key` is set by some worker; False after the timeout.
    True at once if the service is gone: the chief, which runs it, has
    exited (after its writes, or dead: then nothing more will come)."""
    from tensorflow.python.eager import context
    try:
        context.context().get_config_key_value(
            key, timeout_in_ms=int(timeout_seconds * 1000))
    except tf.errors.DeadlineExceededError:
        return False
    except tf.errors.UnavailableError:
        return True
    return True
