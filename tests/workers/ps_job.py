"""One role of a parameter-server job, or the synchronous golden run.

Usage: ps_job.py MODE OUT_JSON DATA_DIR [MODEL_DIR]
MODE=sync: one device, the Trainer's synchronous step (the golden run).
MODE=async: TF_CONFIG from the environment; the worker and ps tasks serve
(create_strategy never returns there), the chief trains the small CNN with
the Trainer's asynchronous mode and checkpoints into MODEL_DIR; with
PS_JOB_CHECK_SHARDED=1 it first tries a Trainer on a partitioned Keras
Embedding (a second strategy: every worker must be alive).
Both train STEPS steps of BATCH examples (the same examples seen) and write
{"accuracy", "step", "history", "iterations", "attempts", "claimed",
"completed"} to OUT_JSON.
Environment: PS_JOB_STEPS, PS_JOB_BATCH, PS_JOB_LOOP (steps per loop),
PS_JOB_LR, PS_JOB_WARMUP (steps of linear warm-up; 0, the default: none,
also in the asynchronous run), PS_JOB_CLIP (`clip_global_norm`; with it
the trained weights go to OUT_JSON + ".npy" and the synchronous run reads
one asynchronous worker's stream), PS_JOB_STALL (the
strategy's `stall_timeout_seconds`) and PS_JOB_EVAL_EVERY (test accuracy
every N steps, in the history).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

MODE, OUT, DATA_DIR = sys.argv[1:4]
MODEL_DIR = sys.argv[4] if len(sys.argv) > 4 else None
STEPS = int(os.environ.get("PS_JOB_STEPS", "300"))
LOOP = int(os.environ.get("PS_JOB_LOOP", "50"))
BATCH = int(os.environ.get("PS_JOB_BATCH", "32"))
LR = float(os.environ.get("PS_JOB_LR", "1e-3"))

strategy = tfmulti.create_strategy(
    "parameter_server" if MODE == "async" else "one_device",
    stall_timeout_seconds=float(os.environ.get("PS_JOB_STALL", "600")))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import models  # noqa: E402
from tfmulti.data import pipeline  # noqa: E402

train_fn = tfmulti.tfds_dataset_fn("tfmulti_shapes", "train",
                                   data_dir=DATA_DIR)
test_fn = tfmulti.tfds_dataset_fn("tfmulti_shapes", "test", data_dir=DATA_DIR)
# Exact-once test set, built on this process (the chief under PS).
test = pipeline.build_pipeline(
    test_fn, tf.distribute.InputContext(),
    pipeline.PipelineOptions(global_batch_size=256, training=False))

SHARDED_ERROR = None
if os.environ.get("PS_JOB_CHECK_SHARDED"):
    # A Keras 3 layer under a variable_partitioner: the Trainer refuses it.
    # Before training: a second strategy connects to every worker, so it
    # must be made while all are alive.
    from tfmulti import cluster, parameter_server  # noqa: E402
    sharded = parameter_server.create(
        cluster.cluster_config(), variable_partitioner=(
            tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=1024, max_shards=2)))
    with sharded.scope():
        table = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(1000, 8)])
        table_optimizer = keras.optimizers.Adam()
    try:
        tfmulti.Trainer(table, table_optimizer, strategy=sharded,
                        loss=lambda y, p: p)
    except ValueError as e:
        SHARDED_ERROR = str(e)
        print(f"sharded check: {SHARDED_ERROR}", flush=True)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = models.small_cnn()
    # Stepped down over the last 30% of the steps: the run ends with
    # settled weights and BatchNorm moving statistics, so its test accuracy
    # is a property of the training, not of where the last noisy steps left
    # it (at a constant rate two sync seeds ended 4.8 points apart and a run
    # swung up to 19 points between loops; BUILD_NOTES, issue 16).
    stepped = keras.optimizers.schedules.PiecewiseConstantDecay(
        [int(0.7 * STEPS), int(0.85 * STEPS)], [LR, LR * 0.3, LR * 0.1])
    # A linear warm-up over the first PS_JOB_WARMUP steps: without it the
    # model sits at chance for a variable 100-400 steps, longer with stale
    # gradients, and the asynchronous run's accuracy is a lottery
    # (BUILD_NOTES, issue 16). The asynchronous run gets it from the
    # Trainer (`async_warmup_steps`, what API and recipe users get), the
    # synchronous golden run as the same linear schedule.
    WARMUP = int(os.environ.get("PS_JOB_WARMUP", "0"))
    if WARMUP and MODE != "async":
        class Warmup(keras.optimizers.schedules.LearningRateSchedule):
            def __call__(self, step):
                step = keras.ops.cast(step, "float32")
                return keras.ops.minimum(1.0, (step + 1) / WARMUP) * stepped(
                    step)
        schedule = Warmup()
    else:
        schedule = stepped
    optimizer = keras.optimizers.Adam(schedule)
trainer = tfmulti.Trainer(
    model, optimizer, strategy=strategy, metrics=["sparse_categorical_accuracy"],
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None),
    steps_per_loop=LOOP, model_dir=MODEL_DIR,
    clip_global_norm=float(os.environ.get("PS_JOB_CLIP", "0")) or None,
    **({"async_warmup_steps": WARMUP} if MODE == "async" else {}))


if MODE == "async":
    train_data = train_fn
elif os.environ.get("PS_JOB_CLIP"):
    # The stream one asynchronous worker reads (async_trainer: the whole
    # split, shuffled with seed 0, from offset 0), so that one device sees
    # the same batches in the same order.
    train_data = train_fn(tf.distribute.InputContext()).shuffle(
        pipeline.DEFAULT_SHUFFLE_BUFFER, seed=0,
        reshuffle_each_iteration=True).repeat().batch(
            BATCH, drop_remainder=True)
else:
    train_data = tfmulti.distribute_dataset(strategy, train_fn,
                                            global_batch_size=BATCH)
EVAL_EVERY = int(os.environ.get("PS_JOB_EVAL_EVERY", "0")) or None
history = trainer.fit(train_data, steps=STEPS, global_batch_size=BATCH,
                      checkpoint_every=LOOP if MODEL_DIR else None,
                      eval_data=test if EVAL_EVERY else None,
                      eval_every=EVAL_EVERY)
result = {"accuracy": trainer.evaluate(test)["sparse_categorical_accuracy"],
          "step": trainer.step, "history": history,
          "iterations": int(optimizer.iterations.numpy()),
          "sharded_error": SHARDED_ERROR}
if MODE == "async":
    counts = trainer.runner.ledger.counts()
    result.update({key: value.tolist() for key, value in counts.items()})
if os.environ.get("PS_JOB_CLIP"):
    np.save(OUT + ".npy", np.concatenate(
        [v.numpy().ravel() for v in model.trainable_variables]))
with open(OUT, "w") as f:
    json.dump(result, f)
print("done", json.dumps({k: result[k] for k in ("accuracy", "step")}),
      flush=True)
