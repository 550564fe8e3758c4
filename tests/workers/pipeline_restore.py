"""One device, one process: a pipelined checkpoint predicts as it did.

Usage: pipeline_restore.py CKPT_DIR OUT.json
"""

import json
import sys

import keras
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import pipeline_golden  # noqa: E402  (its model and data)

import tensorflow as tf  # noqa: E402


def main():
    ckpt_dir, out = sys.argv[1], sys.argv[2]
    with tf.device("/CPU:0"):
        model = pipeline_golden.make_model("mlp")
        model.load_weights(f"{ckpt_dir}/pipelined.weights.h5")
        got = model.predict(pipeline_golden.data()[0][0], verbose=0)
    want = np.load(f"{ckpt_dir}/pipelined_predictions.npy")
    devices = {v.value.device.rsplit("device:", 1)[-1] for v in model.weights}
    result = {"pipelined_to_single_diff": float(np.max(np.abs(got - want))),
              "devices": sorted(devices)}
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    main()
