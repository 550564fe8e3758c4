"""Sharded optimizer state (ZeRO-1) equals the unsharded step and one device.

One subprocess with 4 simulated CPU devices (tests/workers/
optimizer_sharding_golden.py) runs every case: 50 steps with clipping by the
global norm for Adam, AdamW, SGD with momentum and RMSprop; resumes both ways
through the unsharded optimizer state; the unshardable optimizers' errors.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python

# Float32 sums in a different order: measured at most 2.4e-7 (losses) and
# 1.2e-7 (weights) over 50 steps.
TOLERANCE = 1e-5
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "rmsprop")
RUNS = ("unsharded", "sharded", "sharded_to_one_device",
        "one_device_to_sharded")


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero") / "golden.json"
    run_python(["tests/workers/optimizer_sharding_golden.py", str(out)],
               timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_matches_unsharded_and_one_device(golden, name):
    case = golden[name]
    reference = case["one_device"]
    # The run moved: the comparison is not between two untouched models.
    assert abs(reference["loss"][-1] - reference["loss"][0]) > 1e-3
    for run in RUNS:
        np.testing.assert_allclose(case[run]["loss"], reference["loss"],
                                   atol=TOLERANCE, err_msg=run)
        for a, b in zip(case[run]["weights"], reference["weights"]):
            np.testing.assert_allclose(a, b, atol=TOLERANCE, err_msg=run)
    # The gathered shards are the one-device optimizer's slots.
    assert case["state_difference"] < TOLERANCE


@pytest.mark.slow
def test_train_step_with_sharding_and_accumulation(golden):
    # TrainStep(sharding=...), 2 micro-batches of 8 per update, clipping:
    # the one-device run with batches of 16.
    case = golden["adam"]
    run, reference = case["train_step_accumulated"], case["one_device"]
    np.testing.assert_allclose(run["loss"], reference["loss"],
                               atol=TOLERANCE)
    for a, b in zip(run["weights"], reference["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_bytes_per_device_is_a_quarter(golden, name):
    case = golden[name]
    per_device = case["bytes_per_device"]
    assert len(per_device) == 4
    for used in per_device.values():
        assert used <= case["unsharded_bytes"] * (1 / 4 + 0.05)


@pytest.mark.slow
def test_unshardable_optimizers_are_refused_by_name(golden):
    errors = golden["errors"]
    assert "Adafactor" in errors["adafactor"]
    assert "`global_clipnorm`" in errors["global_clipnorm"]


def test_local_update_methods_exist():
    # Guard for compat.make_optimizer_local: the Keras private methods it
    # replaces still exist on the TensorFlow optimizer and BaseOptimizer.
    import keras
    from keras.src.optimizers import base_optimizer

    from tfmulti import compat
    for name in compat.LOCAL_UPDATE_METHODS:
        assert callable(getattr(base_optimizer.BaseOptimizer, name))
        assert callable(getattr(keras.optimizers.Adam, name))
    assert callable(getattr(keras.optimizers.Adam, "build"))


@pytest.mark.parametrize("shapes", [[(5, 7), (7,), (7, 3), (3,)], [(5,)],
                                    [(3, 2), (1,)]])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_shard_of_equals_the_slice_of_the_flat_vector(shapes, num_shards):
    # The update builds its shard from the overlapping pieces only; it must
    # be the slice of the flattened, padded vector, padding shards too
    # (5 elements over 8 shards: three shards are all padding).
    import tensorflow as tf

    from tfmulti.training.flat_layout import FlatLayout
    rng = np.random.default_rng(0)
    tensors = [tf.constant(rng.normal(size=s).astype("float32"))
               for s in shapes]
    layout = FlatLayout(shapes, num_shards)
    flat = layout.flatten(tensors)
    for index in range(num_shards):
        np.testing.assert_array_equal(layout.shard_of(tensors, index),
                                      layout.shard(flat, index))
