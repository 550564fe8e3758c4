"""The one checkpoint layer, in process on one device: a job resumes under
the other entry point (Keras fit <-> Trainer) to the weights of an
uninterrupted run; real faults in real files (a flipped bit in the newest
checkpoint, a junk `checkpoint` state file, a `model_dir` with `[` `]`, a
second job on the same `model_dir`) resume from the newest intact
checkpoint or fail clearly; the controller's schedules alone."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402
from tfmulti.keras import BackupAndRestore  # noqa: E402
from tfmulti.training import Checkpointer, Position, controller  # noqa: E402
from tfmulti.training import checkpoints, model_dir_lock  # noqa: E402

STRATEGY = tf.distribute.OneDeviceStrategy("/cpu:0")
TOLERANCE = 1e-6
rng = np.random.default_rng(0)
X = rng.normal(size=(32, 4)).astype("float32")
Y = (np.arange(32) % 3).astype("int32")     # 4 batches of 8 per epoch


def _data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(
        8, drop_remainder=True)


def _model():
    with STRATEGY.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.2, 3, 0.5),
            momentum=0.9)
    return model, optimizer


def _trainer(model_dir, steps_per_loop=2):
    model, optimizer = _model()
    return tfmulti.Trainer(
        model, optimizer, strategy=STRATEGY, steps_per_loop=steps_per_loop,
        model_dir=str(model_dir), loss=keras.losses.
        SparseCategoricalCrossentropy(from_logits=True, reduction=None))


def _keras(model_dir, epochs):
    model, optimizer = _model()
    with STRATEGY.scope():
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    tfmulti.keras.distributed(model)
    backup = BackupAndRestore(model_dir, delete_on_end=False)
    model.fit(_data(), epochs=epochs, verbose=0, callbacks=[backup])
    return model, backup


def _assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                   atol=TOLERANCE)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("golden"))
    trainer.fit(_data().repeat(), steps=12, verbose=0)
    return trainer.model.get_weights(), [
        v.numpy() for v in trainer.optimizer.variables]


def test_fit_then_trainer_equals_uninterrupted(tmp_path, golden):
    _keras(tmp_path, epochs=2)                 # stopped after 8 of 12 steps
    trainer = _trainer(tmp_path)
    trainer.fit(_data().repeat(), steps=12, verbose=0)
    assert trainer.step == int(trainer.optimizer.iterations) == 12
    _assert_same(trainer.model.get_weights(), golden[0])
    _assert_same([v.numpy() for v in trainer.optimizer.variables], golden[1])


def test_trainer_then_fit_equals_uninterrupted(tmp_path, golden):
    _trainer(tmp_path).fit(_data().repeat(), steps=6, verbose=0)
    model, backup = _keras(tmp_path, epochs=3)   # step 6 = epoch 1 batch 2
    assert backup.restored == (1, 2)
    assert int(model.optimizer.iterations) == 12
    _assert_same(model.get_weights(), golden[0])


def _flip_a_bit(prefix):
    data = f"{prefix}.data-00000-of-00001"
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(data, "wb").write(bytes(raw))


def test_faulty_newest_checkpoint_falls_back_in_a_bracketed_dir(tmp_path):
    # A sweep directory: TensorFlow's latest_checkpoint globs it and never
    # resumes (see test_compat); the layer lists it.
    model_dir = tmp_path / "lr[0.1]"
    _trainer(model_dir).fit(_data().repeat(), steps=6, checkpoint_every=2,
                            verbose=0)
    trainer = _trainer(model_dir)
    assert [s for s, _ in Checkpointer(str(model_dir), STRATEGY).checkpoints(
    )] == [2, 4, 6]
    _flip_a_bit(model_dir / "ckpt-6")
    (model_dir / "checkpoint").write_text("this is not a state file")
    trainer.fit(_data().repeat(), steps=4, verbose=0)
    assert trainer.step == 4          # resumed at 4: 6 was damaged
    reference = _trainer(tmp_path / "reference")
    reference.fit(_data().repeat(), steps=4, verbose=0)
    _assert_same(trainer.model.get_weights(), reference.model.get_weights())
    # Every checkpoint damaged: an error that says so, not a restart at 0.
    for step in (2, 4):
        _flip_a_bit(model_dir / f"ckpt-{step}")
    with pytest.raises(ValueError, match=r"None of the 3 checkpoint\(s\) .*"
                       r"reads back.*damaged"):
        _trainer(model_dir).fit(_data().repeat(), steps=8, verbose=0)


def test_rotation_keeps_the_newest_checkpoint_of_a_finite_loss(tmp_path):
    model, _ = _model()
    checkpointer = Checkpointer(str(tmp_path), STRATEGY, keep=2,
                                model=model)
    checkpointer.save(Position(step=1))
    for step in (2, 3, 4):
        checkpointer.save(Position(step=step, loss_finite=False))
    assert [s for s, _ in checkpointer.checkpoints()] == [1, 3, 4]
    checkpointer.save(Position(step=5))
    assert [s for s, _ in checkpointer.checkpoints()] == [4, 5]
    checkpointer.close()


def test_a_second_job_on_the_same_model_dir_fails_naming_the_holder(
        tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tfmulti.training "
         "import model_dir_lock; model_dir_lock.acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(120)", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        # Anything a library prints on import comes before "held".
        lines = iter(holder.stdout.readline, "")
        assert "held" in (line.strip() for line in lines)
        with pytest.raises(model_dir_lock.ModelDirLockedError) as e:
            _trainer(tmp_path).fit(_data().repeat(), steps=2, verbose=0)
        assert f'"pid": {holder.pid}' in str(e.value)
        assert "Give this job its own `model_dir`" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    # The kernel released it with the process: the next job runs.
    trainer = _trainer(tmp_path)
    trainer.fit(_data().repeat(), steps=2, verbose=0)
    assert trainer.step == 2
    assert not (tmp_path / model_dir_lock.LOCK_NAME).exists()


def test_position_reports_what_changed():
    before = Position(step=5, global_batch_size=64, num_replicas=4,
                      num_workers=1)
    now = Position(step=5, global_batch_size=64, num_replicas=2,
                   num_workers=1)
    assert before.changes_to(now) == [
        "replicas 4 -> 2",
        "global batch 64 kept, per-replica batch 16 -> 32"]
    assert before.changes_to(before) == []
    assert Position.from_json(before.to_json()) == before


def _run(schedule, *, steps=10, steps_per_loop=3, times=None):
    ran, clock = [], iter(times or range(1000))

    def train(step, n):
        return controller.LoopResult(step=step + n, steps=steps,
                                     at_end=False)

    action = controller.PeriodicAction(lambda r: ran.append(r.step))
    action.schedule = schedule
    controller.Controller(train, steps_per_loop=steps_per_loop,
                          actions=[action],
                          clock=lambda: next(clock)).run(0, steps)
    return ran


def test_schedules_by_steps_seconds_loops_and_exact_boundaries():
    S = controller.Schedule
    # Loops end at 3, 6, 9, 10.
    assert _run(S(every_loop=True)) == [3, 6, 9, 10]
    assert _run(S(every_steps=4, at_end=False)) == [6, 9]
    assert _run(S(every_steps=4)) == [6, 9, 10]
    # exact: the loop stops at each multiple (evaluation's weights).
    assert _run(S(every_steps=4, exact=True)) == [4, 8, 10]
    # The clock reads 0 at the start, then 10 per loop.
    assert _run(S(every_seconds=15, at_end=False),
                times=[0, 10, 20, 30, 40]) == [6, 10]
    with pytest.raises(ValueError, match="`every_steps` should be a "
                       "positive int"):
        S(every_steps=0)
    with pytest.raises(ValueError, match="`exact` needs `every_steps`"):
        S(exact=True)
