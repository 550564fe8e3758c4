"""The experiment's configuration: every recipe flag, checked before
anything runs, and the defaults that depend on it.

`ExperimentConfig` holds one run's settings; building it refuses a bad or
inconsistent one with a `ConfigError` naming the flag to fix. The run
itself is `tfmulti.experiment.train_and_evaluate`.
"""

from __future__ import annotations

import dataclasses
import difflib

from tfmulti import balance as balance_lib
from tfmulti import zero_stage


DEFAULT_DATASET = "tfmulti_shapes"
COMPRESSIONS = ("none", "powersgd")


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
    # ZeRO stage 0, 1 or 2 (True: 1): `Trainer(shard_optimizer_state=)` /
    # `distributed(...)`.
    shard_optimizer_state: int = 0

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
        try:
            stage = zero_stage.parse(self.shard_optimizer_state)
        except ValueError as e:
            raise ConfigError(str(e), flag="shard_optimizer_state") from None
        # Frozen: the stage as an int, True given or 1.
        object.__setattr__(self, "shard_optimizer_state", stage)
        if stage:
            self._check_sharding()
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

    def _check_sharding(self):
        """What `shard_optimizer_state` cannot run with (the Trainer's own
        refusals, said in flags before anything runs)."""
        conflicts = [
            (self.strategy in ("parameter_server", "one_device"),
             "strategy", f"--strategy={self.strategy} (sharding needs "
             "mirrored or multi_worker replicas)"),
            (self.pipeline_stages > 1, "pipeline_stages",
             f"--pipeline_stages={self.pipeline_stages} (each stage holds "
             "only its own layers' state already)"),
            (self.sync_every != 1 or (self.outer_learning_rate,
                                      self.outer_momentum) != (1.0, 0.0),
             "sync_every", "local SGD (every worker keeps its own state "
             "between synchronisations)"),
            (self.compression != "none", "compression",
             f"--compression={self.compression} (its dense warm-up puts the "
             "update under a tf.cond)"),
        ]
        for conflict, flag, what in conflicts:
            if conflict:
                raise ConfigError(
                    f"`shard_optimizer_state`={self.shard_optimizer_state} "
                    f"cannot run with {what}. "
                    "Drop --shard_optimizer_state or that setting.",
                    flag=flag)

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


def check_pipeline_process(config: ExperimentConfig) -> None:
    """A pipeline in a multi-worker cluster, refused before anything runs."""
    from tfmulti import cluster as cluster_lib
    from tfmulti.pipeline import unsupported
    try:
        unsupported.check_one_process(
            f"`pipeline_stages`={config.pipeline_stages}",
            cluster_lib.cluster_config(), stages=config.pipeline_stages)
    except unsupported.UnsupportedOption as e:
        raise ConfigError(str(e), flag=e.name) from None


def check_balance(config: ExperimentConfig) -> None:
    """`balance` where it cannot work, refused before anything runs."""
    from tfmulti.data import service
    try:
        address = service.resolve_address(config.data_service)
    except ValueError as e:
        raise ConfigError(str(e), flag="data_service") from None
    if address:
        # The balanced Trainer cuts global batches it reads itself; the
        # service's stream would be left unused, silently.
        raise ConfigError(
            f"`balance`={config.balance!r} cuts each global batch on the "
            "worker by the replicas' shares, but the training input would "
            f"come from the tf.data service at {address} (--data_service "
            f"or ${service.ENV_VAR}), whose batches it cannot cut. Drop "
            f"--balance, or drop --data_service and unset "
            f"{service.ENV_VAR}.", flag="balance")


def check_dataset(name: str) -> None:
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


def check_batch(config: ExperimentConfig, replicas: int,
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


def length_notes(config: ExperimentConfig, compression, total_steps: int,
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
