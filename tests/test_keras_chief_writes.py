"""Keras's own writers under tfmulti's multi-worker strategy: a script
written for one machine, run unchanged by two real workers with the same
paths, killed (SIGKILL) and restarted by tfmulti-launch, leaves one
complete, loadable file of each, one event file per split and run, no
temporary files, and the weights of an uninterrupted one-device run."""

import csv
import glob
import inspect
import json
import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.workers import keras_chief_writes as script
from tfmulti import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5
# Worker 0 (the chief) kills itself after batch 2 of epoch 2 (0-based),
# after two epoch-end backups.
KILL = "0:2:2"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One launcher run of two workers, killed once and restarted."""
    tmp = tmp_path_factory.mktemp("chief_writes")
    out, temp_root = tmp / "out", tmp / "tmp"
    out.mkdir()
    temp_root.mkdir()
    env = dict(os.environ, TMPDIR=str(temp_root), TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers", "2",
         # About 40 CPU-s; 131 s wall was measured at load average 14 on
         # 2 cores: bounds with room for that.
         "--max_restarts", "1", "--timeout", "420", "--", sys.executable,
         os.path.join(ROOT, "tests", "workers", "keras_chief_writes.py"),
         str(out), KILL], capture_output=True, text=True, cwd=tmp, env=env,
        timeout=480)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-4000:]
    assert "worker 0 was killed by SIGKILL; restarting all 2" in (
        result.stderr), result.stderr[-2000:]
    return out, temp_root


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The same script on one device, uninterrupted: weights, history, and
    the weights its own ModelCheckpoint(save_best_only=True) kept."""
    tmp = tmp_path_factory.mktemp("chief_writes_golden")
    x, y = script.data()
    train, val = script.datasets(x, y)
    model = script.build()
    initial = [w.numpy().copy() for w in model.weights]
    history = model.fit(train, epochs=script.EPOCHS, validation_data=val,
                        verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(
                            str(tmp / "best.keras"), save_best_only=True)])
    best = keras.models.load_model(tmp / "best.keras")
    moved = max(float(np.max(np.abs(w.numpy() - w0)))
                for w, w0 in zip(model.weights, initial))
    assert moved > 100 * TOLERANCE, moved
    return {"weights": [w.numpy() for w in model.weights],
            "history": history.history,
            "best": [w.numpy() for w in best.weights], "x": x}


def _result(out, index):
    with open(out / f"result-{index}-1.json") as f:
        return json.load(f)


def _close(a, b, tol=TOLERANCE):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.array(u), np.array(v), atol=tol)


@pytest.mark.slow
def test_both_workers_resume_to_the_uninterrupted_weights(job, golden):
    out, _ = job
    for index in (0, 1):
        run = _result(out, index)
        assert run["iterations"] == 8 * script.EPOCHS
        _close(run["weights"], golden["weights"])
        # The restarted fit reports the epochs it ran: 2 and 3.
        for name, values in run["history"].items():
            np.testing.assert_allclose(values, golden["history"][name][2:],
                                       atol=TOLERANCE, err_msg=name)


@pytest.mark.slow
def test_saved_files_are_whole_and_load(job, golden):
    out, _ = job
    final = _result(out, 0)["weights"]
    for name in ("model.keras", "best.keras"):
        with zipfile.ZipFile(out / name) as archive:
            assert archive.testzip() is None, name
    model = keras.models.load_model(out / "model.keras")
    _close([w.numpy() for w in model.weights], final, tol=0)
    best = keras.models.load_model(out / "best.keras")
    _close([w.numpy() for w in best.weights], golden["best"])
    fresh = script.build()
    fresh.load_weights(out / "model.weights.h5")
    _close([w.numpy() for w in fresh.weights], final, tol=0)
    exported = tf.saved_model.load(str(out / "export"))
    x = golden["x"][:16]
    np.testing.assert_allclose(exported.serve(tf.constant(x)).numpy(),
                               model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.slow
def test_one_event_file_per_split_and_run_all_from_the_chief(job):
    out, _ = job
    chief_pids = {(out / f"pid-0-{a}").read_text() for a in (0, 1)}
    assert len(chief_pids) == 2
    epochs = {}
    for split in ("train", "validation"):
        files = sorted(glob.glob(str(out / "logs" / split / "events.*")))
        # events.out.tfevents.<time>.<host>.<pid>.<n>.v2
        assert sorted(f.split(".")[-3] for f in files) == sorted(
            chief_pids), files
        steps = []
        for path in files:
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                steps += [event.step for v in event.summary.value
                          if v.tag == "epoch_loss"]
        epochs[split] = sorted(steps)
    # The killed run logged epochs 0 and 1, the restarted one 2 and 3: each
    # epoch once.
    assert epochs == {"train": [0, 1, 2, 3], "validation": [0, 1, 2, 3]}


@pytest.mark.slow
def test_csv_has_each_epoch_once(job, golden):
    out, _ = job
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    np.testing.assert_allclose([float(r["loss"]) for r in rows],
                               golden["history"]["loss"], atol=TOLERANCE)


@pytest.mark.slow
def test_no_backup_partial_or_temporary_file_is_left(job):
    out, temp_root = job
    # workertemp_1: the tutorial's own, emptied by its own rmtree of the
    # checkpoint directory inside it (as on Keras 2).
    assert sorted(os.listdir(out)) == sorted(
        ["best.keras", "export", "log.csv", "logs", "model.keras",
         "model.weights.h5", "pid-0-0", "pid-0-1", "pid-1-0", "pid-1-1",
         "result-0-1.json", "result-1-1.json", "keras-model.keras", "ckpt",
         "workertemp_1", "dist-1.keras", "dist-2.keras", "dist.csv"])
    assert os.listdir(out / "workertemp_1") == []
    assert os.listdir(temp_root) == []


@pytest.mark.slow
def test_tutorial_save_then_load_on_every_worker(job):
    # TF's "Multi-worker training with Keras": every worker saves (the
    # non-chief to its own workertemp_1, which it deletes) and at once
    # loads the chief's file: each reads it whole, with the saved weights.
    out, _ = job
    for index in (0, 1):
        assert _result(out, index)["tutorial"] == {"loaded_difference": 0.0}
    with zipfile.ZipFile(out / "keras-model.keras") as archive:
        assert archive.testzip() is None
    assert sorted(os.listdir(out / "ckpt")) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]


@pytest.mark.slow
def test_distributed_fit_writes_once_too(job):
    out, _ = job
    final = _result(out, 0)["distributed"]
    _close(_result(out, 1)["distributed"], final, tol=0)
    for epoch in (1, 2):
        with zipfile.ZipFile(out / f"dist-{epoch}.keras") as archive:
            assert archive.testzip() is None
    model = keras.models.load_model(out / "dist-2.keras")
    _close([w.numpy() for w in model.weights], final, tol=0)
    with open(out / "dist.csv") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0", "1"]


@pytest.mark.slow
def test_callback_that_keeps_its_own_paths_stops_fit_on_every_worker(job):
    out, _ = job
    for index in (0, 1):
        text = _result(out, index)["refused"]
        assert text.startswith(
            "OwnTensorBoard cannot be made to write from the chief only on "
            "several workers: after `set_model` its ['_log_write_dir', "
            "'_train_dir', '_val_dir'] are not the paths tfmulti sends")
        assert "Use tfmulti.keras.callbacks(model_dir)" in text
    # It stopped before writing anything.
    assert not (out / "own_logs").exists()


# -- guards of compat.wrap_keras_writes -----------------------------------

def test_keras_callbacks_still_have_no_chief_logic():
    # tf.keras (Keras 2) asked the strategy who the chief is; once Keras 3
    # does again, delete tfmulti.chief_writes.
    from keras.src.callbacks import (backup_and_restore, csv_logger,
                                     model_checkpoint, tensorboard)
    for module in (backup_and_restore, csv_logger, model_checkpoint,
                   tensorboard):
        source = inspect.getsource(module)
        for word in ("is_chief", "task_type", "distributed_file_utils",
                     "worker_temp"):
            assert word not in source, (module.__name__, word)


def test_callback_write_paths_still_exist(tmp_path):
    model = script.build()
    for cls, names in compat.callback_write_paths().items():
        callback = cls(str(tmp_path / cls.__name__))
        callback.set_model(model)
        for name in names:
            assert isinstance(getattr(callback, name), str), (cls, name)
    for name in compat.MODEL_WRITE_METHODS:
        assert callable(getattr(keras.Model, name))


def test_coordination_key_value_still_private():
    # compat.publish_key / wait_for_key: once TF makes them public, use that.
    from tensorflow.python.eager import context
    for name in ("set_config_key_value", "get_config_key_value"):
        assert callable(getattr(context.Context, name))
        assert not hasattr(tf.distribute.experimental, name)
