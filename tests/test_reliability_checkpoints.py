"""Checkpoints survive faults: non-finite losses stop training with the step
and never reach a checkpoint, SIGTERM saves and resumes to the same weights,
a save killed midway leaves the previous checkpoint, and unusable model_dirs
or mismatched checkpoints fail with clear errors. One device, in process,
except the killed save (a subprocess)."""

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import exit_codes  # noqa: E402
from tfmulti.training import Checkpointer  # noqa: E402
from tfmulti.training.numerics import NonFiniteLossError  # noqa: E402
from tests.subproc import _kill, _start  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)
STRATEGY = tf.distribute.OneDeviceStrategy("/cpu:0")


def make_trainer(model_dir, units=3, steps_per_loop=2):
    with STRATEGY.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=STRATEGY,
                           steps_per_loop=steps_per_loop,
                           model_dir=str(model_dir))


def data(nan_batch=None):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (np.arange(64) % 3).astype("int32")
    if nan_batch is not None:
        x[nan_batch * 8] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        8, drop_remainder=True).repeat()


def test_nonfinite_loss_stops_at_its_step_and_is_never_saved(tmp_path):
    trainer = make_trainer(tmp_path)
    # Batch index 2 is step 3, in the loop of steps 3-4.
    with pytest.raises(NonFiniteLossError) as e:
        trainer.fit(data(nan_batch=2), steps=6, checkpoint_every=1,
                    verbose=0)
    assert e.value.step == 3
    assert "loss is nan at step 3" in str(e.value)
    assert "model_dir still holds the last finite one" in str(e.value)
    latest = tf.train.latest_checkpoint(str(tmp_path))
    assert latest.endswith("ckpt-2")
    resumed = make_trainer(tmp_path)
    resumed.fit(data(), steps=2, verbose=0)   # restores, trains nothing
    assert resumed.step == 2
    assert all(np.all(np.isfinite(v.numpy())) for v in resumed.model.weights)


def test_checkpointer_refuses_nan_weights(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.model.weights[0].assign(
        tf.fill(trainer.model.weights[0].shape, np.nan))
    checkpointer = Checkpointer(str(tmp_path), STRATEGY, model=trainer.model)
    with pytest.raises(ValueError, match=r"Refusing to save checkpoint 5 .*"
                       r"1 variable\(s\) hold NaN or inf"):
        checkpointer.save(5)
    assert tf.train.latest_checkpoint(str(tmp_path)) is None


class _SigtermAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self._step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self._step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_exits_and_resumes_to_the_same_weights(tmp_path):
    reference = make_trainer(tmp_path / "reference")
    reference.fit(data(), steps=8, verbose=0)
    trainer = make_trainer(tmp_path / "run", steps_per_loop=1)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        trainer.fit(data(), steps=8, callbacks=[_SigtermAt(3)], verbose=0)
    assert e.value.code == exit_codes.PREEMPTED
    assert signal.getsignal(signal.SIGTERM) is before   # handler removed
    assert tf.train.latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-3")
    resumed = make_trainer(tmp_path / "run")
    resumed.fit(data(), steps=8, verbose=0)
    assert resumed.step == 8
    for a, b in zip(resumed.model.weights, reference.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_checkpoint_of_another_model_names_model_dir(tmp_path):
    make_trainer(tmp_path).fit(data(), steps=2, verbose=0)
    other = make_trainer(tmp_path, units=5)
    with pytest.raises(ValueError) as e:
        other.fit(data(), steps=4, verbose=0)
    message = str(e.value)
    assert f"`model_dir` {str(tmp_path)!r} holds the checkpoint" in message
    assert "does not match this model" in message
    assert "Use a new `model_dir`" in message


def test_unwritable_model_dir_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    trainer = make_trainer(blocker / "run")
    with pytest.raises(ValueError) as e:
        trainer.fit(data(), steps=2, verbose=0)
    assert f"`model_dir` {str(blocker / 'run')!r} is not a writable" in str(
        e.value)
    assert "Pass a directory this process" in str(e.value)


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    proc = _start([sys.executable, "tests/workers/reliability_save.py",
                   str(tmp_path)], dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline and proc.poll() is None:
            seen = [n for n in os.listdir(tmp_path) if n.startswith("ckpt-2")]
            if seen:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        _kill(proc)
    output = proc.stdout.read()
    assert seen, f"the second save was never caught in progress:\n{output}"
    assert "SAVED 2" not in output
    # The killed save left files behind, yet the latest is checkpoint 1.
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1")
    variable = tf.Variable(tf.zeros([1 << 25]))
    restored = Checkpointer(str(tmp_path), STRATEGY,
                            value=variable).restore_latest()
    assert restored.endswith("ckpt-1")
    assert float(variable[0]) == 1.0 and float(variable[-1]) == 1.0


def test_skip_option_skips_exactly_the_nonfinite_update(tmp_path):
    x = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    y = (np.arange(48) % 3).astype("int32")
    bad = x.copy()
    bad[16] = np.nan                      # batch 2 -> step 3
    with STRATEGY.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    trainer = tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=STRATEGY,
                              steps_per_loop=6, on_nonfinite="skip",
                              model_dir=str(tmp_path))
    history = trainer.fit(tf.data.Dataset.from_tensor_slices((bad, y)).batch(
        8, drop_remainder=True), steps=6, verbose=0)
    assert np.isnan(history["step_loss"][2])
    assert np.all(np.isfinite(np.delete(history["step_loss"], 2)))
    # The same updates without batch 2 at all: one device, plain optimizer.
    reference = make_trainer(tmp_path / "reference", steps_per_loop=5)
    keep = np.r_[0:16, 24:48]
    reference.fit(tf.data.Dataset.from_tensor_slices((x[keep], y[keep])).batch(
        8, drop_remainder=True), steps=5, verbose=0)
    for a, b in zip(model.weights, reference.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="`on_nonfinite` is 'ignore'"):
        tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=STRATEGY,
                        on_nonfinite="ignore")
