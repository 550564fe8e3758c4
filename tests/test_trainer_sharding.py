"""Trainer(shard_optimizer_state=True): checkpoints in the unsharded form,
and refusals at construction."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


# --- refusals at construction, in process ------------------------------------

def build(strategy, make_optimizer=lambda: keras.optimizers.Adam(0.01)):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return model, make_optimizer()


@pytest.fixture
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


@pytest.mark.parametrize("kwargs,match", [
    ({"shard_optimizer_state": 1}, r"`shard_optimizer_state` should be "
     r"True or False, got 1"),
    ({"sync": "local_sgd"}, r"`sync`=LocalSGD\(.*shard_optimizer_state=False"),
    ({"compression": "powersgd"}, r"`compression`=PowerSGD\(.*tf.cond"),
])
def test_conflicting_options_are_refused(mirrored, kwargs, match):
    kwargs = dict(kwargs)
    if kwargs.get("sync") == "local_sgd":
        kwargs["sync"] = tfmulti.LocalSGD(every=2)
    if kwargs.get("compression") == "powersgd":
        kwargs["compression"] = tfmulti.PowerSGD(rank=1)
    model, optimizer = build(mirrored)
    with pytest.raises(ValueError, match=match):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=mirrored,
                        **{"shard_optimizer_state": True, **kwargs})


def test_unshardable_optimizer_is_refused_by_name(mirrored):
    model, optimizer = build(
        mirrored, lambda: keras.optimizers.Adafactor(0.01))
    with pytest.raises(ValueError, match=r"`optimizer` is Adafactor.*rows"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=mirrored,
                        shard_optimizer_state=True)


def test_built_optimizer_is_refused(mirrored):
    model, optimizer = build(mirrored)
    with mirrored.scope():
        optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=r"already built.*mirrored"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=mirrored,
                        shard_optimizer_state=True)


def test_other_strategies_are_refused():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    model, optimizer = build(strategy)
    with pytest.raises(ValueError, match=r"MirroredStrategy; the strategy "
                       r"is OneDeviceStrategy"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                        shard_optimizer_state=True)


def test_unsharded_checkpoint_state_lives_on_the_host(mirrored, tmp_path):
    # One replica, sharded: the optimizer the checkpoint holds is plain
    # (host) variables, and a save gathers the shard's step into it.
    model, optimizer = build(mirrored)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=mirrored,
                              shard_optimizer_state=True, steps_per_loop=3,
                              model_dir=str(tmp_path))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices(
        (x, np.zeros(64, "int32"))).repeat().batch(8, drop_remainder=True)
    trainer.fit(data, steps=3, verbose=0)
    slots = [v for v in trainer.optimizer.variables
             if v.name.endswith(("_momentum", "_velocity"))]
    assert len(slots) == 4
    for slot in slots:
        assert not isinstance(slot.value, tf.distribute.DistributedValues)
    reader = tf.train.load_checkpoint(str(tmp_path))
    steps = [reader.get_tensor(k) for k in
             reader.get_variable_to_shape_map()
             if k.startswith("optimizer/") and "iteration" in k]
    assert steps and all(int(s) == 3 for s in steps)
    # The saved slots are the shard's (one replica: one shard of all 15).
    sharding = trainer.runner.sharding
    shard_momentum = [v for v in sharding.optimizers[0].variables
                      if v.name.endswith("_momentum")][0]
    full_momentum = sharding.layout.flatten(
        [v.value for v in slots if v.name.endswith("_momentum")])
    assert float(tf.reduce_max(tf.abs(full_momentum))) > 0
    np.testing.assert_array_equal(full_momentum.numpy(),
                                  shard_momentum.numpy())
    assert int(sharding.optimizers[0].iterations.numpy()) == 3
