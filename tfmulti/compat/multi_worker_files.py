"""Keras 3 on several workers: what it writes from every worker, and
telling a worker that a file is written."""

from __future__ import annotations

import keras
import tensorflow as tf


# --- Keras 3 writes every file from every worker ---------------------------
# Symptom: under MultiWorkerMirroredStrategy every worker runs the same
# callbacks and saves, to the same paths: `keras.callbacks.BackupAndRestore`
# writes `latest.weights.h5` from each (h5py "BlockingIOError: [Errno 11]
# Unable to synchronously create file (unable to lock file ...)", then the
# peer's collectives abort), `TensorBoard` writes one event file per worker
# and split, `ModelCheckpoint` and `model.save("x.keras")` interleave their
# writes ("BadZipFile: Bad CRC-32 for file 'config.json'" in 2 of 5 runs),
# `CSVLogger` writes each row twice. tf.keras (Keras 2) wrote from the chief
# only and sent the others to temporary directories
# (`keras/distribute/distributed_file_utils.py`); Keras 3 dropped that
# (keras-team/keras#20601: multi-worker not supported). Checked: Keras 3.15.1.
# Workaround (`tfmulti.chief_writes`, installed when tfmulti makes a
# multi-worker strategy): `keras.Model.save` / `save_weights` / `export` and
# `keras.callbacks.CallbackList.set_model` / `on_train_begin` /
# `on_train_end` are wrapped; the wrappers change nothing unless the model's
# strategy is tfmulti's multi-worker one with more than one worker. Below:
# where each callback keeps the paths it writes (private, set by
# `set_model` or `__init__`). Guards: tests/test_keras_chief_writes.py
# (test_keras_callbacks_still_have_no_chief_logic,
# test_callback_write_paths_still_exist).
def callback_write_paths() -> dict:
    """{Keras callback class: the attributes holding the paths it writes,
    its root (a directory or file the others are in) first}."""
    return {
        keras.callbacks.BackupAndRestore: (
            "backup_dir", "_weights_path", "_training_metadata_path",
            "_prev_weights_path", "_prev_training_metadata_path"),
        # `set_model` derives the others from `log_dir`, and writes.
        keras.callbacks.TensorBoard: ("log_dir", "_log_write_dir",
                                      "_train_dir", "_val_dir"),
        keras.callbacks.CSVLogger: ("filename",),
    }


MODEL_WRITE_METHODS = ("save", "save_weights", "export")
_CALLBACK_LIST_HOOKS = ("set_model", "on_train_begin", "on_train_end")


def wrap_keras_writes(model_write, callback_list_hook) -> bool:
    """Wraps Keras's model writers and callback list hooks, once.

    `model_write(name, original, model, *args, **kwargs)` stands in for
    `keras.Model.<name>`; `callback_list_hook(name, original, callback_list,
    *args, **kwargs)` for `keras.callbacks.CallbackList.<name>`.

    Returns:
      Whether they were wrapped now (False: already wrapped).
    """
    if getattr(keras.Model, "_tfmulti_writes_wrapped", False):
        return False

    def wrap(cls, name, hook):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            return hook(name, original, self, *args, **kwargs)
        wrapped.__name__ = name
        wrapped.__doc__ = original.__doc__
        wrapped.__wrapped__ = original
        setattr(cls, name, wrapped)

    for name in MODEL_WRITE_METHODS:
        wrap(keras.Model, name, model_write)
    for name in _CALLBACK_LIST_HOOKS:
        wrap(keras.callbacks.CallbackList, name, callback_list_hook)
    keras.Model._tfmulti_writes_wrapped = True
    return True


# --- Telling another worker a file is written, without a collective --------
# Symptom: a script that saves on every worker and then loads the chief's
# file (TF's "Multi-worker training with Keras", "Model saving and
# loading") can read it on a non-chief before the chief has written it;
# a collective barrier would hang a script that saves from the chief only
# (`if is_chief: model.save(...)`, which needs none in Keras 3). TF's
# coordination service (on in MultiWorkerMirroredStrategy) has a key-value
# store with a blocking read, reachable only through the private
# `context.context().{set,get}_config_key_value`. Checked: TF 2.21.0.
# Guard: tests/test_keras_chief_writes.py::test_coordination_key_value_
# still_private (use: ::test_tutorial_save_then_load_on_every_worker).
def publish_key(key: str, value: str = "1") -> None:
    """Sets `key` in the cluster's coordination service."""
    from tensorflow.python.eager import context
    context.context().set_config_key_value(key, value)


def wait_for_key(key: str, timeout_seconds: float) -> bool:
    """Blocks until `key` is set by some worker; False after the timeout.
    True at once if the service is gone: the chief, which runs it, has
    exited (after its writes, or dead: then nothing more will come)."""
    from tensorflow.python.eager import context
    try:
        context.context().get_config_key_value(
            key, timeout_in_ms=int(timeout_seconds * 1000))
    except tf.errors.DeadlineExceededError:
        return False
    except tf.errors.UnavailableError:
        return True
    return True
