"""Training a finished run longer: the API (`Trainer.fit(steps=...)` after a
restore, Keras `fit` with `BackupAndRestore`) and the run directory rules
that let a recipe's `--resume` take a larger `--steps` or `--epochs`.

The recipes end to end (output captured from real runs) are in
test_recipe_output.py.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti import rundir  # noqa: E402
from tfmulti.keras.backup import BackupAndRestore  # noqa: E402

TOLERANCE = 1e-6
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)
X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def _trainer(strategy, model_dir=None):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return tfmulti.Trainer(model, optimizer, loss=LOSS, strategy=strategy,
                           steps_per_loop=2, model_dir=model_dir)


def _data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(
        8, drop_remainder=True)


def test_trainer_fit_after_a_restore_trains_to_the_new_global_step(
        tmp_path):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    golden = _trainer(strategy)
    golden.fit(_data(), steps=6, verbose=0)
    _trainer(strategy, tmp_path).fit(_data(), steps=4, verbose=0)
    longer = _trainer(strategy, tmp_path)
    history = longer.fit(_data(), steps=6, verbose=0)
    # Restored at 4, two more updates, on the batches an uninterrupted run
    # reads there.
    assert history["step"] == [6]
    assert int(longer.optimizer.iterations) == 6
    for a, b in zip(longer.model.get_weights(), golden.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="mse")
    return model


def test_fit_with_backup_continues_into_longer_epochs(tmp_path):
    """A backup counts in its own epochs: `fit` with 2 steps per epoch, then
    with 4 (a run given more --steps) resumes 2 batches into the first
    epoch and ends with the weights of one uninterrupted 4-step epoch."""
    x, y = X, X[:, :2] * 2.0
    fit = {"x": x, "y": y, "batch_size": 8, "shuffle": False, "verbose": 0}
    golden = _model()
    golden.fit(**fit, epochs=1, steps_per_epoch=4)
    _model().fit(**fit, epochs=1, steps_per_epoch=2, callbacks=[
        BackupAndRestore(tmp_path, delete_on_end=False)])
    longer = _model()
    backup = BackupAndRestore(tmp_path, delete_on_end=False)
    longer.fit(**fit, epochs=1, steps_per_epoch=4, callbacks=[backup])
    assert backup.restored == (0, 2)
    assert int(longer.optimizer.iterations) == 4
    for a, b in zip(longer.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) >= self.steps:
            self.model.stop_training = True


def test_fit_stopped_inside_an_epoch_resumes_there(tmp_path):
    """`stop_training` set after batch 3 of a 4-batch epoch: the backup
    says epoch 0 batch 3 (not "epoch 0 done"), so a longer fit trains the
    last batch of that epoch and the next, as an uninterrupted fit."""
    x, y = X, X[:, :2] * 2.0
    fit = {"x": x, "y": y, "batch_size": 8, "shuffle": False, "verbose": 0,
           "steps_per_epoch": 4}
    golden = _model()
    golden.fit(**fit, epochs=2)
    _model().fit(**fit, epochs=1, callbacks=[
        BackupAndRestore(tmp_path, delete_on_end=False), _StopAfter(3)])
    longer = _model()
    backup = BackupAndRestore(tmp_path, delete_on_end=False)
    longer.fit(**fit, epochs=2, callbacks=[backup])
    assert backup.restored == (0, 3)
    assert int(longer.optimizer.iterations) == 8
    for a, b in zip(longer.get_weights(), golden.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


def _write_run(path, *, steps, finished):
    os.makedirs(path)
    config = {"loop": "fit", "seed": 0, "steps": steps, "epochs": 3}
    (path / rundir.CONFIG_FILE).write_text(json.dumps({
        "config": config, "started": "20260101-000000",
        "ends": [{"steps": steps, "epochs": 3, "total_steps": steps,
                  "set": "20260101-000000"}]}))
    if finished:
        (path / rundir.METRICS_FILE).write_text(json.dumps(
            {"steps": steps, "config": config}))
    return config


def test_resume_may_move_the_end_and_records_each_end(tmp_path):
    config = _write_run(tmp_path / "run", steps=4, finished=True)
    keys = ("loop", "seed", "steps", "epochs")

    def opened(**changes):
        return rundir.open_run_dir(str(tmp_path / "run"),
                                   config={**config, **changes}, resume=True,
                                   compared=keys)

    # The same end: nothing to train, saying how to train longer.
    with pytest.raises(rundir.NothingToTrain,
                       match="finished at step 4.*larger --steps"):
        opened()
    # Another end: continued (the step check against it is the
    # experiment's, which knows the steps of an epoch).
    run = opened(steps=8)
    assert run.resuming and run.finished_steps == 4
    ends = run.ends({**config, "steps": 8}, 8, "20260102-000000")
    assert [(e["steps"], e["total_steps"], e["set"]) for e in ends] == [
        (4, 4, "20260101-000000"), (8, 8, "20260102-000000")]
    # --epochs moves the end as well (the steps it means are counted by the
    # experiment, from the dataset's size).
    run = opened(epochs=5)
    assert run.resuming and run.finished_steps == 4
    assert [e["epochs"] for e in run.ends({**config, "epochs": 5}, 780,
                                          "20260103-000000")] == [3, 5]
    # What is trained still may not change.
    with pytest.raises(rundir.RunDirError, match="`seed`: saved 0, now 1"):
        opened(steps=8, seed=1)
    # Without --resume the refusal says how to train longer.
    with pytest.raises(rundir.RunDirError,
                       match="finished run .*4 steps.*larger --steps"):
        rundir.open_run_dir(str(tmp_path / "run"), config=config,
                            resume=False, compared=keys)
