"""Keras `fit` with tfmulti's BackupAndRestore: SIGTERM backs up the current
batch and exits with the preemption code, and the resumed fit ends with the
weights of an uninterrupted one; a NaN loss stops with the batch and leaves
only finite backups (one device, in process); and a 2-worker fit under
tfmulti-launch, SIGKILLed at random times, resumes to the golden weights."""

import json
import os
import random
import signal
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.subproc import run_python  # noqa: E402
from tfmulti import exit_codes  # noqa: E402
from tfmulti.keras.backup import BackupAndRestore  # noqa: E402
from tfmulti.training import Checkpointer, NonFiniteLossError  # noqa: E402

X = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
Y = (np.arange(48) % 3).astype("int32")


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def fit(model, callbacks, x=X):
    model.fit(x, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)


class _SigtermAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self._at = (epoch, batch)
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch + 1) == self._at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_backs_up_exits_and_resumes_to_the_same_weights(tmp_path):
    reference = make_model()
    fit(reference, [])
    before = signal.getsignal(signal.SIGTERM)
    model = make_model()
    # The signal comes first in the batch hooks, as it would from outside.
    with pytest.raises(SystemExit) as e:
        fit(model, [_SigtermAt(1, 2), BackupAndRestore(tmp_path)])
    assert e.value.code == exit_codes.PREEMPTED
    assert signal.getsignal(signal.SIGTERM) is before
    resumed = make_model()
    backup = BackupAndRestore(tmp_path, delete_on_end=False)
    fit(resumed, [backup])
    assert backup.restored == (1, 2)
    assert int(resumed.optimizer.iterations) == 12
    for a, b in zip(resumed.weights, reference.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_nan_loss_stops_with_the_batch_and_no_nan_backup(tmp_path):
    x = X.copy()
    x[8 * 2] = np.nan        # the third batch of every epoch
    model = make_model()
    with pytest.raises(NonFiniteLossError,
                       match="loss is nan at epoch 0 batch 3"):
        fit(model, [BackupAndRestore(tmp_path, save_freq=1)], x=x)
    restored = make_model()
    restored.optimizer.build(restored.trainable_variables)
    position = Checkpointer(str(tmp_path), restored.distribute_strategy,
                            model=restored,
                            optimizer=restored.optimizer).restore()
    assert (position.epoch, position.batch, position.step) == (0, 2, 2)
    assert all(np.all(np.isfinite(w.numpy())) for w in restored.weights)


KILL_RUNS = 3
BATCH_SECONDS = 0.1  # 3 epochs x 8 batches: a fit of at least 2.4 s
WORKER = "tests/workers/keras_backup_worker.py"


@pytest.mark.slow
def test_two_worker_fit_sigkilled_at_random_times_resumes_to_golden(
        tmp_path):
    """`tfmulti.keras.distributed(model).fit` on 2 workers with tfmulti's
    BackupAndRestore (every 3 batches), under tfmulti-launch: a random
    worker gets SIGKILL from a timer thread at a random time of its fit
    (0.1-2.0 s after its first backup, at the end of batch 3, with at least
    2.1 s of fit left: inside a step, an all-reduce or a backup write
    alike); the restarted
    group resumes from the last backup and ends with the weights of an
    uninterrupted one-device run over the same global batches."""
    golden_out = tmp_path / "golden.json"
    run_python([WORKER, str(golden_out), "one_device", "-", "-"],
               timeout=240)
    golden = json.loads(golden_out.read_text())
    rng = random.Random()
    for run in range(KILL_RUNS):
        work = tmp_path / f"run{run}"
        worker, seconds = rng.randrange(2), rng.uniform(0.1, 2.0)
        env = dict(os.environ, TFMULTI_TEST_SIGKILL=f"{worker}:{seconds}",
                   TFMULTI_TEST_BATCH_SECONDS=str(BATCH_SECONDS),
                   TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-m", "tfmulti.launch", "--workers", "2",
             "--max_restarts", "1", "--timeout", "400", "--",
             sys.executable, WORKER, str(work / "out-{index}.json"),
             "multi_worker", str(work / "model"), str(work / "scratch")],
            capture_output=True, text=True, timeout=460, env=env)
        where = (f"run {run}: SIGKILL to worker {worker} {seconds:.2f} s "
                 "after the first backup")
        assert result.returncode == 0, (where, result.stderr[-3000:])
        assert (f"worker {worker} was killed by SIGKILL; restarting all 2 "
                "workers") in result.stderr, (where, result.stderr[-3000:])
        final = [json.loads((work / f"out-{i}.json").read_text())
                 for i in range(2)]
        print(f"{where}: resumed at (epoch, batch) {final[0]['restored']}")
        # The kill came after the first backup: the group resumed from
        # one, not from the start.
        assert final[0]["restored"] is not None, where
        for out in final:
            assert out["iterations"] == golden["iterations"], where
            for a, b in zip(out["weights"], golden["weights"]):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=where)
