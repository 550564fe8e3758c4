"""Two workers started with different settings: every worker stops, naming it.

Usage: robustness_agreement.py WORK_DIR (cluster from TF_CONFIG)
Case 1: worker i uses global batch 16 * (i + 1).
Case 2: worker i uses grad_accum_steps i + 1 and steps_per_loop i + 1.
Case 3: each worker its own model_dir: a first fit saves step 2 in the
chief's, then a fresh Trainer restores step 2 on the chief, 0 on worker 1
(caught by the checkpoint layer's position check, before the fingerprint).
Case 4: Keras fit (tfmulti.keras.distributed), global batch 16 * (i + 1).
Case 5: Keras fit, grad_accum_steps i + 1.
Case 6 (last: the failed broadcast leaves the collectives aborted): worker i
builds Dense(3 + i); worker 1 fails in the initial-value broadcast, the chief
when worker 1 has exited.
Prints `CASE k: <error>` per case; then `DONE`.

Usage: robustness_agreement.py WORK_DIR extra: only case 7: worker 1's model
has one more layer; worker 0, done with its model, creates its optimizer
(compile), whose broadcast meets worker 1's next one.
"""

import json
import os
import sys

import tfmulti

strategy = tfmulti.create_strategy("multi_worker",
                                   startup_timeout_seconds=300)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
work_dir = sys.argv[1]
only_extra = sys.argv[2:] == ["extra"]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


def dataset_fn(input_context):
    del input_context
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, np.zeros(64, "int32")))


def trainer(steps_per_loop=2, **kwargs):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return tfmulti.Trainer(model, keras.optimizers.SGD(0.1), loss=LOSS,
                               steps_per_loop=steps_per_loop, **kwargs)


def case(k, fn):
    try:
        fn()
        print(f"CASE {k}: no error", flush=True)
    except (ValueError, RuntimeError) as e:
        print(f"CASE {k}: {type(e).__name__}: {e}", flush=True)


def extra_layer():
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)] +
                                 [keras.layers.Dense(3)] * rank)
        model.compile(optimizer="sgd", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    tfmulti.keras.distributed(model).fit(
        tfmulti.distribute_dataset(strategy, dataset_fn, global_batch_size=16),
        epochs=1, steps_per_epoch=2, verbose=0)


if only_extra:
    case(7, extra_layer)
    print("DONE", flush=True)
    sys.exit(0)
case(1, lambda: trainer().fit(dataset_fn, steps=2, verbose=0,
                              global_batch_size=16 * (rank + 1)))
case(2, lambda: trainer(steps_per_loop=rank + 1,
                        grad_accum_steps=rank + 1).fit(
    dataset_fn, steps=2, verbose=0, global_batch_size=16))
own_dir = os.path.join(work_dir, f"model-{rank}")
trainer(model_dir=own_dir).fit(dataset_fn, steps=2, verbose=0,
                               global_batch_size=16)
case(3, lambda: trainer(model_dir=own_dir).fit(
    dataset_fn, steps=4, verbose=0, global_batch_size=16))


def keras_fit(global_batch_size=16, grad_accum_steps=1):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    tfmulti.keras.distributed(model, grad_accum_steps=grad_accum_steps)
    data = tfmulti.distribute_dataset(strategy, dataset_fn,
                                      global_batch_size=global_batch_size)
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)


case(4, lambda: keras_fit(global_batch_size=16 * (rank + 1)))
case(5, lambda: keras_fit(grad_accum_steps=rank + 1))


def other_shape():
    with strategy.scope():
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3 + rank)])


case(6, other_shape)
print("DONE", flush=True)
