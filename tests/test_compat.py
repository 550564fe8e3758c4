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
         "tfmulti/compat.py and this guard")


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
