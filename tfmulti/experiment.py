"""An end-to-end training run, configured once: what the recipes call.

`train_and_evaluate(config, loop=...)` sets up devices, the strategy, the
TFDS input pipeline and a small CNN, trains with Keras `model.fit` or with
`tfmulti.Trainer`, and writes checkpoints, TensorBoard events and
`metrics.json` to `config.model_dir`. The recipes only turn flags into an
`ExperimentConfig` (Flax's `main.py` / `train.py` split: the logic is here,
where tests can run it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Any

DEFAULT_DATASET = "tfmulti_shapes"
LOOPS = ("fit", "trainer")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything a recipe run needs; see `tfmulti.flags` for each field."""

    strategy: str = "auto"
    cpu_replicas: int = 0
    num_gpus: int | None = None
    all_reduce: str = "auto"
    pack_bytes: int | None = None
    allreduce_dtype: str | None = None
    dataset: str = DEFAULT_DATASET
    data_dir: str | None = None
    global_batch_size: int = 128
    epochs: int = 3
    steps: int | None = None
    learning_rate: float = 1e-3
    base_batch_size: int = 128
    lr_scaling: str | None = "linear"
    warmup_steps: int = 0
    grad_accum_steps: int = 1
    clip_global_norm: float | None = None
    mixed_precision: str | None = None
    sync_batchnorm: bool = False
    steps_per_loop: int = 50
    model_dir: str = "/tmp/tfmulti"
    seed: int = 0
    pipeline_stages: int = 1
    micro_batches: int = 1

    def __post_init__(self):
        if self.cpu_replicas and self.num_gpus:
            raise ValueError(
                f"`cpu_replicas`={self.cpu_replicas} and `num_gpus`="
                f"{self.num_gpus} were both given; simulate CPU replicas or "
                "use GPUs, not both.")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"`steps` should be positive, got {self.steps}.")
        if self.pipeline_stages > 1:
            _check_pipeline(self)
        elif self.micro_batches != 1:
            raise ValueError(
                f"`micro_batches`={self.micro_batches} needs "
                "`pipeline_stages` > 1; for micro-batches on one model, use "
                "grad_accum_steps.")
        if not self.model_dir:
            raise ValueError("`model_dir` is empty; give a directory for "
                             "checkpoints, events and metrics.json.")


def _check_pipeline(config: ExperimentConfig) -> None:
    """Options the pipeline's own loop does not implement."""
    unsupported = {"grad_accum_steps": config.grad_accum_steps != 1,
                   "clip_global_norm": config.clip_global_norm is not None,
                   "mixed_precision": config.mixed_precision is not None,
                   "sync_batchnorm": config.sync_batchnorm,
                   "allreduce_dtype": config.allreduce_dtype is not None,
                   "num_gpus": bool(config.num_gpus)}
    for name, given in unsupported.items():
        if given:
            raise ValueError(
                f"`{name}`={getattr(config, name)!r} is not supported with "
                f"`pipeline_stages`={config.pipeline_stages}; drop it (use "
                "micro_batches for smaller pieces of the batch; the "
                "pipeline uses every visible GPU).")


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Writes `payload` to `path` so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                               suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def train_and_evaluate(config: ExperimentConfig, *, loop: str = "fit"
                       ) -> dict[str, Any]:
    """Runs one experiment and returns what it writes to metrics.json.

    Args:
      config: the experiment.
      loop: "fit" (Keras `model.fit` through `tfmulti.keras.distributed`)
        or "trainer" (`tfmulti.Trainer`).

    Returns:
      The metrics dict (final train and eval metrics, examples/s, the
      config, versions); the chief also writes it to
      `config.model_dir/metrics.json`.
    """
    if loop not in LOOPS:
        raise ValueError(f"`loop` is {loop!r}; valid values are {list(LOOPS)}.")
    # Devices and the strategy first: TensorFlow fixes both on first use.
    from tfmulti import cluster as cluster_lib
    from tfmulti import devices
    from tfmulti import strategies
    if config.cpu_replicas:
        devices.simulate_devices(config.cpu_replicas)
    if config.pipeline_stages > 1:
        from tfmulti.pipeline import recipe
        return recipe.train_and_evaluate(config)
    strategy = strategies.create_strategy(
        config.strategy, num_gpus=config.num_gpus,
        all_reduce=config.all_reduce, pack_bytes=config.pack_bytes)

    import keras
    import tensorflow as tf
    import tfmulti
    from tfmulti import models

    if config.mixed_precision:
        keras.mixed_precision.set_global_policy(config.mixed_precision)
    examples_per_update = config.global_batch_size * config.grad_accum_steps
    info, train, test, steps_per_epoch, total_steps = input_data(
        config, strategy, examples_per_update=examples_per_update)
    image_key, label_key = info.supervised_keys
    num_classes = info.features[label_key].num_classes

    with strategy.scope():
        keras.utils.set_random_seed(config.seed)
        model = models.small_cnn(info.features[image_key].shape,
                                  num_classes)
        if config.sync_batchnorm:
            tfmulti.keras.sync_batchnorm(model)
        optimizer = keras.optimizers.Adam(learning_rate(
            config, examples_per_update=examples_per_update))
        accuracy = keras.metrics.SparseCategoricalAccuracy("accuracy")

    start = time.perf_counter()
    if loop == "trainer":
        trainer = tfmulti.Trainer(
            model, optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None),
            strategy=strategy, metrics=[accuracy],
            grad_accum_steps=config.grad_accum_steps,
            clip_global_norm=config.clip_global_norm,
            allreduce_dtype=config.allreduce_dtype,
            steps_per_loop=config.steps_per_loop,
            mixed_precision=config.mixed_precision,
            model_dir=config.model_dir)
        history = trainer.fit(train, steps=total_steps, eval_data=test,
                              eval_every=steps_per_epoch,
                              global_batch_size=config.global_batch_size)
        seconds = time.perf_counter() - start
        evaluation = trainer.evaluate(test)
        final_train = {k: v[-1] for k, v in history.items() if v}
    else:
        with strategy.scope():
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                # Weighted: eval batches carry weight 0 on padding.
                weighted_metrics=["accuracy"],
                steps_per_execution=config.steps_per_loop)
        model = tfmulti.keras.distributed(
            model, grad_accum_steps=config.grad_accum_steps,
            clip_global_norm=config.clip_global_norm,
            allreduce_dtype=config.allreduce_dtype)
        epochs = max(1, -(-total_steps // steps_per_epoch))
        history = model.fit(
            train, epochs=epochs, steps_per_epoch=min(total_steps,
                                                      steps_per_epoch),
            validation_data=test, verbose=2,
            callbacks=tfmulti.keras.callbacks(config.model_dir))
        seconds = time.perf_counter() - start
        evaluation = model.evaluate(test, verbose=0, return_dict=True)
        final_train = {k: v[-1] for k, v in history.history.items()
                       if not k.startswith("val_")}
    metrics = {
        "loop": loop,
        "train": _floats(final_train),
        "eval": _floats(evaluation),
        "steps": total_steps,
        "examples_per_sec": total_steps * examples_per_update / seconds,
        "num_replicas": strategy.num_replicas_in_sync,
        "config": dataclasses.asdict(config),
        "versions": {"tfmulti": tfmulti.__version__,
                     "tensorflow": tf.__version__,
                     "keras": keras.__version__},
    }
    if cluster_lib.cluster_config().is_chief:
        write_json_atomically(os.path.join(config.model_dir, "metrics.json"),
                              metrics)
    return metrics


def input_data(config: ExperimentConfig, strategy, *,
               examples_per_update: int):
    """(TFDS info, train and test datasets, steps per epoch, total steps)."""
    from tfmulti import data
    train_fn = data.tfds_dataset_fn(config.dataset, "train",
                                    data_dir=config.data_dir)
    test_fn = data.tfds_dataset_fn(config.dataset, "test",
                                   data_dir=config.data_dir)
    info = train_fn.builder.info
    steps_per_epoch = max(1, info.splits["train"].num_examples //
                          examples_per_update)
    total_steps = config.steps or config.epochs * steps_per_epoch
    train = data.distribute_dataset(
        strategy, train_fn, global_batch_size=config.global_batch_size,
        seed=config.seed)
    test = data.distribute_dataset(
        strategy, test_fn, global_batch_size=config.global_batch_size,
        training=False)
    return info, train, test, steps_per_epoch, total_steps


def learning_rate(config: ExperimentConfig, *, examples_per_update: int):
    """The configured learning rate (or schedule) for this update size."""
    from tfmulti import schedules
    if not (config.lr_scaling or config.warmup_steps):
        return config.learning_rate
    return schedules.scaled_learning_rate(
        config.learning_rate, base_batch_size=config.base_batch_size,
        global_batch_size=examples_per_update if config.lr_scaling
        else config.base_batch_size, rule=config.lr_scaling or "linear",
        warmup_steps=config.warmup_steps)


def _floats(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
