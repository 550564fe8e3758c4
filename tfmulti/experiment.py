"""An end-to-end training run, configured once: what the recipes call.

`train_and_evaluate(config, loop=...)` sets up devices, the strategy, the
TFDS input pipeline and a small CNN, trains with Keras `model.fit` or with
`tfmulti.Trainer`, and writes `config.json`, checkpoints, TensorBoard events
and `metrics.json` to the run's directory (`tfmulti.rundir`: a new
`./runs/<recipe>-<time>` unless `model_dir` is given; an existing run is
continued only with `resume`). It prints where the run goes, progress lines
and a closing summary (chief only). The recipes only turn flags into an
`ExperimentConfig` (Flax's `main.py` / `train.py` split: the logic is here,
where tests can run it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

from tfmulti import balance as balance_lib
from tfmulti import exit_codes, run_end, rundir
from tfmulti import experiment_config as config_lib
# The configuration, with the run that takes it.
from tfmulti.experiment_config import ConfigError, ExperimentConfig

LOOPS = ("fit", "trainer")
# The default run directory is named after the recipe that runs the loop.
RECIPE_NAMES = {"fit": "keras_fit", "trainer": "custom_loop"}
# What a resumed run must share with the saved one: what is trained, not
# where or on how many devices (those may change between restarts).
RESUME_MUST_MATCH = (
    "loop", "dataset", "global_batch_size", "epochs", "steps",
    "learning_rate", "base_batch_size", "lr_scaling", "warmup_steps",
    "grad_accum_steps", "clip_global_norm", "mixed_precision",
    "sync_batchnorm", "batchnorm", "seed", "sync_every", "sync_warmup_steps",
    "outer_learning_rate", "outer_momentum", "compression", "powersgd_rank",
    "powersgd_start_iter", "async_warmup_steps")


def _open_run_dir(config: ExperimentConfig, loop: str) -> rundir.RunDir:
    """Every worker decides alike, before the strategy (a barrier) exists."""
    from tfmulti import cluster as cluster_lib
    model_dir = config.model_dir
    if model_dir is None:
        if (cluster_lib.cluster_config().num_workers > 1 and
                rundir.RUN_ID_ENV not in os.environ):
            raise ConfigError(
                "`--model_dir` is needed for a multi-worker run outside "
                "tfmulti-launch: every worker must write and read the same "
                "directory, on storage they all reach.", flag="model_dir")
        model_dir = rundir.default_model_dir(RECIPE_NAMES[loop])
    # A group restarted by tfmulti-launch continues where it failed.
    resume = config.resume or exit_codes.launch_attempt() > 0
    try:
        run = rundir.open_run_dir(
            model_dir, config=_identity(config, loop), resume=resume,
            compared=RESUME_MUST_MATCH)
        # Fail now, naming the path, where the end would fail to write.
        rundir.check_output_dir(run.path)
    except ValueError as e:
        raise ConfigError(str(e), flag="model_dir") from None
    return run


def _identity(config: ExperimentConfig, loop: str) -> dict[str, Any]:
    return {"loop": loop, **dataclasses.asdict(config)}


def train_and_evaluate(config: ExperimentConfig, *, loop: str = "fit",
                       verbose: bool = True) -> dict[str, Any]:
    """Runs one experiment and returns what it writes to metrics.json.

    Args:
      config: the experiment.
      loop: "fit" (Keras `model.fit` through `tfmulti.keras.distributed`)
        or "trainer" (`tfmulti.Trainer`).
      verbose: print the run directory, progress lines and the closing
        summary (chief only).

    Returns:
      The metrics dict (final train and eval metrics, examples/s, the
      config, versions, the run directory); the chief also writes it to
      `metrics.json` in the run directory.

    Raises:
      ConfigError: a bad or inconsistent setting (names the flag).
      tfmulti.rundir.NothingToTrain: `resume` and the run has finished.
    """
    began = time.perf_counter()
    if loop not in LOOPS:
        raise ConfigError(f"`loop` is {loop!r}; valid values are "
                          f"{list(LOOPS)}.")
    if config.pipeline_stages > 1 and loop != "trainer":
        raise ConfigError(
            f"`pipeline_stages`={config.pipeline_stages} needs the Trainer "
            f"loop, but this recipe runs `loop`={loop!r} (its Keras fit "
            "feeds distributed datasets and padded, weighted evaluation "
            "batches, which a pipelined model does not take). Run `python "
            "-m recipes.custom_loop` with the same flags.",
            flag="pipeline_stages")
    if config.pipeline_stages > 1:
        config_lib.check_pipeline_process(config)
    if config.balance:
        config_lib.check_balance(config)
    length_defaulted = config.epochs is None and config.steps is None
    config = config_lib.with_default_epochs(config)
    run = _open_run_dir(config, loop)
    model_dir = run.path
    config_lib.check_dataset(config.dataset)
    # Devices and the strategy first: TensorFlow fixes both on first use.
    from tfmulti import cluster as cluster_lib
    from tfmulti import devices
    from tfmulti import strategies
    if config.cpu_replicas:
        devices.simulate_devices(config.cpu_replicas)
    if config.pipeline_stages > 1:
        from tfmulti.pipeline import recipe_plan
        plan = recipe_plan.plan(config)
        if len(plan.devices) < plan.stages:
            raise ConfigError(
                f"`pipeline_stages`={plan.stages} needs {plan.stages} "
                f"devices, but {len(plan.devices)} are visible. Pass fewer "
                f"stages, or on a CPU --cpu_replicas={plan.stages}.",
                flag="pipeline_stages")
        config_lib.check_batch(config, plan.data_parallel * plan.micro_batches,
                     f"micro-batches ({plan.data_parallel} group(s) x "
                     f"{plan.micro_batches})")
        # The input pipeline feeds global batches from the first device;
        # the stages run on their own devices.
        strategy = strategies.create_strategy("one_device",
                                              devices=plan.devices[:1])
    else:
        plan = None
        strategy = strategies.create_strategy(
            config.strategy, num_gpus=config.num_gpus,
            all_reduce=config.all_reduce, pack_bytes=config.pack_bytes,
            startup_timeout_seconds=config.startup_timeout)
        config_lib.check_batch(config, strategy.num_replicas_in_sync)
    cluster = cluster_lib.of_strategy(strategy)
    is_chief = cluster.is_chief

    import keras
    import tensorflow as tf
    import tfmulti
    from tfmulti import models
    from tfmulti import parameter_server
    from tfmulti import progress

    versions = {"tfmulti": tfmulti.__version__, "tensorflow": tf.__version__,
                "keras": keras.__version__}
    examples_per_update = config.global_batch_size * config.grad_accum_steps
    steps_per_epoch, total_steps = run_end.run_length(
        config, examples_per_update=examples_per_update)
    reached = run_end.check_end(config, run, loop, total_steps)
    if is_chief:
        now = rundir.timestamp()
        saved = run.saved_config or {}
        rundir.write_json_atomically(
            os.path.join(model_dir, rundir.CONFIG_FILE),
            {"config": _identity(config, loop),
             "versions": saved.get("versions", versions),
             "started": saved.get("started", now),
             "ends": run.ends(_identity(config, loop), total_steps, now),
             **({"pipeline": plan.record()} if plan else {})})
        if verbose:
            where = (f"resuming {model_dir} at step {reached}"
                     if run.resuming and reached else
                     f"resuming {model_dir}" if run.resuming else
                     f"run directory: {model_dir}")
            print(f"{where} (to step {total_steps})" if run.resuming else
                  where, flush=True)
            print(progress.device_line(
                replicas=strategy.num_replicas_in_sync,
                device_type="GPU" if any(
                    "GPU" in d.upper() for d in getattr(
                        strategy.extended, "worker_devices", ())) else "CPU",
                workers=len(cluster.cluster.get("worker", ())) if (
                    cluster.num_ps) else cluster.num_workers,
                gpus_found=len(tf.config.list_physical_devices("GPU")),
                parameter_servers=cluster.num_ps), flush=True)
            if plan and plan.model_note:
                print(plan.model_note, flush=True)

    if config.mixed_precision:
        keras.mixed_precision.set_global_policy(config.mixed_precision)
    info, train, test = input_data(config, strategy)
    image_key, label_key = info.supervised_keys
    num_classes = info.features[label_key].num_classes
    if parameter_server.is_parameter_server(strategy) and loop != "trainer":
        raise ValueError(
            "Keras `model.fit` does not run under ParameterServerStrategy "
            "(keras-team/keras#18624). Use recipes.custom_loop, whose "
            "Trainer trains asynchronously under it.")

    # A pipeline places its stages itself, outside any strategy.
    with strategy.scope() if plan is None else contextlib.nullcontext():
        keras.utils.set_random_seed(config.seed)
        model = models.small_cnn(
            info.features[image_key].shape, num_classes,
            batch_norm=plan.batch_norm if plan else config.batchnorm)
        if config.sync_batchnorm:
            tfmulti.keras.sync_batchnorm(model)
        optimizer = keras.optimizers.Adam(config_lib.learning_rate(
            config, examples_per_update=examples_per_update))
        accuracy = keras.metrics.SparseCategoricalAccuracy("accuracy")

    sync, compression = config.communication_options()
    if is_chief and verbose:
        for note in config_lib.length_notes(config, compression, total_steps,
                                  parameter_server.is_parameter_server(
                                      strategy), length_defaulted):
            print(note, flush=True)
    progress_logger = progress.ProgressLogger(
        total_steps=total_steps,
        steps_per_epoch=min(total_steps, steps_per_epoch),
        examples_per_step=examples_per_update, is_chief=is_chief and verbose)
    from tfmulti.keras import backup as backup_lib
    checkpoints = (model_dir if loop == "trainer" else
                   os.path.join(model_dir, backup_lib.CHECKPOINT_DIR))
    start = time.perf_counter()
    try:
        if loop == "trainer":
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=None)
            if plan is None:
                trained = dict(model=model, optimizer=optimizer, loss=loss,
                               strategy=strategy)
            else:
                # The PipelinedModel owns its optimizers, loss and devices.
                trained = dict(model=plan.build(model, optimizer, loss),
                               optimizer=None, loss=None, strategy=None)
            trainer = tfmulti.Trainer(
                **trained, metrics=[accuracy],
                grad_accum_steps=config.grad_accum_steps,
                clip_global_norm=config.clip_global_norm,
                allreduce_dtype=config.allreduce_dtype,
                steps_per_loop=config.steps_per_loop,
                mixed_precision=config.mixed_precision,
                model_dir=model_dir, sync=sync, compression=compression,
                balance=balance_lib.from_flag(config.balance),
                shard_optimizer_state=config.shard_optimizer_state,
                **({"async_warmup_steps": config.async_warmup_steps}
                   if config.async_warmup_steps is not None else {}))
            history = trainer.fit(train, steps=total_steps, eval_data=test,
                                  eval_every=steps_per_epoch,
                                  global_batch_size=config.global_batch_size,
                                  callbacks=[progress_logger], verbose=0)
            seconds = time.perf_counter() - start
            evaluation = trainer.evaluate(test)
            traffic = trainer.communication
            sharding = getattr(trainer.runner, "sharding", None)
            balance_history = trainer.balance_history
            final_train = {k: history[k][-1] for k in
                           ("loss", *[m.name for m in trainer.metrics])
                           if history.get(k)}
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
                allreduce_dtype=config.allreduce_dtype, sync=sync,
                compression=compression,
                shard_optimizer_state=config.shard_optimizer_state,
                balance=balance_lib.from_flag(config.balance))
            epochs = max(1, -(-total_steps // steps_per_epoch))
            # The final backup stays: a later --resume with a larger
            # --steps/--epochs continues from it.
            history = model.fit(
                train, epochs=epochs, steps_per_epoch=min(total_steps,
                                                          steps_per_epoch),
                validation_data=test, verbose=0,
                callbacks=[*tfmulti.keras.callbacks(model_dir,
                                                    keep_backup=True),
                           run_end.stop_at(total_steps), progress_logger])
            seconds = time.perf_counter() - start
            evaluation = model.evaluate(test, verbose=0, return_dict=True)
            traffic = tfmulti.keras.communication(model)
            sharding = tfmulti.keras.fit_state.sharding_of(model)
            balanced_fit = tfmulti.keras.fit_state.balance_of(model)
            balance_history = balanced_fit and balanced_fit.history
            final_train = {k: v[-1] for k, v in history.history.items()
                           if not k.startswith("val_")}
    except BaseException as e:
        if is_chief and verbose:
            print(progress.stopped_summary(
                progress_logger, reason=run_end.stop_reason(e),
                num_replicas=strategy.num_replicas_in_sync,
                model_dir=model_dir, checkpoints=checkpoints,
                wall_seconds=time.perf_counter() - began), flush=True)
        raise
    metrics = {
        "loop": loop,
        "train": _floats(final_train),
        "eval": _floats(evaluation),
        "steps": total_steps,
        # The step this process continued from (None: a new run).
        "resumed_at": reached if run.resuming else None,
        "seconds": seconds,
        "examples_per_sec": max(0, progress_logger.step - (
            reached or progress_logger.first_step)) * examples_per_update
        / seconds,
        "num_replicas": plan.data_parallel if plan else
        strategy.num_replicas_in_sync,
        **({"pipeline": plan.metrics(trained["model"])} if plan else {}),
        "model_dir": model_dir,
        # This worker's gradient / parameter all-reduces, as issued.
        "communication": traffic,
        **({} if plan or parameter_server.is_parameter_server(strategy)
           else _optimizer_state_bytes(strategy, optimizer, sharding)),
        **({"balance": balance_history} if config.balance else {}),
        **_data_service_metrics(config),
        "config": _identity(config, loop),
        "versions": versions,
    }
    if is_chief:
        rundir.write_json_atomically(
            os.path.join(model_dir, rundir.METRICS_FILE), metrics)
        if verbose:
            print(progress.summary(
                metrics, model_dir=model_dir, checkpoints=checkpoints,
                wall_seconds=time.perf_counter() - began), flush=True)
    return metrics


def input_data(config: ExperimentConfig, strategy):
    """(TFDS info, train and test datasets); `run_length` gives the steps."""
    import tensorflow as tf
    from tfmulti import data, parameter_server
    train_fn = data.tfds_dataset_fn(config.dataset, "train",
                                    data_dir=config.data_dir)
    test_fn = data.tfds_dataset_fn(config.dataset, "test",
                                   data_dir=config.data_dir)
    info = train_fn.builder.info
    if parameter_server.is_parameter_server(strategy):
        # Asynchronous mode: every worker reads train_fn itself; the chief
        # evaluates on batches of its own.
        test = data.build_pipeline(test_fn, tf.distribute.InputContext(),
                                   data.PipelineOptions(
                                       global_batch_size=config.
                                       global_batch_size, training=False))
        return info, train_fn, test
    test = data.distribute_dataset(
        strategy, test_fn, global_batch_size=config.global_batch_size,
        training=False, service=config.data_service)
    if config.balance:
        # The Trainer (or `fit`) cuts each of these global batches by the
        # shares: the same seeded stream on every worker, in both loops.
        from tfmulti.data import balanced
        return info, balanced.global_batches(
            train_fn, global_batch_size=config.global_batch_size,
            seed=config.seed), test
    train = data.distribute_dataset(
        strategy, train_fn, global_batch_size=config.global_batch_size,
        seed=config.seed, service=config.data_service)
    return info, train, test


def _data_service_metrics(config: ExperimentConfig) -> dict:
    """Where this worker's input came from and, per pipeline and epoch,
    the elements lost with a data worker that died (none: [])."""
    from tfmulti.data import service
    address = service.resolve_address(config.data_service)
    if address is None:
        return {}
    return {"data_service": {"address": address, "lost": service.losses()}}


def _optimizer_state_bytes(strategy, optimizer, sharding) -> dict:
    """The optimizer state's bytes by device, read from where its variables
    live, for sharded and unsharded runs alike (see
    `optimizer_memory.state_bytes`); synchronous runs only (a pipeline's
    stage optimizers and a parameter server's variables are other
    accounts)."""
    from tfmulti.training import optimizer_memory
    per_device, host = optimizer_memory.state_bytes(strategy, optimizer,
                                                    sharding)
    return {"optimizer_state_bytes_per_device": per_device,
            "optimizer_state_bytes_host": host}


def _floats(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
