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


def kill_at(epoch, batch):
    """SIGKILLs this process after `batch` of `epoch` (0-based)."""
    now = {"epoch": 0}

    def batch_end(done, logs):
        if (now["epoch"], done) == (epoch, batch):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: now.update(epoch=e),
        on_train_batch_end=batch_end)


class OwnTensorBoard(keras.callbacks.TensorBoard):
    """Keeps its own writer paths: tfmulti cannot redirect them."""

    def set_model(self, model):
        self._model = model


def tutorial_saving(strategy, multi_worker_model, multi_worker_dataset,
                    out_dir):
    """TF's "Multi-worker training with Keras", "Model saving and loading"
    and "Checkpoint saving and restoring", as written (each worker saves,
    non-chiefs to `workertemp_<id>` they delete, then every worker loads
    the chief's), apart from: `out_dir` for /tmp, `.keras` for the model
    path (Keras 3), `keras` for `tf.keras`, verbose=0. Returns how far the
    loaded model is from the saved one (0.0: this worker read the chief's
    complete file)."""
    single_worker_dataset = multi_worker_dataset.repeat()
    multi_worker_dataset = multi_worker_dataset.repeat()
    model_path = os.path.join(out_dir, "keras-model.keras")

    def _is_chief(task_type, task_id):
        # Note: there are two possible `TF_CONFIG` configurations.
        #   1) In addition to `worker` tasks, a `chief` task type is use;
        #      in this case, this function should be modified to
        #      `return task_type == 'chief'`.
        #   2) Only `worker` task type is used; in this case, worker 0 is
        #      regarded as the chief. The implementation demonstrated here
        #      is for this case.
        # For the purpose of this Colab section, the `task_type` is `None`
        # case is added because it is effectively run with only a single
        # worker.
        return (task_type == 'worker' and task_id == 0) or task_type is None

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = 'workertemp_' + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        tf.io.gfile.makedirs(temp_dir)
        return temp_dir

    def write_filepath(filepath, task_type, task_id):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    task_type, task_id = (strategy.cluster_resolver.task_type,
                          strategy.cluster_resolver.task_id)
    write_model_path = write_filepath(model_path, task_type, task_id)
    multi_worker_model.save(write_model_path)
    if not _is_chief(task_type, task_id):
        tf.io.gfile.rmtree(os.path.dirname(write_model_path))
    loaded_model = keras.models.load_model(model_path)
    loaded = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                 for a, b in zip(loaded_model.weights,
                                 multi_worker_model.weights))
    # Now that the model is restored, and can continue with the training.
    loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=20,
                     verbose=0)

    checkpoint_dir = os.path.join(out_dir, "ckpt")
    checkpoint = tf.train.Checkpoint(model=multi_worker_model)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = tf.train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id):
        tf.io.gfile.rmtree(write_checkpoint_dir)
    latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=20,
                           verbose=0)
    return {"loaded_difference": loaded}


def distributed_writers(strategy, train, path):
    """The same writers through tfmulti.keras.distributed: a checkpoint
    per epoch and a CSV log; returns the final weights."""
    with strategy.scope():
        model = build()
    tfmulti.keras.distributed(model)
    model.fit(train, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(path("dist-{epoch}.keras")),
        keras.callbacks.CSVLogger(path("dist.csv"))])
    return [w.numpy().tolist() for w in model.weights]


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
            callbacks.append(kill_at(epoch, batch))
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
    tutorial = tutorial_saving(strategy, model, train, out_dir)
    distributed = distributed_writers(strategy, train, path)
    result = {"pid": os.getpid(), "attempt": attempt,
              "tutorial": tutorial, "distributed": distributed,
              "weights": [w.numpy().tolist() for w in model.weights],
              "history": history.history, "refused": refused,
              "iterations": int(model.optimizer.iterations.numpy())}
    with open(path(f"result-{index}-{attempt}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
