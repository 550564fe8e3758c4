"""tfmulti.scaled_learning_rate: values at chosen steps, serialisation, errors."""

import math

import keras
import numpy as np
import pytest

import tfmulti
from tests.subproc import run_python
from tfmulti.schedules import ScaledLearningRate


def _values(schedule, steps):
    return [float(schedule(step)) for step in steps]


def test_linear_scaling_with_gradual_warmup():
    # Goyal et al.: 0.1 per 256 examples, global batch 1024 -> 0.4, reached
    # linearly from 0.1 over the warmup.
    schedule = tfmulti.scaled_learning_rate(
        0.1, base_batch_size=256, global_batch_size=1024, warmup_steps=100)
    assert isinstance(schedule,
                      keras.optimizers.schedules.LearningRateSchedule)
    assert schedule.peak_learning_rate == pytest.approx(0.4)
    np.testing.assert_allclose(
        _values(schedule, [0, 25, 50, 100, 101, 10_000]),
        [0.1, 0.175, 0.25, 0.4, 0.4, 0.4], rtol=1e-6)


def test_sqrt_rule_without_warmup():
    schedule = tfmulti.scaled_learning_rate(
        1e-3, base_batch_size=32, global_batch_size=512, rule="sqrt")
    np.testing.assert_allclose(_values(schedule, [0, 7, 1000]),
                               [4e-3] * 3, rtol=1e-6)


def test_cosine_decay_after_warmup():
    schedule = tfmulti.scaled_learning_rate(
        0.1, base_batch_size=64, global_batch_size=128, warmup_steps=10,
        decay="cosine", decay_steps=100)
    np.testing.assert_allclose(
        _values(schedule, [0, 5, 10, 60, 110, 500]),
        [0.1, 0.15, 0.2, 0.1, 0.0, 0.0], rtol=1e-6, atol=1e-7)


def test_a_keras_schedule_as_decay_multiplier():
    decay = keras.optimizers.schedules.ExponentialDecay(
        1.0, decay_steps=10, decay_rate=0.5)
    schedule = tfmulti.scaled_learning_rate(
        0.01, base_batch_size=32, global_batch_size=64, warmup_steps=4,
        decay=decay)
    np.testing.assert_allclose(_values(schedule, [0, 2, 4, 14, 24]),
                               [0.01, 0.015, 0.02, 0.01, 0.005], rtol=1e-6)


@pytest.mark.parametrize("decay, decay_steps", [
    (None, None), ("cosine", 50),
    (keras.optimizers.schedules.PiecewiseConstantDecay([20], [1.0, 0.1]),
     None)])
def test_config_round_trip(decay, decay_steps):
    schedule = tfmulti.scaled_learning_rate(
        0.05, base_batch_size=16, global_batch_size=64, rule="sqrt",
        warmup_steps=5, decay=decay, decay_steps=decay_steps)
    restored = keras.optimizers.schedules.deserialize(
        keras.optimizers.schedules.serialize(schedule))
    assert isinstance(restored, ScaledLearningRate)
    steps = [0, 3, 5, 24, 26, 60]
    np.testing.assert_allclose(_values(restored, steps),
                               _values(schedule, steps), rtol=1e-7)


def test_model_compiled_with_it_saves_and_loads(tmp_path):
    schedule = tfmulti.scaled_learning_rate(
        0.1, base_batch_size=8, global_batch_size=32, warmup_steps=3,
        decay="cosine", decay_steps=20)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert int(loaded.optimizer.iterations) == 2
    assert float(loaded.optimizer.learning_rate) == pytest.approx(
        float(schedule(2)))
    config = loaded.optimizer.get_config()["learning_rate"]
    assert config["config"] == schedule.get_config()

    # A fresh process that imports tfmulti before keras loads it too (the
    # class is registered when keras is imported).
    _, out = run_python(["-c", (
        "import tfmulti, keras; m = keras.saving.load_model(%r); "
        "print('schedule:', m.optimizer.get_config()['learning_rate']"
        "['registered_name'])")
        % str(tmp_path / "m.keras")], timeout=120)
    assert "schedule: tfmulti>ScaledLearningRate" in out, out


@pytest.mark.parametrize("kwargs, match", [
    ({"base_lr": 0}, "`base_lr` should be a positive finite number, got 0"),
    ({"base_lr": math.inf}, "`base_lr` should be"),
    ({"base_batch_size": 0}, "`base_batch_size` should be a positive int"),
    ({"global_batch_size": 64.0}, "`global_batch_size` should be"),
    ({"rule": "square"}, "`rule` is 'square'; valid values are"),
    ({"warmup_steps": -1}, "`warmup_steps` should be a non-negative int"),
    ({"decay": "cosine"}, "`decay_steps` should be a positive int, got None"),
    ({"decay_steps": 10}, "`decay_steps` is 10 but `decay` is None"),
    ({"decay": "linear"}, "`decay` should be None, 'cosine' or"),
    ({"decay": keras.optimizers.schedules.CosineDecay(0.1, 10)},
     r"`decay` is 0.1\d* at step 0; .* should start at 1.0"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    kwargs = {"base_lr": 0.1, "base_batch_size": 32,
              "global_batch_size": 128, **kwargs}
    with pytest.raises(ValueError, match=match):
        tfmulti.scaled_learning_rate(kwargs.pop("base_lr"), **kwargs)
