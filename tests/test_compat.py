"""Guards of `tfmulti.compat`: each test reproduces, with stock Keras or
TensorFlow, the upstream defect one workaround exists for, and FAILS once an
upstream release fixes it (then delete the workaround and its test). The
multi-replica defects run in one subprocess on 2 logical CPUs."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import compat  # noqa: E402
from tests.subproc import run_python  # noqa: E402

FIXED = ("an upstream release fixed this: delete the workaround in "
         "tfmulti/compat/ and this guard")


@pytest.fixture(scope="module")
def stock():
    _, out = run_python(["tests/workers/compat_guards.py"], timeout=240)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [
    "multi_worker_reduce", "optimizer_sums_replicas",
    "fit_steps_per_execution_cond", "distributed_iterator_not_trackable",
    "keras_loss_scales_by_replicas", "from_function_cardinality_per_replica",
    "batchnorm_statistics_per_replica",
    "keras_random_alike_on_every_replica", "model_without_call_not_built"])
def test_stock_defect_is_still_present(stock, name):
    assert stock[name]["present"] is True, f"{name}: {FIXED}. {stock[name]}"


def test_private_strategy_attributes_still_exist():
    strategy = tf.distribute.get_strategy()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert hasattr(model, "_distribute_strategy")
    assert hasattr(model, "_call_has_training_arg")
    assert compat.loss_tracker(model) is not None
    assert hasattr(model.optimizer, "_distribution_strategy")
    assert compat.optimizer_strategy(model.optimizer) is strategy
    one_device = tf.distribute.OneDeviceStrategy("/cpu:0")
    with one_device.scope():
        variable = keras.Variable(1.0)
    assert compat.variable_strategy(variable) is one_device


def test_keras_keeps_initial_epoch_after_fit():
    class Start(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            compat.set_initial_epoch(self.model, 1)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), "float32")
    assert model.fit(x, x[:, :1], epochs=2, verbose=0,
                     callbacks=[Start()]).epoch == [1]
    # Not reset by Keras: a plain second fit starts at epoch 1 as well.
    assert model.fit(x, x[:, :1], epochs=2, verbose=0).epoch == [1], FIXED
    compat.set_initial_epoch(model, None)


def test_latest_checkpoint_still_globs(tmp_path):
    directory = tmp_path / "lr[0.1]"
    directory.mkdir()
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    manager = tf.train.CheckpointManager(checkpoint, str(directory), 2)
    path = manager.save()
    assert tf.train.latest_checkpoint(str(directory)) is None, FIXED
    assert compat.checkpoint_prefixes(str(directory)) == [(1, path)]


def test_checkpoint_readers_still_glob(tmp_path):
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    prefix = checkpoint.write(str(tmp_path / "lr[0.1]" / "ckpt-1"))
    with pytest.raises(tf.errors.NotFoundError):
        checkpoint.restore(prefix)
        pytest.fail(FIXED)
    checkpoint.v.assign(2.0)
    with compat.readable_checkpoint(prefix) as readable:
        checkpoint.restore(readable)
    assert float(checkpoint.v) == 1.0


def test_distributed_iterator_deletion_still_blocks():
    # Stock distributed iterators of an autotuned dataset, aged 4 s: one of
    # 30 deletions at least blocks on its autotune thread; through tfmulti
    # (no autotune in distributed input) none does.
    _, out = run_python(["tests/workers/iterator_deletion.py", "30", "4",
                         "--no-plain"],
                        timeout=300)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["workaround"], result
    assert result["blocked"]["tfmulti_distributed"] == [], result
    assert result["blocked"]["stock_distributed"], f"{FIXED}. {result}"


def _source(obj) -> str:
    import inspect
    return inspect.getsource(obj)


def _source_sets(cls, method, name):
    """Whether `cls.method`'s source assigns `self.<name>` (an attribute an
    instance only gets when it runs)."""
    return f"self.{name} =" in _source(getattr(cls, method))


def test_private_names_tfmulti_reads_still_exist():
    """Every private TensorFlow / Keras name an accessor in tfmulti.compat
    reads or replaces is still there: a release that renames one fails here,
    naming it, not deep inside a training run."""
    from keras.src.backend.tensorflow import core as keras_tf_core
    from keras.src.backend.tensorflow import trainer as keras_tf_trainer
    from keras.src.models import sequential
    from keras.src.trainers import compile_utils, trainer
    from tensorflow.python.distribute import (
        collective_all_reduce_strategy, cross_device_ops, cross_device_utils,
        input_lib, sharded_variable, values)
    from tensorflow.python.distribute.cluster_resolver import (
        slurm_cluster_resolver)
    from tensorflow.python.distribute.coordinator import cluster_coordinator
    from tensorflow.python.distribute import parameter_server_strategy_v2
    from tensorflow.python.eager import context

    replica_context = []
    tf.distribute.MirroredStrategy(["/cpu:0"]).run(
        lambda: replica_context.append(hasattr(
            tf.distribute.get_replica_context(), "_replica_id")))
    inputs = keras.Input((2,))
    graph = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    adamw = keras.optimizers.AdamW()
    adamw.exclude_from_weight_decay(var_names=["bias"])

    missing = [what for what, present in [
        # collectives
        ("CollectiveAllReduce._all_reduce", callable(getattr(
            cross_device_ops.CollectiveAllReduce, "_all_reduce", None))),
        ("CollectiveKeys(group_key_start=)", "group_key_start" in
         cross_device_utils.CollectiveKeys.__init__.__code__.co_varnames),
        ("ReplicaContext._replica_id", replica_context == [True]),
        ("CollectiveAllReduce._launchers", "_launchers" in _source(
            cross_device_ops.CollectiveAllReduce)),
        ("CollectiveReplicaLauncher private members", all(callable(getattr(
            cross_device_utils.CollectiveReplicaLauncher, name, None))
            for name in ("_next_instance_key", "_get_ordering_token")) and
         all(name in _source(cross_device_utils.CollectiveReplicaLauncher)
             for name in ("_group_key", "_group_size", "_device",
                          "_options"))),
        ("CollectiveAllReduceExtended._cross_device_ops", "_cross_device_ops"
         in _source(collective_all_reduce_strategy.
                           CollectiveAllReduceExtended)),
        ("Context.abort_collective_ops", callable(getattr(
            context.Context, "abort_collective_ops", None))),
        ("CollectiveAllReduceExtended._initialize_local_devices", callable(
            getattr(collective_all_reduce_strategy.
                    CollectiveAllReduceExtended,
                    "_initialize_local_devices", None))),
        # parameter servers
        ("cluster_coordinator.Worker._is_dead_with_error", "_is_dead_with_"
         "error" in _source(cluster_coordinator.Worker)),
        ("_CoordinatedClosureQueue.put_back", callable(getattr(
            cluster_coordinator._CoordinatedClosureQueue, "put_back",
            None))),
        ("Cluster.closure_queue", _source_sets(
            cluster_coordinator.Cluster, "__init__", "closure_queue")),
        ("ClusterCoordinator._cluster", _source_sets(
            cluster_coordinator.ClusterCoordinator, "__init__", "_cluster")),
        ("ParameterServerStrategyV2._cluster_resolver", "_cluster_resolver"
         in _source(parameter_server_strategy_v2.
                           ParameterServerStrategyV2)),
        ("sharded_variable.ShardedVariable", isinstance(
            getattr(sharded_variable, "ShardedVariable", None), type)),
        ("slurm_cluster_resolver.expand_hostlist / expand_tasks_per_node",
         callable(getattr(slurm_cluster_resolver, "expand_hostlist", None))
         and callable(getattr(slurm_cluster_resolver,
                              "expand_tasks_per_node", None))),
        # tf.data under a strategy
        ("DistributedIterator._distributed_dataset", "_distributed_dataset"
         in _source(input_lib)),
        ("PerReplicaSpec._value_specs", _source_sets(
            values.PerReplicaSpec, "__init__", "_value_specs")),
        # Keras
        ("Layer._flatten_layers", callable(getattr(
            keras.layers.Layer, "_flatten_layers", None))),
        ("Functional._nodes_by_depth", hasattr(graph, "_nodes_by_depth")),
        ("KerasTensor._keras_history", hasattr(inputs, "_keras_history")),
        ("Sequential._functional", "self._functional =" in _source(
            sequential.Sequential)),
        ("tensorflow Variable._initialize", callable(getattr(
            keras_tf_core.Variable, "_initialize", None))),
        ("Trainer._symbolic_build / _compute_loss", callable(getattr(
            trainer.Trainer, "_symbolic_build", None)) and callable(getattr(
                trainer.Trainer, "_compute_loss", None))),
        ("Trainer.compile sets _compile_loss / _compile_metrics",
         _source_sets(trainer.Trainer, "compile", "_compile_loss") and
         _source_sets(trainer.Trainer, "compile", "_compile_metrics")),
        ("TensorFlowTrainer._maybe_symbolic_build / "
         "_aggregate_additional_loss", callable(getattr(
             keras_tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build",
             None)) and callable(getattr(trainer.Trainer,
                                         "_aggregate_additional_loss",
                                         None))),
        ("CompileLoss._flat_losses", "_flat_losses" in _source(
            compile_utils.CompileLoss)),
        ("optimizer._exclude_from_weight_decay", hasattr(
            adamw, "_exclude_from_weight_decay")),
    ] if not present]
    assert not missing, (
        f"private names tfmulti.compat relies on are gone: {missing}. "
        "Update the accessor in tfmulti/compat/ that reads each.")

