"""Every version-guarded Keras / TensorFlow workaround, in one place.

Each workaround is one function or class below, headed by a short comment:
the upstream symptom, the upstream issue, the versions checked, and the test
in `tests/test_compat.py` that fails once an upstream release fixes it (then
delete the workaround and its test). Nothing else in tfmulti touches a
private Keras or TensorFlow attribute: it calls the accessor here.

To add one: append a function or class with the same header at the end, and
a guard test in `tests/test_compat.py`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

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
    return loss * strategy.num_replicas_in_sync


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
