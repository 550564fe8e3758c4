"""Trainer(shard_optimizer_state=1 or 2): the same numbers as the unsharded
Trainer and one device, checkpoints in the unsharded form, and refusals at
construction.

The golden runs are one subprocess with 4 simulated CPU devices
(tests/workers/sharded_trainer_golden.py): 50 updates with clipping by the
global norm and K=2 micro-batches for Adam, AdamW (weight decay and a
schedule), SGD with momentum, RMSprop, mixed float16 and a bfloat16 wire,
unsharded and at ZeRO stages 1 and 2; 25 sharded steps on 4 replicas then
25 unsharded on one device (and the reverse) against 50 on one device, for
both stages. Two worker processes of 2 simulated CPUs each run every case
at both stages over the 4 replicas of MultiWorkerMirroredStrategy.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tests.subproc import run_python, run_workers  # noqa: E402

# Float32 sums in another order: measured at most 2.4e-7 (losses) and
# 1.8e-7 (weights) over 20 steps, 1.2e-7 over the 50-step resumes.
TOLERANCE = 1e-5
STEPS = 50
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "rmsprop")
STAGES = ("sharded", "sharded2")
# Every case of the two-worker run (bf16_wire: mirrored only).
WORKER_CASES = OPTIMIZERS + ("mixed_float16",)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded_trainer")
    out = work / "golden.json"
    run_python(["tests/workers/sharded_trainer_golden.py", "local",
                str(out), str(work)], timeout=900)
    return json.loads(out.read_text())


def assert_matches(run, reference, tolerance=TOLERANCE, *, state=False):
    """Losses and weights; with `state`, the optimizer's variables too."""
    np.testing.assert_allclose(run["loss"], reference["loss"], atol=tolerance)
    for key in ("weights", "optimizer") if state else ("weights",):
        assert len(run[key]) == len(reference[key])
        for a, b in zip(run[key], reference[key]):
            np.testing.assert_allclose(a, b, atol=tolerance, err_msg=key)


def max_weight_diff(run, reference):
    return max(float(np.max(np.abs(np.subtract(a, b))))
               for a, b in zip(run["weights"], reference["weights"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_trainer_matches_unsharded_and_one_device(golden, name):
    case = golden[name]
    reference = case["one_device"]
    # The run moved: not a comparison of two untouched models.
    assert reference["loss"][0] - reference["loss"][-1] > 0.1
    for run in ("unsharded",) + STAGES:
        assert_matches(case[run], reference)
        # The optimizer's step counter (what a schedule reads) advanced
        # once per update, as unsharded.
        assert case[run]["iterations"] == case[run]["step"] == STEPS
    # Stage 2 reduce-scattered with the all-to-all, and counted one
    # gradient collective per update, of the padded flat gradient.
    assert case["sharded2"]["path"] == "all-to-all"
    assert case["sharded2"]["communication"]["all_reduce_calls"] == STEPS
    assert case["sharded2"]["communication"]["all_reduce_bytes"] == (
        STEPS * 196 * 4)


@pytest.mark.slow
def test_stage2_all_reduce_and_slice_fallback_matches(golden):
    # Where a strategy has no collective launchers, stage 2 all-reduces
    # and slices: the same updates.
    run = golden["adam"]["sharded2_slice"]
    assert run["path"] == "all-reduce+slice"
    assert_matches(run, golden["adam"]["one_device"])
    assert run["iterations"] == STEPS


@pytest.mark.slow
def test_sharded_mixed_float16_skips_as_unsharded(golden):
    # The loss scale is decided on the reduced gradient (stage 2: on the
    # all-reduced count of non-finite elements of the shards): the sharded
    # runs skip the same overflowing updates as the unsharded one on the
    # same 4 replicas and then make the same updates. (One device overflows
    # at other steps: its float16 gradient holds all rows, a replica's an
    # eighth; a property of float16, not of sharding.)
    case = golden["mixed_float16"]
    for run in STAGES:
        assert case[run]["iterations"] == case["unsharded"]["iterations"]
        assert case[run]["iterations"] < case[run]["step"] == STEPS
        assert_matches(case[run], case["unsharded"])


@pytest.mark.slow
def test_bfloat16_wire_sharded_no_farther_than_unsharded(golden):
    # bfloat16 rounds each replica's gradient on the wire: the runs leave
    # the float32 one-device path, sharded or not. Stage 1 all-reduces in
    # bfloat16 as unsharded does; stage 2 sums the received bfloat16 rows
    # in float32, so it is no farther from one device than unsharded.
    case = golden["bf16_wire"]
    reference = case["one_device"]
    unsharded = max_weight_diff(case["unsharded"], reference)
    assert unsharded > 1e-6  # the wire dtype did round
    assert_matches(case["sharded"], case["unsharded"])
    assert max_weight_diff(case["sharded2"], reference) <= unsharded * 1.05


@pytest.mark.slow
@pytest.mark.parametrize("run", ["sharded_to_one_device",
                                 "one_device_to_sharded",
                                 "sharded2_to_one_device",
                                 "one_device_to_sharded2"])
def test_elastic_resume_between_sharded_and_one_device(golden, run):
    case = golden["resume"]
    assert len(case[run]["loss"]) == 50
    # The optimizer too: the one the last run saved (the sharded run's
    # gathered from its shards) is the one-device optimizer's state.
    assert_matches(case[run], case["one_device"], state=True)
    assert case[run]["iterations"] == 50


@pytest.mark.slow
def test_sharded_trainer_state_is_a_quarter_per_device(golden):
    for run in STAGES:
        per_device = golden["adam"][run]["bytes_per_device"]
        assert len(per_device) == 4
        # Dense(8->16) + Dense(16->3): 195 parameters, shards of 49 floats;
        # Adam's two slots of a shard, its step (int64) and rate (float32).
        assert set(per_device.values()) == {2 * 49 * 4 + 8 + 4}


@pytest.mark.slow
def test_two_workers_of_two_replicas_sharded_match(golden, tmp_path):
    # 2 workers x 2 simulated CPUs, sharded over the 4 replicas at stages 1
    # and 2, saving a checkpoint every 25 steps (every worker gathers the
    # shards).
    run_workers(["tests/workers/sharded_trainer_golden.py", "multi_worker",
                 str(tmp_path / "worker{index}.json"), str(tmp_path),
                 *WORKER_CASES], 2, timeout=600)
    for index in range(2):
        worker = json.loads((tmp_path / f"worker{index}.json").read_text())
        for name in OPTIMIZERS:
            for stage in STAGES:
                run = worker[name][stage]
                # The gathered (checkpointed) state is the one-device
                # optimizer's.
                assert_matches(run, golden[name]["one_device"], state=True)
                assert run["iterations"] == STEPS
                assert len(run["bytes_per_device"]) == 2
            assert worker[name]["sharded2"]["path"] == "all-to-all"
        for stage in STAGES:
            assert set(worker["adam"][stage]["bytes_per_device"].values(
                )) == {2 * 49 * 4 + 8 + 4}
        # Float16 rounds per replica: the same 4-replica split as the
        # mirrored unsharded run, the same skipped updates.
        for stage in STAGES:
            mixed = worker["mixed_float16"][stage]
            assert_matches(mixed, golden["mixed_float16"]["unsharded"],
                           state=True)
            assert mixed["iterations"] == golden["mixed_float16"][
                "unsharded"]["iterations"] < STEPS
    assert sorted(p for p in os.listdir(tmp_path / "adam2")
                  if p.startswith("ckpt-50")) == [
        "ckpt-50.data-00000-of-00001", "ckpt-50.index"]


# --- refusals at construction, in process ------------------------------------

def build(strategy, make_optimizer=lambda: keras.optimizers.Adam(0.01)):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return model, make_optimizer()


@pytest.fixture
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


@pytest.mark.parametrize("kwargs,match", [
    ({"shard_optimizer_state": 3}, r"`shard_optimizer_state` should be "
     r"False, True \(stage 1\), 1 or 2 \(the ZeRO stage.*got 3"),
    ({"shard_optimizer_state": "2"}, r"`shard_optimizer_state` should be "
     r".*got '2'"),
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


def test_callable_learning_rate_is_refused(mirrored):
    model, optimizer = build(
        mirrored, lambda: keras.optimizers.Adam(lambda: 0.01))
    with pytest.raises(ValueError, match=r"`optimizer` \(Adam\) has a "
                       r"callable learning rate \(__lambda__\)"):
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
    with pytest.raises(ValueError, match=r"MultiWorkerMirroredStrategy; the "
                       r"strategy is OneDeviceStrategy"):
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


def test_shards_follow_a_learning_rate_set_while_training(mirrored):
    # Keras's LearningRateScheduler / ReduceLROnPlateau set the model
    # optimizer's rate; the shard optimizers must use it. Rate 0 from the
    # first step: three updates leave every weight exactly as it was.
    model, optimizer = build(mirrored)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=mirrored,
                              shard_optimizer_state=True, steps_per_loop=3)
    before = [w.copy() for w in model.get_weights()]

    class ZeroRate(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            trainer.optimizer.learning_rate = 0.0

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices(
        (x, np.zeros(64, "int32"))).repeat().batch(8, drop_remainder=True)
    trainer.fit(data, steps=3, callbacks=[ZeroRate()], verbose=0)
    assert int(trainer.optimizer.iterations.numpy()) == 3
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # And the Adam moments did move: the updates ran, at rate 0. The end
    # of fit gathered them into the Trainer's (unsharded) optimizer.
    sharding = trainer.runner.sharding
    shard_momentum = [v for v in sharding.optimizers[0].variables
                      if v.name.endswith("_momentum")][0].numpy()
    assert np.abs(shard_momentum).max() > 0
    np.testing.assert_array_equal(sharding.layout.flatten(
        [v.value for v in trainer.optimizer.variables
         if v.name.endswith("_momentum")]).numpy(), shard_momentum)
