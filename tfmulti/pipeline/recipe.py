"""The recipes' run with `--pipeline_stages=S --micro_batches=M`.

`experiment.train_and_evaluate` hands a config with `pipeline_stages > 1`
here: the example CNN is cut into S stages over the devices (D = devices // S
data-parallel groups) and trained with `PipelinedModel`'s own loop, on the
same TFDS input pipeline, with the same metrics.json. The Trainer's and
`fit`'s strategy-based steps run every replica's whole model; the pipeline
step runs stages, so it has its own (small) loop.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any


def train_and_evaluate(config) -> dict[str, Any]:
    """Trains and evaluates `config` as a pipeline; returns the metrics.

    Call after `simulate_devices` (the caller's first step).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti
    from tfmulti import experiment
    from tfmulti import models
    from tfmulti.pipeline import model as model_lib
    from tfmulti.pipeline import placement

    devices = placement.available_devices()
    stages = config.pipeline_stages
    groups = max(1, len(devices) // stages)
    # The input pipeline feeds global batches from the first device.
    strategy = tfmulti.create_strategy("one_device", devices=devices[:1])
    info, train, test, _, total_steps = experiment.input_data(
        config, strategy, examples_per_update=config.global_batch_size)
    image_key, label_key = info.supervised_keys
    keras.utils.set_random_seed(config.seed)
    # BatchNormalization would normalise each micro-batch on its own
    # (PipelinedModel refuses it), so the example CNN leaves it out then.
    split_batch = config.micro_batches * groups > 1
    model = models.small_cnn(info.features[image_key].shape,
                             info.features[label_key].num_classes,
                             batch_norm=not split_batch)
    pipe = model_lib.PipelinedModel(
        model, optimizer=keras.optimizers.Adam(experiment.learning_rate(
            config, examples_per_update=config.global_batch_size)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None),
        num_stages=stages, micro_batches=config.micro_batches,
        data_parallel=groups, devices=devices)
    start = time.perf_counter()
    losses = pipe.fit(iter(train), steps=total_steps)
    seconds = time.perf_counter() - start
    correct = total = 0.0
    for x, y, weight in test:
        predicted = np.argmax(pipe.predict(x), axis=-1)
        correct += float(np.sum((predicted == y.numpy()) * weight.numpy()))
        total += float(np.sum(weight.numpy()))
    os.makedirs(config.model_dir, exist_ok=True)
    pipe.save_weights(os.path.join(config.model_dir,
                                   "pipelined.weights.h5"))
    metrics = {
        "loop": "pipeline",
        "train": {"loss": losses[-1]},
        "eval": {"accuracy": correct / max(total, 1.0)},
        "steps": total_steps,
        "examples_per_sec": total_steps * config.global_batch_size / seconds,
        "num_replicas": groups,
        "pipeline": {"stages": stages, "micro_batches": config.micro_batches,
                     "data_parallel": groups, "cuts": list(pipe.cuts),
                     "parameter_bytes_per_device":
                         pipe.parameter_bytes_per_device()},
        "config": dataclasses.asdict(config),
        "versions": {"tfmulti": tfmulti.__version__,
                     "tensorflow": tf.__version__,
                     "keras": keras.__version__},
    }
    experiment.write_json_atomically(
        os.path.join(config.model_dir, "metrics.json"), metrics)
    return metrics
