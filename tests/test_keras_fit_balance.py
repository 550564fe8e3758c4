"""Balanced Keras `fit`: `tfmulti.keras.distributed(model, balance=...)`
against the even split and one device (issue 32).

One subprocess with 4 simulated CPU devices trains each case (Adam, Keras's
global_clipnorm acting on the reduced gradient, 4-step accumulation, mixed
float16) for 20 steps (2 epochs of 10, 5 per call, validation each epoch):
plain Keras `fit` on one device, and `distributed` on 2 replicas with
balance None, [3, 1] and "auto", and on 4 with [3, 1, 1, 1]. Two worker
processes (one replica each) train the float32 cases with balance None,
[3, 1] and "auto", then each plain Keras on its own CPU. A balanced `fit`
stopped mid-epoch resumes from its backup to the uninterrupted weights.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python, worker_json

# Float32 sums in another order: measured at most 2.4e-7 (losses) and
# 6e-8 (weights) between any two layouts over 20 steps.
TOLERANCE = 1e-5
# Mixed float16: each replica's gradient is rounded to float16 from its own
# rows, so another split rounds differently; the even split is 9.3e-5 from
# one device itself. Measured (weights / losses): [3, 1] 1.3e-4 / 1.8e-5
# from the even split and 1.2e-4 / 2.6e-5 from one device; auto and
# [3, 1, 1, 1] at most 7.8e-5 / 1.3e-5 and 1.1e-4 / 2.1e-5.
FLOAT16_TO_EVEN = 5e-4
FLOAT16_TO_ONE_DEVICE = 1e-3
CASES = ("adam", "clip", "accum", "mixed_float16")


def assert_same(run, golden, tolerance):
    for key in ("loss", "accuracy", "val_loss"):
        np.testing.assert_allclose(run[key], golden[key], atol=tolerance,
                                   err_msg=key)
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=tolerance)
    for key, value in golden["eval"].items():
        assert run["eval"][key] == pytest.approx(value, abs=tolerance), key
    assert run["iterations"] == golden["iterations"] == 20


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_balance") / "local.json"
    run_python(["tests/workers/keras_fit_balance.py", "local", str(out)],
               timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mirrored2:None", "mirrored2:[3, 1]",
                                    "mirrored2:auto",
                                    "mirrored4:[3, 1, 1, 1]"])
def test_balanced_fit_equals_even_split_and_one_device(local, layout):
    for case in CASES:
        run = local[layout][case]
        assert run["replicas_equal"]
        # A share change is a variable assignment: one trace.
        assert run["traces"] == 1
        float16 = case == "mixed_float16"
        assert_same(run, local["one_device:None"][case],
                    FLOAT16_TO_ONE_DEVICE if float16 else TOLERANCE)
        assert_same(run, local["mirrored2:None"][case],
                    FLOAT16_TO_EVEN if float16 else TOLERANCE)


@pytest.mark.slow
def test_restarted_balanced_fit_resumes_to_the_uninterrupted_weights(local):
    # Stopped at epoch 1 batch 5 (16 batches per pass of the data, 10 steps
    # per epoch): the restarted stream skips to batch 15, where the
    # uninterrupted run was.
    run = local["resumed"]
    assert run["restored"] == [1, 5]
    assert run["iterations"] == 20
    for a, b in zip(run["weights"], local["mirrored2:auto"]["adam"]["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


@pytest.mark.slow
def test_balanced_fit_on_a_finite_dataset_equals_one_device(local):
    run, golden = local["finite"]["mirrored2"], local["finite"]["one_device"]
    assert run["replicas_equal"] and run["traces"] == 1
    for key in ("loss", "accuracy", "val_loss"):
        np.testing.assert_allclose(run[key], golden[key], atol=TOLERANCE)
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)
    assert run["iterations"] == golden["iterations"] == 32


@pytest.mark.slow
def test_balanced_fit_reports_shares_per_call(local):
    fixed = local["mirrored4:[3, 1, 1, 1]"]["adam"]["calls"]
    assert len(fixed) == 4
    for call in fixed:
        assert [call[f"share_{r}"] for r in range(4)] == [
            0.5, 6 / 32, 5 / 32, 5 / 32]
        assert all(call[f"replica_seconds_{r}"] > 0 for r in range(4))
        assert 0 <= call["idle_fraction"] < 1
    # The even split reports nothing of balance.
    assert local["mirrored2:None"]["adam"]["calls"] == [{}] * 4


@pytest.mark.slow
def test_two_workers_balanced_fit_equals_even_split_and_one_device(tmp_path):
    workers = worker_json(["tests/workers/keras_fit_balance.py",
                           "multi_worker"], 2, tmp_path, timeout=540)
    for worker in workers:
        for layout in ("multi_worker:None", "multi_worker:[3, 1]",
                       "multi_worker:auto"):
            for case, run in worker[layout].items():
                assert run["traces"] == 1
                assert_same(run, worker["one_device:None"][case], TOLERANCE)
                assert_same(run, worker["multi_worker:None"][case],
                            TOLERANCE)
    for layout in ("multi_worker:[3, 1]", "multi_worker:auto"):
        # Both workers hold the same weights and saw the same shares.
        for case in workers[0][layout]:
            assert workers[0][layout][case]["weights"] == (
                workers[1][layout][case]["weights"])
        assert _shares(workers[0], layout) == _shares(workers[1], layout)
    assert _shares(workers[0], "multi_worker:[3, 1]") == [[0.75, 0.25]] * 4


def _shares(worker, layout):
    return [[call[f"share_{r}"] for r in range(2)]
            for call in worker[layout]["adam"]["calls"]]


def test_balance_errors_name_the_argument():
    import keras
    import tensorflow as tf

    import tfmulti
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="`balance` should be None, 'auto'"):
        tfmulti.keras.distributed(model, balance="fast")
    with pytest.raises(ValueError, match="jit_compile"):
        tfmulti.keras.distributed(model, balance="auto", jit_compile=True)
    model = tfmulti.keras.distributed(model, balance="auto")
    rows = tf.data.Dataset.from_tensor_slices((tf.zeros([8, 2]),
                                               tf.zeros([8, 1])))
    with pytest.raises(ValueError, match="cardinality 2 and "
                       "steps_per_epoch=3. Drop steps_per_epoch"):
        model.fit(rows.batch(4, drop_remainder=True), steps_per_epoch=3,
                  verbose=0)
    with pytest.raises(ValueError, match="cardinality -2 .*assert_cardinality"):
        model.fit(rows.filter(lambda x, y: True).batch(4, drop_remainder=True),
                  verbose=0)
    with pytest.raises(ValueError, match="`steps_per_epoch` is None but `x` is an endless"):
        model.fit(rows.batch(4, drop_remainder=True).repeat(), verbose=0)
    with pytest.raises(ValueError, match="GLOBAL batches; got ndarray"):
        model.fit(np.zeros([8, 2]), np.zeros([8, 1]), verbose=0)
    history = model.fit(rows.batch(4, drop_remainder=True).repeat(),
                        steps_per_epoch=3, verbose=0)
    assert history.history["share_0"] == [1.0]


def test_balanced_fit_continues_its_stream_across_fit_calls():
    """As without balance (fit_input.py): the same endless `x` again
    continues the kept iterator, so fit twice = fit with epochs=2."""
    import keras
    import tensorflow as tf

    import tfmulti
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    rows = tf.data.Dataset.from_tensor_slices((
        tf.reshape(tf.range(64, dtype=tf.float32), [32, 2]),
        tf.reshape(tf.range(32, dtype=tf.float32), [32, 1]))).batch(
            4, drop_remainder=True).repeat()

    def model():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            m.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse",
                      steps_per_execution=2)
        return tfmulti.keras.distributed(m, balance="auto")

    twice, once = model(), model()
    for _ in range(2):
        twice.fit(rows, steps_per_epoch=3, verbose=0)
    once.fit(rows, epochs=2, steps_per_epoch=3, verbose=0)
    for a, b in zip(twice.get_weights(), once.get_weights()):
        np.testing.assert_array_equal(a, b)
    # 3 steps at 2 per call: calls of 2 and 1 per epoch, all recorded.
    history = tfmulti.keras.fit_state.balance_of(twice).history
    assert [h["step"] for h in history] == [2, 3, 5, 6]


def test_balanced_fit_on_a_finite_dataset_trains_one_pass_per_epoch():
    """A finite `x` (no `steps_per_epoch`) trains like plain Keras: each
    epoch one pass, the same batches, one trace for all epochs."""
    import keras
    import tensorflow as tf

    import tfmulti
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    rows = tf.data.Dataset.from_tensor_slices((
        tf.reshape(tf.range(64, dtype=tf.float32), [32, 2]) / 64,
        tf.reshape(tf.range(32, dtype=tf.float32), [32, 1]) / 32)).batch(
            4, drop_remainder=True)

    def model():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      steps_per_execution=3)
        return m

    plain, balanced = model(), tfmulti.keras.distributed(model(),
                                                         balance="auto")
    expected = plain.fit(rows, epochs=3, verbose=0).history["loss"]
    losses = balanced.fit(rows, epochs=3, verbose=0).history["loss"]
    np.testing.assert_allclose(losses, expected, atol=1e-6)
    assert int(balanced.optimizer.iterations) == 24
    for a, b in zip(balanced.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # 8 steps at 3 per call: calls of 3, 3 and 2 in each epoch.
    history = tfmulti.keras.fit_state.balance_of(balanced).history
    assert [h["step"] for h in history] == [3, 6, 8, 11, 14, 16, 19, 22, 24]
