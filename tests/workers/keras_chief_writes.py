"""A one-machine Keras script run unchanged by every worker of a 2-worker
job (only the strategy line is tfmulti's), with the same paths on both.

Usage: keras_chief_writes.py OUT_DIR [KILL]
Keras's BackupAndRestore, ModelCheckpoint(save_best_only=True),
TensorBoard and CSVLogger(append=True) during `fit`, then `model.save`,
`save_weights` and `export`, all under OUT_DIR. With KILL ("WORKER:EPOCH:
BATCH"), on the first attempt of tfmulti-launch (TFMULTI_LAUNCH_ATTEMPT=0)
that worker SIGKILLs itself after that batch (0-based); the launcher
restarts both and BackupAndRestore resumes. Each worker writes
OUT_DIR/pid-<index>-<attempt> when it starts and
OUT_DIR/result-<index>-<attempt>.json at the end: its final weights, the history,
and the error text of a `fit` with a TensorBoard subclass tfmulti cannot
redirect (it must stop before its first step, on every worker).
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

EPOCHS = 4


def data():
    """256 training and 64 validation examples, global batches of 32."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype("float32")
    y = rng.integers(0, 3, size=(320,)).astype("int32")
    return x, y


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def datasets(x, y):
    options = tf.data.Options()
    # Every worker reads the same global batches; the strategy splits them.
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    train = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(
        32, drop_remainder=True).with_options(options)
    val = tf.data.Dataset.from_tensor_slices((x[256:], y[256:])).batch(
        32, drop_remainder=True).with_options(options)
    return train, val


class KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class OwnTensorBoard(keras.callbacks.TensorBoard):
    """Keeps its own writer paths: tfmulti cannot redirect them."""

    def set_model(self, model):
        self._model = model


def main(out_dir, kill=""):
    # The one line changed from the one-machine script, first thing.
    strategy = tfmulti.create_strategy("multi_worker")
    index = tfmulti.cluster_config().task_index
    attempt = int(os.environ.get("TFMULTI_LAUNCH_ATTEMPT", "0"))
    # Which process wrote which event file: its name holds the pid.
    with open(os.path.join(out_dir, f"pid-{index}-{attempt}"), "w") as f:
        f.write(str(os.getpid()))
    x, y = data()
    train, val = datasets(x, y)
    with strategy.scope():
        model = build()
    path = lambda name: os.path.join(out_dir, name)  # noqa: E731
    callbacks = [
        keras.callbacks.BackupAndRestore(path("backup")),
        keras.callbacks.ModelCheckpoint(path("best.keras"),
                                        save_best_only=True),
        keras.callbacks.TensorBoard(path("logs")),
        keras.callbacks.CSVLogger(path("log.csv"), append=True),
    ]
    if kill and attempt == 0:
        worker, epoch, batch = map(int, kill.split(":"))
        if worker == index:
            callbacks.append(KillAt(epoch, batch))
    history = model.fit(train, epochs=EPOCHS, validation_data=val,
                        callbacks=callbacks, verbose=0)
    model.save(path("model.keras"))
    model.save_weights(path("model.weights.h5"))
    model.export(path("export"), verbose=False)
    try:
        model.fit(train, epochs=1, verbose=0,
                  callbacks=[OwnTensorBoard(path("own_logs"))])
        refused = None
    except ValueError as e:
        refused = str(e)
    result = {"pid": os.getpid(), "attempt": attempt,
              "weights": [w.numpy().tolist() for w in model.weights],
              "history": history.history, "refused": refused,
              "iterations": int(model.optimizer.iterations.numpy())}
    with open(path(f"result-{index}-{attempt}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
