"""tfmulti.keras.callbacks: fault-tolerant fit with chief-only outputs.

The slow test kills a real 2-worker job twice (after epoch 1, then in the
middle of epoch 3) and restarts it; the resumed job must end with the weights
of an uninterrupted single-device run over the same global batches.
"""

import json
import os
import pathlib
import re
import shutil

import keras
import numpy as np
import pytest

import tfmulti
from tests.subproc import run_python, run_workers
from tfmulti.keras import callbacks as callbacks_fn
from tfmulti.keras.backup import BackupAndRestore, worker_temp_dir

TOLERANCE = 1e-5
WORKER = "tests/workers/keras_backup_worker.py"
KILLED = 3  # the worker's exit status when TFMULTI_TEST_EXIT_AT fires
_EVENT_PID = re.compile(r"^events\.out\.tfevents\.\d+\.[^.]+\.(\d+)\.")


def _check_exit(results, exit_at):
    expected = KILLED if exit_at else 0
    for i, (rc, out) in enumerate(results):
        assert rc == expected, f"process {i} exited {rc}:\n{out[-4000:]}"


def _run_workers(tmp_path, name, exit_at):
    results = run_workers(
        [WORKER, str(tmp_path / f"{name}-{{index}}.json"), "multi_worker",
         str(tmp_path / "model"), str(tmp_path / "scratch")], 2,
        timeout=240, env={"TFMULTI_TEST_EXIT_AT": exit_at}, check=False)
    _check_exit(results, exit_at)
    return [json.loads((tmp_path / f"{name}-{i}.json").read_text())
            for i in range(2)]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The uninterrupted run on one device over the same global batches."""
    out = tmp_path_factory.mktemp("golden") / "golden.json"
    run_python([WORKER, str(out), "one_device", "-", "-"], timeout=240)
    return json.loads(out.read_text())


def _assert_resumed_to(golden, final):
    # Backed up every 3 batches: killed after batch index 4 of epoch index
    # 2, the job resumes after 3 batches of it and skips them.
    assert [w["restored"] for w in final] == [[2, 3]] * len(final)
    assert [w["epochs_run"] for w in final] == [[2]] * len(final)
    assert [w["iterations"] for w in final] == [golden["iterations"]] * len(
        final)
    for other in final[1:]:
        for a, b in zip(final[0]["weights"], other["weights"]):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(final[0]["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


@pytest.mark.slow
def test_killed_two_worker_fit_resumes_to_uninterrupted_weights(
        tmp_path, golden):
    model_dir = tmp_path / "model"
    scratch = tmp_path / "scratch"

    first = _run_workers(tmp_path, "first", "0:end")
    assert [w["restored"] for w in first] == [None, None]
    # The non-chief wrote its share into its own scratch directory.
    assert [p.name for p in scratch.iterdir()] == [
        os.path.basename(worker_temp_dir(model_dir, cluster=tfmulti.
                                         ClusterConfig(cluster={"worker": [
                                             "h:1", "h:2"]}, task_index=1),
                                         temp_root=scratch))]

    # Workers that do not see the same backup (model_dir not shared) stop
    # with an error instead of training out of step and deadlocking.
    shutil.copytree(model_dir, tmp_path / "unshared" / "0")
    for rc, out in run_workers(
            [WORKER, str(tmp_path / "unshared-{index}.json"), "multi_worker",
             str(tmp_path / "unshared" / "{index}"),
             str(tmp_path / "unshared-scratch")], 2, timeout=240,
            check=False):
        assert rc != 0 and "do not read the same checkpoint" in out, out[-4000:]
    # The non-chief had written its TensorBoard file there; its exit
    # handler removed its directory after the error.
    assert list((tmp_path / "unshared-scratch").iterdir()) == []

    second = _run_workers(tmp_path, "second", "2:4")
    assert [w["restored"] for w in second] == [[1, 0], [1, 0]]
    assert [w["epochs_run"] for w in second] == [[1, 2], [1, 2]]

    final = _run_workers(tmp_path, "final", "")
    _assert_resumed_to(golden, final)

    chief_pids = {str(r[0]["pid"]) for r in (first, second, final)}
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "logs"]
    assert sorted(os.listdir(model_dir / "checkpoints")) == [
        "model-0001.keras", "model-0002.keras", "model-0003.keras"]
    events = os.listdir(model_dir / "logs" / "train")
    assert {_EVENT_PID.match(e).group(1) for e in events} == chief_pids
    assert list(scratch.iterdir()) == []

    # The multi-worker job's .keras file loads in this single process, with
    # its scaled learning-rate schedule.
    loaded = keras.saving.load_model(model_dir / "checkpoints" /
                                     "model-0003.keras")
    for a, b in zip(loaded.get_weights(), final[0]["weights"]):
        np.testing.assert_array_equal(a, b)
    schedule = loaded.optimizer.get_config()["learning_rate"]
    assert schedule["registered_name"] == "tfmulti>ScaledLearningRate"
    assert schedule["config"]["warmup_steps"] == 10


@pytest.mark.slow
def test_killed_mirrored_fit_resumes_mid_epoch(tmp_path, golden):
    runs = {}
    for name, exit_at in (("first", "0:end"), ("second", "2:4"),
                          ("final", "")):
        out = tmp_path / f"{name}.json"
        results = [run_python(
            [WORKER, str(out), "mirrored", str(tmp_path / "model"),
             str(tmp_path / "scratch")], timeout=240, check=False,
            env={"TFMULTI_TEST_EXIT_AT": exit_at,
                 "TFMULTI_TEST_DEVICES": "2"})]
        _check_exit(results, exit_at)
        runs[name] = json.loads(out.read_text())
    assert runs["final"]["replicas"] == 2
    assert runs["second"]["restored"] == [1, 0]
    _assert_resumed_to(golden, [runs["final"]])
    assert not (tmp_path / "scratch").exists()


def _model(steps_per_execution=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="mse", steps_per_execution=steps_per_execution)
    return model


def _data():
    rng = np.random.default_rng(1)
    return (rng.normal(size=(32, 4)).astype("float32"),
            rng.normal(size=(32, 2)).astype("float32"))


def test_backup_falls_back_over_a_corrupt_or_partial_save(tmp_path):
    x, y = _data()
    backup_dir = tmp_path / "backup"
    model = _model()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, delete_on_end=False)])
    assert sorted(n for n in os.listdir(backup_dir) if n.endswith(
        ".index")) == ["ckpt-4.index", "ckpt-8.index"]
    # Bit rot in the newest backup's data (one flipped bit), a partial save
    # a killed process left (data without index), a junk state file.
    data = backup_dir / "ckpt-8.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    (backup_dir / "ckpt-12.data-00000-of-00001").write_bytes(b"\0" * 64)
    (backup_dir / "checkpoint").write_text("junk {{{")

    resumed = _model()
    backup = BackupAndRestore(backup_dir, delete_on_end=False)
    history = resumed.fit(x, y, batch_size=8, epochs=3, shuffle=False,
                          verbose=0, callbacks=[backup])
    assert backup.restored == (1, 0)
    assert history.epoch == [1, 2]
    # Keras keeps `_initial_epoch` otherwise: a later fit would skip epochs.
    assert resumed.fit(x, y, batch_size=8, epochs=1, verbose=0
                       ).epoch == [0]


class _Killed(Exception):
    pass


class _KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise _Killed()


def test_mid_epoch_resume_skips_whole_executions(tmp_path):
    # With steps_per_execution=2 every call trains 2 batches, so backups
    # fall on even batch counts and the resume skips 2 batches per call.
    x, y = _data()
    fit = {"x": x, "y": y, "batch_size": 4, "epochs": 2, "shuffle": False,
           "verbose": 0}
    golden = _model(steps_per_execution=2)
    golden.fit(**fit)
    with pytest.raises(_Killed):
        _model(steps_per_execution=2).fit(**fit, callbacks=[
            BackupAndRestore(tmp_path, save_freq=2), _KillAt(1, 5)])
    resumed = _model(steps_per_execution=2)
    backup = BackupAndRestore(tmp_path, save_freq=2)
    assert resumed.fit(**fit, callbacks=[backup]).epoch == [1]
    assert backup.restored == (1, 6)
    assert int(resumed.optimizer.iterations) == int(
        golden.optimizer.iterations) == 16
    for a, b in zip(resumed.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


def _paths(callback_list):
    paths = {}
    for c in callback_list:
        if isinstance(c, BackupAndRestore):
            paths["BackupAndRestore"] = c.backup_dir
        elif isinstance(c, keras.callbacks.ModelCheckpoint):
            paths["ModelCheckpoint"] = c.filepath
        elif isinstance(c, keras.callbacks.TensorBoard):
            paths["TensorBoard"] = c.log_dir
        else:
            paths[type(c).__name__] = c.path
    return paths


def test_only_the_chief_writes_to_model_dir(tmp_path):
    model_dir, scratch = tmp_path / "model", tmp_path / "scratch"
    workers = ["127.0.0.1:1", "127.0.0.1:2"]
    chief = _paths(callbacks_fn(model_dir, temp_root=scratch,
                                cluster=tfmulti.ClusterConfig(
                                    cluster={"worker": workers})))
    assert chief == {
        "BackupAndRestore": str(model_dir / "backup"),
        "ModelCheckpoint": str(model_dir / "checkpoints" /
                               "model-{epoch:04d}.keras"),
        "TensorBoard": str(model_dir / "logs")}
    other = tfmulti.ClusterConfig(cluster={"worker": workers}, task_index=1)
    temp = pathlib.Path(worker_temp_dir(model_dir, cluster=other,
                                        temp_root=scratch))
    assert temp.parent == scratch and temp.name.endswith("-worker1")
    temp.mkdir(parents=True)
    (temp / "left-by-a-killed-run").write_text("")
    assert _paths(callbacks_fn(model_dir, temp_root=scratch,
                               cluster=other)) == {
        # Every worker reads the chief's backups; the checkpoint layer
        # sends a non-chief's writes to its own temporary directory.
        "BackupAndRestore": str(model_dir / "backup"),
        "ModelCheckpoint": str(temp / "checkpoints" /
                               "model-{epoch:04d}.keras"),
        "TensorBoard": str(temp / "logs"),
        "_RemoveDirectory": str(temp)}
    assert not temp.exists()
    assert [type(c).__name__ for c in callbacks_fn(
        model_dir, backup=False, tensorboard=False)] == ["ModelCheckpoint"]


@pytest.mark.parametrize("kwargs, match", [
    ({"model_dir": ""}, "`model_dir`"),
    ({"backup_freq": 0}, "`backup_freq` is 0"),
    ({"backup_freq": "batch"}, "`backup_freq` is 'batch'"),
    ({"checkpoint_name": "a/b.keras"}, "`checkpoint_name` is 'a/b.keras'"),
    ({"checkpoint_options": {"filepath": "x.keras"}},
     r"`checkpoint_options` sets \['filepath'\]"),
    ({"tensorboard_options": ["log_dir"]}, "`tensorboard_options` should"),
])
def test_bad_arguments_name_the_argument(tmp_path, kwargs, match):
    kwargs = {"model_dir": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=match):
        callbacks_fn(kwargs.pop("model_dir"), **kwargs)
