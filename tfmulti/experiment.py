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
import difflib
import json
import os
import tempfile
import time
from typing import Any

from tfmulti import balance as balance_lib
from tfmulti import exit_codes, rundir

DEFAULT_DATASET = "tfmulti_shapes"
LOOPS = ("fit", "trainer")
COMPRESSIONS = ("none", "powersgd")
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


class ConfigError(ValueError):
    """A bad setting of the experiment (a usage error for a recipe).

    Attributes:
      flag: the recipe flag to fix (its help is shown with the message).
    """

    def __init__(self, message: str, *, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything a recipe run needs; see `tfmulti.flags` for each field."""

    strategy: str = "auto"
    cpu_replicas: int = 0
    num_gpus: int | None = None
    all_reduce: str = "auto"
    pack_bytes: int | None = None
    startup_timeout: float | None = None
    allreduce_dtype: str | None = None
    dataset: str = DEFAULT_DATASET
    data_dir: str | None = None
    data_service: str | None = None  # tf.data service dispatcher host:port
    global_batch_size: int = 128
    # None: DEFAULT_EPOCHS, or ASYNC_DEFAULT_EPOCHS with parameter servers.
    epochs: int | None = None
    steps: int | None = None
    learning_rate: float = 1e-3
    base_batch_size: int = 128
    lr_scaling: str | None = "linear"
    warmup_steps: int = 0
    grad_accum_steps: int = 1
    clip_global_norm: float | None = None
    mixed_precision: str | None = None
    sync_batchnorm: bool = False
    batchnorm: bool = True
    steps_per_loop: int = 50
    # None: a new directory under ./runs (see `tfmulti.rundir`).
    model_dir: str | None = None
    resume: bool = False
    seed: int = 0
    pipeline_stages: int = 1
    micro_batches: int = 1
    sync_every: int = 1
    sync_warmup_steps: int = 0
    outer_learning_rate: float = 1.0
    outer_momentum: float = 0.0
    compression: str = "none"
    powersgd_rank: int = 4
    # None: the library's defaults (tfmulti.PowerSGD's start_iter, the
    # asynchronous Trainer's warm-up).
    powersgd_start_iter: int | None = None
    async_warmup_steps: int | None = None
    # None, "auto" or comma-separated weights ("3,1"): `Trainer(balance=)`.
    balance: str | None = None

    def __post_init__(self):
        if self.cpu_replicas and self.num_gpus:
            raise ConfigError(
                f"`cpu_replicas`={self.cpu_replicas} and `num_gpus`="
                f"{self.num_gpus} were both given; simulate CPU replicas or "
                "use GPUs, not both.", flag="cpu_replicas")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"`steps` should be positive, got "
                              f"{self.steps}.", flag="steps")
        if self.sync_batchnorm and not self.batchnorm:
            raise ConfigError(
                "`sync_batchnorm`=True synchronises BatchNormalization, but "
                "`batchnorm`=False leaves it out of the model. Drop one of "
                "them.", flag="sync_batchnorm")
        if self.pipeline_stages == 1 and self.micro_batches != 1:
            raise ConfigError(
                f"`micro_batches`={self.micro_batches} needs "
                "`pipeline_stages` > 1; for micro-batches on one model, use "
                "grad_accum_steps.", flag="micro_batches")
        if self.startup_timeout is not None and not self.startup_timeout > 0:
            raise ConfigError(f"`startup_timeout` should be positive seconds, "
                              f"got {self.startup_timeout!r}.",
                              flag="startup_timeout")
        if self.model_dir == "":
            raise ConfigError("`model_dir` is empty; give a directory for "
                              "checkpoints, events and metrics.json, or "
                              "leave it out for a new one under ./runs.",
                              flag="model_dir")
        try:
            balance_lib.from_flag(self.balance)
        except ValueError as e:
            raise ConfigError(str(e), flag="balance") from None
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"`compression` is {self.compression!r}; valid "
                              f"values are {list(COMPRESSIONS)}.",
                              flag="compression")
        if self.sync_warmup_steps and self.sync_every == 1:
            raise ConfigError(
                f"`sync_warmup_steps`={self.sync_warmup_steps} warms up local "
                "SGD, but `sync_every` is 1 (every update is synchronous). "
                "Pass sync_every > 1, or leave sync_warmup_steps at 0.",
                flag="sync_warmup_steps")
        if (self.powersgd_start_iter is not None and
                self.compression != "powersgd"):
            raise ConfigError(
                f"`powersgd_start_iter`={self.powersgd_start_iter} delays "
                "PowerSGD, but `compression` is "
                f"{self.compression!r}. Pass compression=powersgd, or leave "
                "powersgd_start_iter at 0.", flag="powersgd_start_iter")
        if self.async_warmup_steps is not None and self.strategy not in (
                "parameter_server", "auto"):
            raise ConfigError(
                f"`async_warmup_steps`={self.async_warmup_steps} warms up "
                "asynchronous updates, but `strategy` is "
                f"{self.strategy!r}. Pass strategy=parameter_server, or use "
                "warmup_steps for a synchronous run.",
                flag="async_warmup_steps")
        if (self.sync_every, self.outer_learning_rate, self.outer_momentum,
                self.compression) != (1, 1.0, 0.0, "none"):
            # Built here so that bad values fail before any training; only
            # when asked for, as it imports TensorFlow.
            try:
                self.communication_options()
            except ValueError as e:
                raise ConfigError(str(e), flag="compression" if (
                    self.compression != "none") else "sync_every") from None
        if self.pipeline_stages > 1:
            _check_pipeline(self)

    def communication_options(self):
        """(sync, compression) for the Trainer / `tfmulti.keras.distributed`.

        `sync_every` 1 with outer learning rate 1 and momentum 0 is the
        synchronous update; anything else is local SGD (DiLoCo with an
        outer learning rate or momentum).
        """
        from tfmulti.training import local_sgd, powersgd, reducers
        outer = None
        if (self.outer_learning_rate, self.outer_momentum) != (1.0, 0.0):
            outer = local_sgd.OuterSGD(learning_rate=self.outer_learning_rate,
                                       momentum=self.outer_momentum)
        sync = None
        if self.sync_every != 1 or outer is not None:
            sync = local_sgd.LocalSGD(every=self.sync_every,
                                      outer_optimizer=outer,
                                      warmup_steps=self.sync_warmup_steps)
        start = {} if self.powersgd_start_iter is None else {
            "start_iter": self.powersgd_start_iter}
        compression = powersgd.PowerSGD(rank=self.powersgd_rank, **start) if (
            self.compression == "powersgd") else None
        reducers.check_options(sync, compression,
                                allreduce_dtype=self.allreduce_dtype)
        return sync, compression


def _check_pipeline(config: ExperimentConfig) -> None:
    """Options the pipelined step does not implement (one list, in
    `tfmulti.pipeline.unsupported`)."""
    from tfmulti.pipeline import unsupported
    # Named as the recipe flags are; `sync` catches DiLoCo's outer options.
    sync, _ = config.communication_options()
    try:
        unsupported.check(
            f"with `pipeline_stages`={config.pipeline_stages}",
            grad_accum_steps=config.grad_accum_steps,
            clip_global_norm=config.clip_global_norm,
            mixed_precision=config.mixed_precision,
            sync_batchnorm=config.sync_batchnorm,
            allreduce_dtype=config.allreduce_dtype,
            num_gpus=config.num_gpus, sync_every=config.sync_every,
            sync=sync if config.sync_every == 1 else None,
            compression=None if config.compression == "none"
            else config.compression)
    except unsupported.UnsupportedOption as e:
        flag = "outer_learning_rate" if e.name == "sync" else e.name
        raise ConfigError(str(e), flag=flag) from None


def _check_pipeline_process(config: ExperimentConfig) -> None:
    """A pipeline in a multi-worker cluster, refused before anything runs."""
    from tfmulti import cluster as cluster_lib
    from tfmulti.pipeline import unsupported
    try:
        unsupported.check_one_process(
            f"`pipeline_stages`={config.pipeline_stages}",
            cluster_lib.cluster_config(), stages=config.pipeline_stages)
    except unsupported.UnsupportedOption as e:
        raise ConfigError(str(e), flag=e.name) from None


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Writes `payload` to `path` so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                               suffix=".json")
    # mkstemp makes the file 0600; on shared storage the others who read
    # results need what the umask allows (0644 usually).
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def check_output_dir(model_dir: str) -> None:
    """Fails at start, naming the path, where the end would fail to write.

    Raises:
      ValueError: `model_dir` cannot be created or written, or its
        `metrics.json` is a directory.
    """
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"`model_dir` {model_dir!r} cannot be created ({e.strerror}: "
            f"{e.filename!r}). Pass a directory this process can create and "
            "write.") from None
    if not os.access(model_dir, os.W_OK | os.X_OK):
        raise ValueError(f"`model_dir` {model_dir!r} is not writable by this "
                         "process. Pass a directory it can write.")
    metrics = os.path.join(model_dir, "metrics.json")
    if os.path.isdir(metrics):
        raise ValueError(
            f"{metrics!r} is a directory, so the run's results could not be "
            "written there at the end. Remove it or use another "
            "`model_dir`.")


def _check_dataset(name: str) -> None:
    import tensorflow_datasets as tfds
    from tfmulti.data import shapes
    base = name.split(":")[0].split("/")[0]
    known = tfds.list_builders(with_community_datasets=False)
    if base == shapes.NAME or base in known:
        return
    close = difflib.get_close_matches(base, known + [shapes.NAME], n=3,
                                      cutoff=0.5)
    raise ConfigError(
        f"`--dataset` is {name!r}, which TFDS does not know"
        + (f"; closest: {', '.join(close)}." if close else ".")
        + f" (tfds.list_builders() lists all; {shapes.NAME!r} needs no "
        "download.)", flag="dataset")


def _check_batch(config: ExperimentConfig, replicas: int,
                 pieces: str = "replicas") -> None:
    if config.global_batch_size % replicas:
        lower = config.global_batch_size // replicas * replicas
        options = [b for b in (lower, lower + replicas) if b > 0]
        raise ConfigError(
            f"`global_batch_size` is {config.global_batch_size}, which does "
            f"not split over {replicas} {pieces} ({config.global_batch_size} "
            f"% {replicas} = {config.global_batch_size % replicas}). Use a "
            f"multiple of {replicas}, e.g. "
            f"{' or '.join(str(b) for b in options)}.",
            flag="global_batch_size")




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
        check_output_dir(run.path)
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
        _check_pipeline_process(config)
    length_defaulted = config.epochs is None and config.steps is None
    config = with_default_epochs(config)
    run = _open_run_dir(config, loop)
    model_dir = run.path
    _check_dataset(config.dataset)
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
        _check_batch(config, plan.data_parallel * plan.micro_batches,
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
        _check_batch(config, strategy.num_replicas_in_sync)
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
    steps_per_epoch, total_steps = run_length(
        config, examples_per_update=examples_per_update)
    reached = _check_end(config, run, loop, total_steps)
    if is_chief:
        now = rundir.timestamp()
        saved = run.saved_config or {}
        write_json_atomically(
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
    if config.balance and loop != "trainer":
        raise ConfigError(
            f"`balance`={config.balance!r} is an option of the custom loop "
            "(recipes.custom_loop); Keras fit does not re-split batches yet.",
            flag="balance")
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
        optimizer = keras.optimizers.Adam(learning_rate(
            config, examples_per_update=examples_per_update))
        accuracy = keras.metrics.SparseCategoricalAccuracy("accuracy")

    sync, compression = config.communication_options()
    if is_chief and verbose:
        for note in _length_notes(config, compression, total_steps,
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
                **({"async_warmup_steps": config.async_warmup_steps}
                   if config.async_warmup_steps is not None else {}))
            history = trainer.fit(train, steps=total_steps, eval_data=test,
                                  eval_every=steps_per_epoch,
                                  global_batch_size=config.global_batch_size,
                                  callbacks=[progress_logger], verbose=0)
            seconds = time.perf_counter() - start
            evaluation = trainer.evaluate(test)
            traffic = trainer.communication
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
                compression=compression)
            epochs = max(1, -(-total_steps // steps_per_epoch))
            # The final backup stays: a later --resume with a larger
            # --steps/--epochs continues from it.
            history = model.fit(
                train, epochs=epochs, steps_per_epoch=min(total_steps,
                                                          steps_per_epoch),
                validation_data=test, verbose=0,
                callbacks=[*tfmulti.keras.callbacks(model_dir,
                                                    keep_backup=True),
                           _stop_at(total_steps), progress_logger])
            seconds = time.perf_counter() - start
            evaluation = model.evaluate(test, verbose=0, return_dict=True)
            traffic = tfmulti.keras.communication(model)
            final_train = {k: v[-1] for k, v in history.history.items()
                           if not k.startswith("val_")}
    except BaseException as e:
        if is_chief and verbose:
            print(progress.stopped_summary(
                progress_logger, reason=_stop_reason(e),
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
        **({"balance": trainer.balance_history} if config.balance else {}),
        "config": _identity(config, loop),
        "versions": versions,
    }
    if is_chief:
        write_json_atomically(os.path.join(model_dir, rundir.METRICS_FILE),
                              metrics)
        if verbose:
            print(progress.summary(
                metrics, model_dir=model_dir, checkpoints=checkpoints,
                wall_seconds=time.perf_counter() - began), flush=True)
    return metrics


# Passes over the training split when neither `epochs` nor `steps` is
# given. Stale asynchronous updates need more of them: in the recipe bench
# two parameter-server workers ended 2.9-9.3 points below synchronous
# training after 3 epochs (468 updates of 128) and within 1 point after 9
# (BUILD_NOTES, issue 27), so a user who only adds --strategy=
# parameter_server gets the run length that was measured to work.
DEFAULT_EPOCHS = 3
ASYNC_DEFAULT_EPOCHS = 9
# Updates of 128 in ASYNC_DEFAULT_EPOCHS of the default dataset.
ASYNC_MEASURED_STEPS = 1404


def trains_asynchronously(config: ExperimentConfig) -> bool:
    """Whether `config` trains with parameter servers: asked for, or "auto"
    in a cluster that has them (as `strategies.create_strategy` decides)."""
    if config.strategy != "auto":
        return config.strategy == "parameter_server"
    from tfmulti import cluster as cluster_lib
    return bool(cluster_lib.cluster_config().num_ps)


def with_default_epochs(config: ExperimentConfig) -> ExperimentConfig:
    """`config` with `epochs` set when it was left None."""
    if config.epochs is not None:
        return config
    epochs = (ASYNC_DEFAULT_EPOCHS if trains_asynchronously(config)
              else DEFAULT_EPOCHS)
    return dataclasses.replace(config, epochs=epochs)


def _length_notes(config: ExperimentConfig, compression, total_steps: int,
                  asynchronous: bool, length_defaulted: bool = False
                  ) -> list[str]:
    """One line per default whose best value depends on the run's length."""
    notes = []
    if compression is not None:
        start = compression.start_iter
        if start >= total_steps:
            notes.append(
                f"PowerSGD: all {total_steps} updates are dense "
                f"(--powersgd_start_iter={start}), so nothing is compressed; "
                "lower --powersgd_start_iter to compress.")
        else:
            notes.append(
                f"PowerSGD: the first {start} of {total_steps} updates are "
                f"dense (--powersgd_start_iter={start}); right for a few "
                "hundred updates, a run of thousands can start compressing "
                "sooner and send fewer bytes.")
    if asynchronous:
        from tfmulti.training import async_trainer
        warmup = (async_trainer.DEFAULT_WARMUP_STEPS
                  if config.async_warmup_steps is None
                  else config.async_warmup_steps)
        notes.append(
            f"asynchronous: the learning rate warms up over the first "
            f"{warmup} of {total_steps} updates (--async_warmup_steps="
            f"{warmup}); stale gradients without it can keep the model at "
            "chance for hundreds of updates.")
        if length_defaulted:
            notes.append(
                f"asynchronous: {config.epochs} epochs ({total_steps} "
                f"updates) by default, {DEFAULT_EPOCHS} for synchronous "
                "strategies: stale workers need more updates to match "
                "synchronous training; --epochs or --steps sets the length.")
        elif total_steps < ASYNC_MEASURED_STEPS:
            notes.append(
                f"asynchronous: {total_steps} updates may be too few for "
                "stale workers; with the example CNN two workers ended "
                "2.9-9.3 points below synchronous at 468 updates of 128 (3 "
                "epochs) and within 1 point at "
                f"{ASYNC_MEASURED_STEPS}: pass --epochs="
                f"{ASYNC_DEFAULT_EPOCHS} (the default) or more.")
    return notes


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
        # The Trainer cuts each global batch of train_fn by the shares.
        return info, train_fn, test
    train = data.distribute_dataset(
        strategy, train_fn, global_batch_size=config.global_batch_size,
        seed=config.seed, service=config.data_service)
    return info, train, test


def run_length(config: ExperimentConfig, *,
               examples_per_update: int) -> tuple[int, int]:
    """(steps per epoch, the global step training ends at)."""
    from tfmulti import data
    info = data.tfds_dataset_fn(config.dataset, "train",
                                data_dir=config.data_dir).builder.info
    steps_per_epoch = max(1, info.splits["train"].num_examples //
                          examples_per_update)
    return steps_per_epoch, config.steps or config.epochs * steps_per_epoch


def _check_end(config: ExperimentConfig, run: rundir.RunDir, loop: str,
               total_steps: int) -> int | None:
    """The step a continued run has reached (None for a new run).

    Raises:
      ConfigError: the end asked for is before that step.
      tfmulti.rundir.NothingToTrain: it is that step.
    """
    if not run.resuming:
        return None
    from tfmulti.training import checkpoints
    # The newest checkpoint; a finished run's metrics.json, if an extension
    # of it was stopped before its first checkpoint.
    steps = [s for s in (run.finished_steps, checkpoints.latest_step(
        os.path.join(run.path, *(() if loop == "trainer" else (
            _backup_dir(),))))) if s is not None]
    reached = max(steps) if steps else None
    if reached is None or total_steps > reached or (
            total_steps == reached != run.finished_steps):
        # The last case: stopped after its last checkpoint, before writing
        # metrics.json for it; it evaluates and writes them.
        return reached
    flag = "steps" if config.steps else "epochs"
    asked = (f"`--steps`={config.steps}" if config.steps else
             f"`--epochs`={config.epochs} ({total_steps} steps)")
    if total_steps == reached:
        raise rundir.NothingToTrain(
            f"nothing to train: the run in {run.path!r} has reached step "
            f"{reached}, where {asked} ends; pass a larger --{flag} to train "
            "longer.")
    raise ConfigError(
        f"{asked} ends before step {reached}, which the run in "
        f"{run.path!r} has reached: a run is continued, never shortened. "
        f"Pass a --{flag} that ends after step {reached} to train longer, or "
        "start a new run without --resume.", flag=flag)


def _backup_dir() -> str:
    from tfmulti.keras import backup
    return backup.BACKUP_DIR


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


def _stop_reason(error: BaseException) -> str:
    from tfmulti import exit_codes
    if isinstance(error, SystemExit) and (
            error.code == exit_codes.PREEMPTED):
        return ("preempted: the last checkpoint is current; --resume "
                "continues from it")
    if isinstance(error, KeyboardInterrupt):
        return "interrupted; --resume continues from the last checkpoint"
    text = str(error).strip().splitlines()
    return (f"{type(error).__name__}" + (f": {text[0][:200]}" if text else "")
            + "; traceback below")


def _stop_at(total_steps: int):
    """A callback that stops Keras `fit` at `total_steps` updates, inside
    its last epoch (`fit` runs whole epochs; `--steps` need not be a
    multiple of one)."""
    import keras

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) >= total_steps:
                self.model.stop_training = True

    return StopAt()


def _floats(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
