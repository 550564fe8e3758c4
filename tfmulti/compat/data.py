"""tf.data under a strategy: distributed iterators' autotune, the global
steps of a from-function dataset, a data worker's address."""

from __future__ import annotations

import tensorflow as tf


# --- A tf.data service worker's bound address ------------------------------
# `tf.data.experimental.service.WorkerServer` has no public accessor for the
# address it bound (port 0 picks a free one); it keeps it in `_address`
# ("host:port"). Checked: TF 2.21.0. Guard: tests/test_data_service.py
# (every test starts data workers on port 0 and reads their address).
def data_worker_address(server) -> str:
    """The "host:port" a WorkerServer listens on."""
    return server._address


# --- A distributed iterator's dataset and a per-replica spec's parts -------
# A distributed iterator keeps the dataset it iterates in
# `_distributed_dataset`, and a per-replica TypeSpec (`PerReplicaSpec`, the
# element spec of a distributed dataset with several local replicas) its
# per-replica specs in `_value_specs`; neither is public
# (tensorflow/python/distribute/input_lib.py, values.py). Checked: TF
# 2.18.1, 2.21.0. Guard: test_compat.py::test_private_names_tfmulti_reads_
# still_exist; use: test_keras_fit_local.py, test_data_distributed.py.
def iterator_dataset(iterator):
    """The distributed dataset `iterator` reads, or None."""
    return getattr(iterator, "_distributed_dataset", None)


def replica_spec(spec):
    """One replica's spec of a (possibly per-replica) TypeSpec `spec`."""
    return getattr(spec, "_value_specs", (spec,))[0]


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
