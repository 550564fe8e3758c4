"""The recipes' run with `--pipeline_stages=S --micro_batches=M`.

`experiment.train_and_evaluate` hands a config with `pipeline_stages > 1`
here: the example CNN is cut into S stages over the devices (D = devices // S
data-parallel groups) and trained by `tfmulti.Trainer`, on the same TFDS
input pipeline, with the same checkpoints in `model_dir`, evaluation every
epoch, config.json and metrics.json as the unsplit Trainer run. Only the
custom-loop recipe takes it (`experiment` refuses it for Keras `fit`, which
cannot run a model in stages).
"""

from __future__ import annotations

import os
import time
from typing import Any


def train_and_evaluate(config, *, run) -> dict[str, Any]:
    """Trains and evaluates `config` as a pipeline; returns the metrics.

    Call after `simulate_devices` (the caller's first step), with the run
    directory `run` (`tfmulti.rundir.RunDir`) the caller opened.
    """
    import keras
    import tensorflow as tf

    import tfmulti
    from tfmulti import experiment
    from tfmulti import models
    from tfmulti import rundir
    from tfmulti.pipeline import model as model_lib
    from tfmulti.pipeline import placement

    devices = placement.available_devices()
    stages = config.pipeline_stages
    groups = max(1, len(devices) // stages)
    # The input pipeline feeds global batches from the first device.
    strategy = tfmulti.create_strategy("one_device", devices=devices[:1])
    info, train, test, steps_per_epoch, total_steps = experiment.input_data(
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
    versions = {"tfmulti": tfmulti.__version__, "tensorflow": tf.__version__,
                "keras": keras.__version__}
    if not run.resuming:
        experiment.write_json_atomically(
            os.path.join(run.path, rundir.CONFIG_FILE),
            {"config": experiment._identity(config, "trainer"),
             "versions": versions, "started": rundir.timestamp()})
    trainer = tfmulti.Trainer(
        pipe, metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
        steps_per_loop=config.steps_per_loop, model_dir=run.path)
    start = time.perf_counter()
    history = trainer.fit(train, steps=total_steps, eval_data=test,
                          eval_every=steps_per_epoch,
                          global_batch_size=config.global_batch_size)
    seconds = time.perf_counter() - start
    metrics = {
        "loop": "trainer",
        "train": {k: float(v[-1]) for k, v in history.items()
                  if v and not k.startswith("val_")},
        "eval": trainer.evaluate(test),
        "steps": total_steps,
        "examples_per_sec": total_steps * config.global_batch_size / seconds,
        "num_replicas": groups,
        "pipeline": {"stages": stages, "micro_batches": config.micro_batches,
                     "data_parallel": groups, "cuts": list(pipe.cuts),
                     "parameter_bytes_per_device":
                         pipe.parameter_bytes_per_device(),
                     "optimizer_checkpoint":
                         pipe.checkpoint_optimizer()[1]},
        "model_dir": run.path,
        "config": experiment._identity(config, "trainer"),
        "versions": versions,
    }
    experiment.write_json_atomically(
        os.path.join(run.path, rundir.METRICS_FILE), metrics)
    return metrics
