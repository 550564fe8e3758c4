"""One process of the kill-and-restart test of tfmulti.keras.callbacks.

Usage: keras_backup_worker.py OUT_JSON STRATEGY MODEL_DIR TEMP_ROOT
('{index}' in OUT_JSON and MODEL_DIR becomes the worker index; MODEL_DIR
'-' trains without callbacks: the uninterrupted golden run.)
TFMULTI_TEST_EXIT_AT="EPOCH:end" or "EPOCH:BATCH" (0-based) makes the
process exit with status 3 right after that epoch or batch, as a killed job
would: no cleanup, no Python exit handlers. TFMULTI_TEST_DEVICES=N splits
the CPU into N logical devices first (for STRATEGY=mirrored).
TFMULTI_TEST_SIGKILL="WORKER:SECONDS": on the first attempt of a
tfmulti-launch group, worker WORKER gets SIGKILL from a timer thread SECONDS
after its first backup (the end of batch BACKUP_FREQ), wherever its main thread is (inside a step, an
all-reduce or a backup write). TFMULTI_TEST_BATCH_SECONDS=S sleeps S after
each batch, so that a fit lasts long enough to be killed at a random time.
"""

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

out, name, model_dir, temp_root = sys.argv[1:5]
if os.environ.get("TFMULTI_TEST_DEVICES"):
    tfmulti.simulate_devices(int(os.environ["TFMULTI_TEST_DEVICES"]))
strategy = tfmulti.create_strategy(name)
cluster = tfmulti.cluster_config()
out = out.format(index=cluster.task_index)
model_dir = model_dir.format(index=cluster.task_index)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 32
EPOCHS = 3
BACKUP_FREQ = 3
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = rng.integers(0, 3, size=(256,)).astype("int32")


class SigkillAfter(keras.callbacks.Callback):
    """SIGKILLs this process SECONDS after its first backup (a timer)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        # From the end of the batch whose backup the callbacks before this
        # one just wrote: the claim is a resume from a backup, and on a
        # loaded machine the first batches alone can take longer than any
        # fixed delay (tracing, the first steps).
        self.batches += 1
        if self.seconds is not None and self.batches >= BACKUP_FREQ:
            print(f"FAULT SIGKILL in {self.seconds:.2f} s", flush=True)
            threading.Timer(self.seconds, os.kill,
                            (os.getpid(), signal.SIGKILL)).start()
            self.seconds = None


class SlowBatches(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class ExitAt(keras.callbacks.Callback):
    """Ends the process abruptly at TFMULTI_TEST_EXIT_AT."""

    def __init__(self, spec):
        super().__init__()
        epoch, _, where = spec.partition(":")
        self.epoch, self.where = int(epoch), where
        self.current = 0

    def _exit(self):
        report()
        sys.stdout.flush()
        os._exit(3)

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and self.where == str(batch):
            self._exit()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and self.where == "end":
            self._exit()


with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    # Warmup makes the rate depend on the restored step counter.
    schedule = tfmulti.scaled_learning_rate(
        0.05, base_batch_size=16, global_batch_size=GLOBAL_BATCH,
        warmup_steps=10)
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))

callbacks = []
if model_dir != "-":
    callbacks = tfmulti.keras.callbacks(model_dir, backup_freq=BACKUP_FREQ,
                                        temp_root=temp_root)
kill = os.environ.get("TFMULTI_TEST_SIGKILL", "")
if kill and os.environ.get("TFMULTI_LAUNCH_ATTEMPT") == "0" and int(
        kill.split(":")[0]) == cluster.task_index:
    callbacks.append(SigkillAfter(float(kill.split(":")[1])))
if os.environ.get("TFMULTI_TEST_BATCH_SECONDS"):
    callbacks.append(SlowBatches(float(os.environ[
        "TFMULTI_TEST_BATCH_SECONDS"])))
if os.environ.get("TFMULTI_TEST_EXIT_AT"):
    callbacks.append(ExitAt(os.environ["TFMULTI_TEST_EXIT_AT"]))

epochs_run = []
callbacks.append(keras.callbacks.LambdaCallback(
    on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch)))
backup = next((c for c in callbacks if hasattr(c, "restored")), None)


def report():
    with open(out, "w") as f:
        json.dump({"replicas": strategy.num_replicas_in_sync,
                   "is_chief": cluster.is_chief, "pid": os.getpid(),
                   "epochs_run": epochs_run,
                   "restored": backup.restored if backup else None,
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "weights": [w.tolist() for w in model.get_weights()]}, f)


ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
model.fit(ds, epochs=EPOCHS, callbacks=callbacks, verbose=0)
report()
