"""Keras `fit` with tfmulti's BackupAndRestore: SIGTERM backs up the current
batch and exits with the preemption code, and the resumed fit ends with the
weights of an uninterrupted one; a NaN loss stops with the batch and leaves
only finite backups. One device, in process."""

import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

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
