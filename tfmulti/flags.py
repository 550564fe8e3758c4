"""The absl flags the recipes share, and how a recipe runs and fails.

`define_flags()` is called by a recipe, never at import, so importing tfmulti
adds nothing to a program's flags. `experiment_config()` turns the parsed
flags into the frozen `ExperimentConfig` the library runs; `run_recipe()` is
a recipe's `app.run`: quiet by default (warnings, progress lines and the
closing summary; `--verbosity=0` adds tfmulti's and TensorFlow's info logs),
and a bad flag is one line naming it plus its help, not a traceback or the
module's docstring. Only flag values and settings are usage errors: any
other error of the run keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging

from tfmulti import experiment
from tfmulti import experiment_config as config_lib
from tfmulti import rundir
from tfmulti import strategies
from tfmulti import zero_stage

_ALLREDUCE_DTYPES = ("float32", "float16", "bfloat16")
_MIXED_PRECISION = ("none", "mixed_float16", "mixed_bfloat16")
_LR_SCALING = ("none", "linear", "sqrt")
# The recipes' reading of absl's --verbosity (absl's help says its default
# becomes 0; a recipe keeps -1 unless the flag is given).
VERBOSITY_HELP = ("-1 (default): warnings, progress lines and the closing "
                  "summary; 0: also tfmulti's and TensorFlow's info logs "
                  "(strategy, sharding, batch split); 1: debug.")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the shared recipe flags on `flag_values` (once).

    Args:
      flag_values: where to define them; absl's global FLAGS by default.
    """
    if "strategy" in flag_values:
        return
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum("strategy", "auto", list(strategies.STRATEGY_NAMES),
                      "Distribution strategy; auto picks multi_worker in a "
                      "cluster, mirrored with several devices, else "
                      "one_device.", **fv)
    flags.DEFINE_integer("cpu_replicas", 0, "Simulate this many CPU replicas "
                         "(logical devices); 0 uses the real devices.",
                         lower_bound=0, **fv)
    flags.DEFINE_integer("num_gpus", None, "Use this many local GPUs.",
                         lower_bound=0, **fv)
    flags.DEFINE_enum("all_reduce", "auto", sorted(set(
        strategies.MIRRORED_ALL_REDUCE + strategies.MULTI_WORKER_ALL_REDUCE)),
        "All-reduce algorithm (nccl, hierarchical_copy, reduce_to_one for "
        "mirrored; ring, nccl for multi_worker).", **fv)
    flags.DEFINE_integer("pack_bytes", None, "Pack gradients into chunks of "
                         "this many bytes (a positive number) for the "
                         "all-reduce; default: 4 MiB "
                         "(tfmulti.strategies.DEFAULT_PACK_BYTES).",
                         lower_bound=1, **fv)
    flags.DEFINE_float("startup_timeout", None, "Seconds a multi-worker "
                       "job's worker waits for its peers to resolve and to "
                       "join (it reports what it waits for meanwhile); "
                       "default: $TFMULTI_STARTUP_TIMEOUT (tfmulti-launch "
                       "sets 120), else 600.", **fv)
    flags.DEFINE_enum("allreduce_dtype", "float32", list(_ALLREDUCE_DTYPES),
                      "Dtype gradients travel in during the all-reduce.", **fv)
    flags.DEFINE_string("dataset", config_lib.DEFAULT_DATASET,
                        "A prepared TFDS dataset name; the default is "
                        "generated offline on first use.", **fv)
    flags.DEFINE_string("data_dir", None, "TFDS data dir (default: "
                        "$TFDS_DATA_DIR, else ~/tensorflow_datasets).", **fv)
    flags.DEFINE_string("data_service", None, "tf.data service dispatcher "
                        "host:port: preprocessing on its data workers "
                        "(default: $TFMULTI_DATA_SERVICE, else local).", **fv)
    flags.DEFINE_integer("global_batch_size", 128, "Examples per step over "
                         "all replicas.", lower_bound=1, **fv)
    flags.DEFINE_integer("epochs", None, "Passes over the training split "
                         "(default: 3; 9 with parameter servers, whose stale "
                         "updates need more).", lower_bound=1, **fv)
    flags.DEFINE_integer("steps", None, "Train to this step instead of "
                         "--epochs (with --resume, a larger value trains a "
                         "run longer).", lower_bound=1, **fv)
    flags.DEFINE_float("learning_rate", 1e-3, "Learning rate at "
                       "--base_batch_size.", lower_bound=0.0, **fv)
    flags.DEFINE_integer("base_batch_size", 128, "Batch size "
                         "--learning_rate was tuned for.", lower_bound=1, **fv)
    flags.DEFINE_enum("lr_scaling", "linear", list(_LR_SCALING),
                      "Scale the learning rate with the global batch.", **fv)
    flags.DEFINE_integer("warmup_steps", 0, "Linear warmup steps.",
                         lower_bound=0, **fv)
    flags.DEFINE_integer("grad_accum_steps", 1, "Micro-batches per update.",
                         lower_bound=1, **fv)
    flags.DEFINE_float("clip_global_norm", None, "Clip by the global norm of "
                       "the all-reduced gradient.", lower_bound=0.0, **fv)
    flags.DEFINE_enum("mixed_precision", "none", list(_MIXED_PRECISION),
                      "Mixed precision policy.", **fv)
    flags.DEFINE_bool("sync_batchnorm", False, "Synchronise BatchNorm "
                      "statistics across replicas.", **fv)
    flags.DEFINE_bool("batchnorm", True, "BatchNormalization in the example "
                      "CNN. --nobatchnorm trains the model a pipeline with "
                      "micro-batches trains, with any strategy.", **fv)
    flags.DEFINE_integer("steps_per_loop", 50, "Steps per tf.function call "
                         "(steps_per_execution for model.fit).",
                         lower_bound=1, **fv)
    flags.DEFINE_string("model_dir", None, "The run's directory: "
                        "config.json, checkpoints, TensorBoard events and "
                        "metrics.json (default: a new "
                        "./runs/<recipe>-<YYYYmmdd-HHMMSS>).", **fv)
    flags.DEFINE_bool("resume", False, "Continue the run in --model_dir "
                      "(same training flags; a larger --steps or --epochs "
                      "trains it longer); without it a directory that "
                      "holds a run is refused.", **fv)
    flags.DEFINE_integer("seed", 0, "Random seed.", **fv)
    flags.DEFINE_integer("pipeline_stages", 1, "Split the model into this "
                         "many pipeline stages over the devices (groups of "
                         "stages data-parallel over the rest); 1: no "
                         "pipeline.", lower_bound=1, **fv)
    flags.DEFINE_integer("micro_batches", 1, "Micro-batches per step and "
                         "group with --pipeline_stages (the example CNN "
                         "then runs without BatchNormalization, as "
                         "--nobatchnorm; the run says so).", lower_bound=1,
                         **fv)
    flags.DEFINE_integer("sync_every", 1, "Local SGD: workers average their "
                         "weights every this many updates (1: every update, "
                         "synchronous).", lower_bound=1, **fv)
    flags.DEFINE_integer("sync_warmup_steps", 0, "Local SGD: synchronous "
                         "updates before the workers start to step apart "
                         "(post-local SGD).", lower_bound=0, **fv)
    flags.DEFINE_float("outer_learning_rate", 1.0, "DiLoCo outer learning "
                       "rate on the averaged delta (1 with momentum 0: plain "
                       "averaging).", **fv)
    flags.DEFINE_float("outer_momentum", 0.0, "DiLoCo outer Nesterov "
                       "momentum (DiLoCo: 0.9, with outer lr 0.7).", **fv)
    flags.DEFINE_enum("compression", "none", list(config_lib.COMPRESSIONS),
                      "Gradient compression: PowerSGD or none.", **fv)
    flags.DEFINE_string("balance", "none", "Shares of the global batch per "
                        "replica: none (even), auto (follow each replica's "
                        "measured speed) or weights per replica or worker, "
                        "e.g. 3,1.", **fv)
    # Boolean-like (a bare --shard_optimizer_state is stage 1, as before
    # stage 2 existed) but `=2` for stage 2; `_parse_flags` refuses the
    # stage as the next argument.
    flags.DEFINE_flag(flags.Flag(
        _StageParser(), flags.ArgumentSerializer(), "shard_optimizer_state",
        0, "ZeRO stage: 0/false off; 1/true (or bare) each replica keeps "
        "the optimizer state of 1/N of the parameters; 2 also only its "
        "shard of the reduced gradient (mirrored or multi_worker); "
        "checkpoints stay unsharded.", boolean=True), **fv)
    flags.DEFINE_integer("powersgd_rank", 4, "PowerSGD rank.",
                         lower_bound=1, **fv)
    flags.DEFINE_integer("powersgd_start_iter", None, "PowerSGD: dense "
                         "(uncompressed) updates before compression starts, "
                         "as PyTorch's start_powerSGD_iter; default: "
                         "tfmulti.PowerSGD's (100).", lower_bound=0, **fv)
    flags.DEFINE_integer("async_warmup_steps", None, "Parameter servers: "
                         "asynchronous updates over which the learning rate "
                         "warms up linearly; default: the Trainer's (100); "
                         "0: none.", lower_bound=0, **fv)


def experiment_config(flag_values: flags.FlagValues = flags.FLAGS
                      ) -> config_lib.ExperimentConfig:
    """The parsed shared flags as a validated `ExperimentConfig`."""
    f = flag_values
    return config_lib.ExperimentConfig(
        strategy=f.strategy, cpu_replicas=f.cpu_replicas,
        num_gpus=f.num_gpus, all_reduce=f.all_reduce,
        pack_bytes=f.pack_bytes, startup_timeout=f.startup_timeout,
        allreduce_dtype=None if f.allreduce_dtype == "float32"
        else f.allreduce_dtype,
        dataset=f.dataset, data_dir=f.data_dir, data_service=f.data_service,
        global_batch_size=f.global_batch_size, epochs=f.epochs,
        steps=f.steps, learning_rate=f.learning_rate,
        base_batch_size=f.base_batch_size,
        lr_scaling=None if f.lr_scaling == "none" else f.lr_scaling,
        warmup_steps=f.warmup_steps, grad_accum_steps=f.grad_accum_steps,
        clip_global_norm=f.clip_global_norm,
        mixed_precision=None if f.mixed_precision == "none"
        else f.mixed_precision,
        sync_batchnorm=f.sync_batchnorm, batchnorm=f.batchnorm,
        steps_per_loop=f.steps_per_loop,
        model_dir=f.model_dir, resume=f.resume, seed=f.seed,
        pipeline_stages=f.pipeline_stages, micro_batches=f.micro_batches,
        sync_every=f.sync_every, sync_warmup_steps=f.sync_warmup_steps,
        outer_learning_rate=f.outer_learning_rate,
        outer_momentum=f.outer_momentum, compression=f.compression,
        powersgd_rank=f.powersgd_rank,
        powersgd_start_iter=f.powersgd_start_iter,
        async_warmup_steps=f.async_warmup_steps,
        balance=None if f.balance == "none" else f.balance,
        shard_optimizer_state=f.shard_optimizer_state)


def _usage_error(message: str, flag: str | None = None,
                 flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Exits with one line naming the problem, and the flag's help."""
    program = os.path.basename(sys.argv[0] or "recipe").removesuffix(".py")
    lines = [f"{program}: error: {message}"]
    if flag and flag in flag_values:
        f = flag_values[flag]
        default = "" if f.default is None else f" (default: {f.default!r})"
        lines.append(f"  --{flag}: {f.help}{default}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(1)


class _StageParser(flags.ArgumentParser):
    """--shard_optimizer_state's values: 0, 1, 2, true or false."""

    def parse(self, argument):
        return zero_stage.parse(argument, name="--shard_optimizer_state",
                                words=True)

    def flag_type(self):
        return "ZeRO stage"


def _stage_after_bare_flag(argv: list[str]) -> str | None:
    # absl reads a bare boolean-like flag as "true" and leaves a following
    # "2" as a positional argument: `--shard_optimizer_state 2` would be
    # stage 1 plus a stray argument.
    for flag, following in zip(argv, argv[1:]):
        if flag in ("--shard_optimizer_state", "-shard_optimizer_state") and (
                following.strip().lower() in ("0", "1", "2", "true",
                                              "false")):
            return following
    return None


def _parse_flags(argv: list[str]) -> list[str]:
    stage = _stage_after_bare_flag(argv)
    if stage is not None:
        _usage_error(
            f"`--shard_optimizer_state {stage}` reads as stage 1 followed "
            f"by a stray argument {stage!r}; write "
            f"--shard_optimizer_state={stage}.", "shard_optimizer_state")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        # absl: "flag --strategy=horovod: value should be one of <...>".
        named = re.search(r"--(\w+)", str(e))
        _usage_error(f"{e}", named.group(1) if named else None)


def _quiet(flag_values: flags.FlagValues) -> None:
    """Warnings and progress only, unless --verbosity was given."""
    if flag_values["verbosity"].present:
        return
    logging.set_verbosity(logging.WARNING)
    # First use of the offline dataset: one line instead of TFDS's bars.
    import tensorflow_datasets as tfds
    tfds.disable_progress_bar()


def recipe_main(loop: str) -> Callable[[list[str]], None]:
    """The `main` of a recipe script: flags -> config -> one experiment.

    Args:
      loop: "fit" or "trainer" (see `experiment.train_and_evaluate`).

    Returns:
      A function for `absl.app.run`. A bad setting (`ConfigError`) exits 1
      with one line and the flag's help; a finished run given `--resume`
      exits 0 after saying there is nothing to train.
    """
    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            _usage_error(f"unexpected arguments {argv[1:]}; every setting is "
                         "a --flag (see --help).")
        _quiet(flags.FLAGS)
        try:
            experiment.train_and_evaluate(experiment_config(), loop=loop)
        except experiment.ConfigError as e:
            _usage_error(str(e), e.flag)
        except rundir.NothingToTrain as e:
            print(e, flush=True)

    return main


def run_recipe(loop: str) -> None:
    """`app.run` for a recipe whose flags `define_flags()` defined."""
    app.run(recipe_main(loop), flags_parser=_parse_flags)
