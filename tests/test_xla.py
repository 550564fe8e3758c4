"""XLA-compiled replica steps (`jit_compile=True`) equal uncompiled ones.

One process with 4 simulated CPU devices runs the Trainer and Keras `fit`
through `tfmulti.keras.distributed`, compiled and not, on one device and on
4 mirrored replicas (tests/workers/xla_golden.py); an op XLA cannot compile
is refused with an error naming its layer.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.subproc import run_python
import tfmulti

TOLERANCE = 1e-4
WORKER = "tests/workers/xla_golden.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla") / "xla.json"
    run_python([WORKER, str(out)], timeout=600)
    results = json.loads(out.read_text())
    for case in ("trainer_one_device", "keras_one_device"):
        # Training moved the weights (by far more than the tolerance): equal
        # weights are not equal by accident.
        assert results[case]["moved"] > 100 * TOLERANCE, case
    return results


def _assert_matches(run, golden):
    assert run["iterations"] == golden["iterations"]
    np.testing.assert_allclose(run["loss"], golden["loss"], atol=TOLERANCE)
    assert len(run["weights"]) == len(golden["weights"])
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("case, golden", [
    ("trainer_one_device_xla", "trainer_one_device"),
    ("trainer_mirrored4_xla", "trainer_one_device"),
    # K=2 micro-batches of 8 per update = one device's batch of 16.
    ("trainer_mirrored4_xla_accum", "trainer_one_device"),
    # PowerSGD at full rank after 3 dense updates, under XLA: synchronous.
    ("trainer_mirrored4_xla_powersgd_full_start3", "trainer_one_device"),
    # Two fit calls of one epoch = plain Keras, one call of two epochs.
    ("fit_mirrored4_xla_two_calls", "keras_one_device"),
])
def test_xla_matches_uncompiled_golden_run(runs, case, golden):
    _assert_matches(runs[case], runs[golden])


@pytest.mark.slow
def test_second_fit_call_reuses_the_iterator_on_4_replicas(runs):
    # One kept iterator (the symbolic build reads the data's spec: no
    # probe); none after (the numbers are compared with plain Keras above).
    assert runs["fit_mirrored4_xla_two_calls"]["iterators_made"] == [1, 1]


class _NumpyIdentity(keras.layers.Layer):
    def call(self, x):
        y = tf.numpy_function(lambda a: a, [x], x.dtype)
        return tf.ensure_shape(y, x.shape)


def test_uncompilable_op_is_refused_naming_its_layer():
    strategy = tfmulti.create_strategy("one_device")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  _NumpyIdentity(name="host_callback"),
                                  keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy, steps_per_loop=1,
        jit_compile=True, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None))
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 4), "float32"), np.zeros((8,), "int32"))).batch(
            4, drop_remainder=True).repeat()
    with pytest.raises(tfmulti.training.XlaCompileError, match=(
            r"layer 'host_callback' \(_NumpyIdentity\) uses op PyFunc")) as e:
        trainer.fit(data, steps=1, verbose=0)
    assert (e.value.layer, e.value.op) == ("host_callback", "PyFunc")


def test_jit_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="`jit_compile` should be True or "
                                         "False, got 'yes'"):
        tfmulti.training.xla.check_jit_compile("yes")
