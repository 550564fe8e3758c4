"""Upstream multi-worker reports on two real workers.

Usage: cases_multi_worker.py OUT_JSON ('{index}' in OUT_JSON becomes the
worker index); TF_CONFIG comes from the environment. The one-device golden
run of the same code is a case of `cases_local.py` (`dict_inputs`).

keras-team/keras#20329 (dict inputs under multi-worker fit),
tensorflow/tensorflow#72388 ("Invalid reduction dimension 0" with Keras 3
under MultiWorkerMirroredStrategy) and keras-team/keras#20585 (multi-worker
fit fails in the first-batch build): a model with dict inputs trained by
plain `fit` and through `tfmulti.keras.distributed`.

TF tutorial "Custom training loop with Keras and MultiWorkerMirroredStrategy"
(`tutorial_ctl.py`): both workers given the same checkpoint directory, as on
a shared filesystem (the tutorial's restore reads the chief's directory).
TF tutorial "Distributed input", its AutoShardPolicy examples
(`tutorial_input.sharding_on_workers`).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def run(strategy, how):
    """Two epochs of 4 global batches of 32, then evaluate."""
    rng = np.random.default_rng(0)
    features = {"a": rng.normal(size=(128, 4)).astype("float32"),
                "b": rng.normal(size=(128, 3)).astype("float32")}
    labels = rng.integers(0, 3, size=(128,)).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        a = keras.Input((4,), name="a")
        b = keras.Input((3,), name="b")
        hidden = keras.layers.Dense(16, activation="relu")(
            keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(hidden))
        initial = [w.numpy().copy() for w in model.weights]
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), metrics=["accuracy"])
    if how == "distributed":
        tfmulti.keras.distributed(model)
    options = tf.data.Options()
    # Every worker reads the same global batches; the strategy splits them.
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    ds = tf.data.Dataset.from_tensor_slices((features, labels)).batch(
        32, drop_remainder=True).with_options(options)
    history = model.fit(ds, epochs=2, verbose=0)
    return {"weights": [w.numpy().tolist() for w in model.weights],
            "moved": max(float(np.max(np.abs(w.numpy() - w0)))
                         for w, w0 in zip(model.weights, initial)),
            "history": history.history,
            "eval": model.evaluate(ds, verbose=0, return_dict=True)}


def main():
    strategy = tfmulti.create_strategy("multi_worker")
    out_path = sys.argv[1].format(index=tfmulti.cluster_config().task_index)
    results = {}
    for how in ("plain", "distributed"):
        try:
            results[how] = {"result": run(strategy, how)}
        except Exception as e:  # noqa: BLE001 - the text is the result
            results[how] = {"error": f"{type(e).__name__}: {e}"}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tutorial_ctl
    try:
        results["ctl_tutorial"] = {"result": tutorial_ctl.run(
            strategy, 2, os.path.join(os.path.dirname(sys.argv[1]), "ctl"))}
    except Exception as e:  # noqa: BLE001 - the text is the result
        results["ctl_tutorial"] = {"error": f"{type(e).__name__}: {e}"}
    import tutorial_input
    try:
        results["input_sharding"] = {"result": tutorial_input.sharding_on_workers(
            strategy, os.path.join(os.path.dirname(sys.argv[1]), "input"))}
    except Exception as e:  # noqa: BLE001 - the text is the result
        results["input_sharding"] = {"error": f"{type(e).__name__}: {e}"}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
