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
    from tfmulti import data
    from tfmulti import experiment
    from tfmulti import models
    from tfmulti.pipeline import model as model_lib
    from tfmulti.pipeline import placement

    devices = placement.available_devices()
    stages = config.pipeline_stages
    groups = max(1, len(devices) // stages)
    # The input pipeline feeds global batches from the first device.
    strategy = tfmulti.create_strategy("one_device", devices=devices[:1])
    train_fn = data.tfds_dataset_fn(config.dataset, "train",
                                    data_dir=config.data_dir)
    test_fn = data.tfds_dataset_fn(config.dataset, "test",
                                   data_dir=config.data_dir)
    info = train_fn.builder.info
    image_key, label_key = info.supervised_keys
    steps_per_epoch = max(1, info.splits["train"].num_examples //
                          config.global_batch_size)
    total_steps = config.steps or config.epochs * steps_per_epoch
    train = data.distribute_dataset(
        strategy, train_fn, global_batch_size=config.global_batch_size,
        seed=config.seed)
    test = data.distribute_dataset(
        strategy, test_fn, global_batch_size=config.global_batch_size,
        training=False)
    keras.utils.set_random_seed(config.seed)
    # BatchNormalization would normalise each micro-batch on its own
    # (PipelinedModel refuses it), so the example CNN leaves it out then.
    split_batch = config.micro_batches * groups > 1
    model = models.small_cnn(info.features[image_key].shape,
                             info.features[label_key].num_classes,
                             batch_norm=not split_batch)
    learning_rate = config.learning_rate
    if config.lr_scaling or config.warmup_steps:
        learning_rate = tfmulti.scaled_learning_rate(
            config.learning_rate, base_batch_size=config.base_batch_size,
            global_batch_size=config.global_batch_size if config.lr_scaling
            else config.base_batch_size, rule=config.lr_scaling or "linear",
            warmup_steps=config.warmup_steps)
    pipe = model_lib.PipelinedModel(
        model, optimizer=keras.optimizers.Adam(learning_rate),
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
