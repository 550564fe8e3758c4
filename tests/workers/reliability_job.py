"""A small Trainer job for the fault-injection tests, run by tfmulti-launch.

Usage: reliability_job.py MODEL_DIR OUT_DIR [--steps N] [--checkpoint_every K]

Trains a Dense model with tfmulti.Trainer (one step per loop) on a
deterministic dataset, checkpointing to MODEL_DIR every K steps, and writes
the final weights to OUT_DIR/weights-<worker>.npz. Prints `START step=S
attempt=A` once training (re)starts. Faults come from the environment:

  TFMULTI_FAULT=WORKER:STEP:SIGNAL   on attempt 0 (TFMULTI_LAUNCH_ATTEMPT),
      worker WORKER sends itself SIGNAL (KILL or TERM) after step STEP;
  TFMULTI_FAULT=WORKER:before_fit:KILL   it dies before training starts;
  TFMULTI_FAULT=WORKER:STEP:STALL   it stops responding (sleeps for the
      bound given, --stall_timeout_seconds or --timeout_seconds, plus 7 s,
      at least 12 s; then exits 3) while staying alive: only the watchdog
      or a collective timeout catches that.

A worker that sees a peer failure prints `PEER_FAILURE <unix time>` and the
error; the one that kills itself first writes OUT_DIR/died-<worker> with the
time of death, so a test can measure how long the survivor took.
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--checkpoint_every", type=int, default=4)
parser.add_argument("--timeout_seconds", type=float, default=None)
parser.add_argument("--stall_timeout_seconds", type=float, default=None)
args = parser.parse_args()

strategy = tfmulti.create_strategy(
    "auto", timeout_seconds=args.timeout_seconds,
    **({} if args.stall_timeout_seconds is None else
       {"stall_timeout_seconds": args.stall_timeout_seconds}))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import peer_failure  # noqa: E402

GLOBAL_BATCH = 16
index = json.loads(os.environ.get("TF_CONFIG", "{}")).get(
    "task", {}).get("index", 0)
attempt = int(os.environ.get("TFMULTI_LAUNCH_ATTEMPT", "0"))
fault = os.environ.get("TFMULTI_FAULT", "") if attempt == 0 else ""
fault_worker, fault_step, fault_signal = (
    fault.split(":") if fault else ("-1", "0", "KILL"))
my_fault = int(fault_worker) == index


def die(signame):
    with open(os.path.join(args.out_dir, f"died-{index}"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), getattr(signal, f"SIG{signame}"))


if my_fault and fault_step == "before_fit":
    die(fault_signal)

rng = np.random.default_rng(0)
X = rng.normal(size=(256, 8)).astype("float32")
Y = rng.integers(0, 3, size=(256,)).astype("int32")


def dataset_fn(ctx):
    # Unbatched: the Trainer feeds it through tfmulti.distribute_dataset,
    # which shards, shuffles with a fixed seed, repeats and batches, so a
    # restarted worker replays exactly the same batches.
    del ctx
    return tf.data.Dataset.from_tensor_slices((X, Y))


with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
trainer = tfmulti.Trainer(
    model, optimizer, strategy=strategy, steps_per_loop=1,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None),
    model_dir=args.model_dir)


class Fault(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        timeout = tfmulti.strategies.communication_options(
            strategy).timeout_seconds
        dog = tfmulti.watchdog.of(strategy)
        stall = dog.timeout_seconds if dog else None
        print(f"START step={trainer.step} attempt={attempt} "
              f"timeout={timeout} stall_timeout={stall}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if my_fault and batch + 1 == int(fault_step):
            print(f"FAULT SIG{fault_signal} at step {batch + 1}", flush=True)
            if fault_signal == "KILL":
                die("KILL")
            if fault_signal == "STALL":
                with open(os.path.join(args.out_dir, f"died-{index}"),
                          "w") as f:
                    f.write(repr(time.time()))
                time.sleep(max(12, (args.stall_timeout_seconds or
                                    args.timeout_seconds or 0) + 7))
                os._exit(3)
            os.kill(os.getpid(), signal.SIGTERM)


try:
    trainer.fit(dataset_fn, steps=args.steps, global_batch_size=GLOBAL_BATCH,
                checkpoint_every=args.checkpoint_every, callbacks=[Fault()],
                verbose=0)
except peer_failure.PeerFailureError as e:
    print(f"PEER_FAILURE {time.time()!r} {e}", flush=True)
    sys.exit(1)
np.savez(os.path.join(args.out_dir, f"weights-{index}.npz"),
         *[v.numpy() for v in model.weights])
print(f"DONE step={trainer.step}", flush=True)
