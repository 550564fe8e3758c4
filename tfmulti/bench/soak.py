"""Soak: threads, memory and open files of a multi-worker job over minutes.

Jobs run for days, so what a worker holds must stay flat while it trains,
not only over a short test: issue 19 was a 600 s per-collective timeout that
kept a thread alive per collective and took the machine down within a
minute. One worker process of a loopback cluster (TF_CONFIG from the
environment) trains a small model with many collectives per second (short
loops, small batches) through the Trainer or Keras `fit` of a
`tfmulti.keras.distributed` model, until `seconds` have passed, and samples
its own thread count, resident memory and open file descriptors every
`interval` seconds.
"""

from __future__ import annotations

import os
import threading
import time

# Read after this many seconds of training: tracing, the first checkpoint
# and the pipeline's thread pools come up during warm-up.
WARMUP_SECONDS = 15.0


def sample() -> dict:
    """This process's threads, resident bytes and open file descriptors."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"threads": len(os.listdir("/proc/self/task")),
            "rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
            "fds": len(os.listdir("/proc/self/fd"))}


def growth(samples: list[dict], *, warmup: float = WARMUP_SECONDS) -> dict:
    """Per resource: the last sample over the first one after `warmup`,
    and the absolute difference. Flat is a ratio near 1."""
    after = [s for s in samples if s["t"] >= warmup] or samples[-1:]
    first, last = after[0], samples[-1]
    return {key: {"first": first[key], "last": last[key],
                  "ratio": last[key] / max(first[key], 1),
                  "delta": last[key] - first[key]}
            for key in ("threads", "rss_bytes", "fds")}


def _model(strategy):
    import keras
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.01)
    return model, optimizer


def _dataset_fn(context):
    import tensorflow as tf
    del context
    x = tf.random.stateless_normal([512, 16], seed=[0, 1])
    y = tf.random.stateless_uniform([512], seed=[0, 2], maxval=4,
                                    dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((x, y))


def run(*, entry: str = "trainer", seconds: float = 300.0,
        interval: float = 10.0, steps_per_loop: int = 2,
        global_batch_size: int = 8, model_dir: str | None = None,
        min_steps: int = 0) -> dict:
    """Trains one worker for `seconds` and at least `min_steps` steps;
    returns its samples and growth.

    Args:
      entry: "trainer" (`tfmulti.Trainer.fit`) or "fit" (`model.fit` of a
        `tfmulti.keras.distributed` model).
      seconds: how long to train (the workers agree when to stop).
      interval: seconds between samples.
      steps_per_loop: steps per `tf.function` call (Trainer) or
        `steps_per_execution` (fit): short loops mean many calls.
      global_batch_size: examples per step over all workers.
      model_dir: the Trainer's checkpoints (default: none).
      min_steps: train on past `seconds` until this many steps: a loaded
        machine still makes the calls whose threads and files are counted.
    """
    import keras
    import tensorflow as tf

    import tfmulti
    from tfmulti.training import loop as loop_lib

    if entry not in ("trainer", "fit"):
        raise ValueError(f"`entry` is {entry!r}; use 'trainer' or 'fit'.")
    strategy = tfmulti.create_strategy("multi_worker")
    model, optimizer = _model(strategy)
    samples = []
    began = time.monotonic()
    done = threading.Event()

    def sampler():
        while True:
            samples.append(dict(sample(), t=time.monotonic() - began))
            if done.wait(interval):
                return

    # Every worker must stop at the same step: one all-reduce decides. In a
    # tf.function, so the check itself adds no eager collective per call.
    any_late = tf.function(
        lambda late: loop_lib.sum_over_replicas(strategy, late))

    class StopAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            late = float(time.monotonic() - began >= seconds and int(
                optimizer.iterations.numpy()) >= min_steps)
            if any_late(tf.constant(late)) > 0:
                self.model.stop_training = True

    thread = threading.Thread(target=sampler, name="tfmulti-soak-sampler",
                              daemon=True)
    thread.start()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None)
    if entry == "trainer":
        trainer = tfmulti.Trainer(model, optimizer, strategy=strategy,
                                  loss=loss, steps_per_loop=steps_per_loop,
                                  model_dir=model_dir)
        trainer.fit(_dataset_fn, steps=10**9,
                    global_batch_size=global_batch_size,
                    callbacks=[StopAfter()], verbose=0)
    else:
        with strategy.scope():
            model.compile(optimizer=optimizer, loss=keras.losses.
                          SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=steps_per_loop)
        tfmulti.keras.distributed(model)
        dataset = tfmulti.distribute_dataset(
            strategy, _dataset_fn, global_batch_size=global_batch_size)
        model.fit(dataset, epochs=10**6, steps_per_epoch=64,
                  callbacks=[StopAfter()], verbose=0)
    done.set()
    thread.join()
    samples.append(dict(sample(), t=time.monotonic() - began))
    return {"entry": entry, "seconds": time.monotonic() - began,
            "steps": int(optimizer.iterations.numpy()), "samples": samples,
            "growth": growth(samples)}
