"""The pipeline recipe run next to a one-device run of the same model.

Usage: pipeline_recipe.py OUT.json DATA_DIR RUNS_DIR

Runs `experiment.train_and_evaluate` twice in one process (2 simulated CPU
devices, same seed, data and steps): one device with `batchnorm=False`, then
`pipeline_stages=2, micro_batches=4` (BatchNorm asked for, so the run drops
it and says so). Writes both metrics and the largest difference between
every tensor of their final checkpoints (weights and Adam slots: the
pipeline saves the unsplit optimizer's format).
"""

import dataclasses
import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tfmulti import experiment


def _tensors(model_dir):
    path = tf.train.latest_checkpoint(model_dir)
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if "save_counter" not in k}


def main(out, data_dir, runs):
    base = experiment.ExperimentConfig(
        cpu_replicas=2, data_dir=data_dir, global_batch_size=32, steps=4,
        steps_per_loop=2, seed=3)
    # The input pipeline's shuffle folds in TensorFlow's global seed, which
    # the first run sets (as set_random_seed): set it alike before both.
    keras.utils.set_random_seed(base.seed)
    single = experiment.train_and_evaluate(
        dataclasses.replace(base, strategy="one_device", batchnorm=False,
                            model_dir=os.path.join(runs, "single")),
        loop="trainer")
    print("=== pipeline ===", flush=True)
    keras.utils.set_random_seed(base.seed)
    piped = experiment.train_and_evaluate(
        dataclasses.replace(base, pipeline_stages=2, micro_batches=4,
                            model_dir=os.path.join(runs, "pipeline")),
        loop="trainer")
    a, b = _tensors(single["model_dir"]), _tensors(piped["model_dir"])
    numbers = [k for k in a if isinstance(a[k], (np.ndarray, np.number))]
    result = {
        "single": single, "pipeline": piped,
        "same_keys": sorted(a) == sorted(b),
        "num_tensors": len(numbers),
        "tensor_diff": max(float(np.max(np.abs(a[k] - b[k])))
                           for k in numbers),
    }
    with open(out, "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
