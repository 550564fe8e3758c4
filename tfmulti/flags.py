"""The absl flags the recipes share.

`define_flags()` is called by a recipe, never at import, so importing tfmulti
adds nothing to a program's flags. `experiment_config()` turns the parsed
flags into the frozen `ExperimentConfig` the library runs.
"""

from __future__ import annotations

from typing import Callable

from absl import app
from absl import flags

from tfmulti import experiment
from tfmulti import strategies

_ALLREDUCE_DTYPES = ("float32", "float16", "bfloat16")
_MIXED_PRECISION = ("none", "mixed_float16", "mixed_bfloat16")
_LR_SCALING = ("none", "linear", "sqrt")


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
                         "this many bytes for the all-reduce.",
                         lower_bound=0, **fv)
    flags.DEFINE_enum("allreduce_dtype", "float32", list(_ALLREDUCE_DTYPES),
                      "Dtype gradients travel in during the all-reduce.", **fv)
    flags.DEFINE_string("dataset", experiment.DEFAULT_DATASET,
                        "A prepared TFDS dataset name; the default is "
                        "generated offline on first use.", **fv)
    flags.DEFINE_string("data_dir", None, "TFDS data dir (default: TFDS's).",
                        **fv)
    flags.DEFINE_integer("global_batch_size", 128, "Examples per step over "
                         "all replicas.", lower_bound=1, **fv)
    flags.DEFINE_integer("epochs", 3, "Passes over the training split.",
                         lower_bound=1, **fv)
    flags.DEFINE_integer("steps", None, "Train this many steps instead of "
                         "--epochs.", lower_bound=1, **fv)
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
    flags.DEFINE_integer("steps_per_loop", 50, "Steps per tf.function call "
                         "(steps_per_execution for model.fit).",
                         lower_bound=1, **fv)
    flags.DEFINE_string("model_dir", "/tmp/tfmulti", "Checkpoints, "
                        "TensorBoard events and metrics.json go here.", **fv)
    flags.DEFINE_integer("seed", 0, "Random seed.", **fv)
    flags.DEFINE_integer("pipeline_stages", 1, "Split the model into this "
                         "many pipeline stages over the devices (groups of "
                         "stages data-parallel over the rest); 1: no "
                         "pipeline.", lower_bound=1, **fv)
    flags.DEFINE_integer("micro_batches", 1, "Micro-batches per step and "
                         "group with --pipeline_stages (the example CNN "
                         "drops BatchNormalization when the batch is "
                         "split).", lower_bound=1, **fv)
    flags.register_validator(
        "pack_bytes", lambda v: v is None or v > 0,
        "--pack_bytes must be positive when given.", flag_values=flag_values)


def experiment_config(flag_values: flags.FlagValues = flags.FLAGS
                      ) -> experiment.ExperimentConfig:
    """The parsed shared flags as a validated `ExperimentConfig`."""
    f = flag_values
    return experiment.ExperimentConfig(
        strategy=f.strategy, cpu_replicas=f.cpu_replicas,
        num_gpus=f.num_gpus, all_reduce=f.all_reduce,
        pack_bytes=f.pack_bytes,
        allreduce_dtype=None if f.allreduce_dtype == "float32"
        else f.allreduce_dtype,
        dataset=f.dataset, data_dir=f.data_dir,
        global_batch_size=f.global_batch_size, epochs=f.epochs,
        steps=f.steps, learning_rate=f.learning_rate,
        base_batch_size=f.base_batch_size,
        lr_scaling=None if f.lr_scaling == "none" else f.lr_scaling,
        warmup_steps=f.warmup_steps, grad_accum_steps=f.grad_accum_steps,
        clip_global_norm=f.clip_global_norm,
        mixed_precision=None if f.mixed_precision == "none"
        else f.mixed_precision,
        sync_batchnorm=f.sync_batchnorm, steps_per_loop=f.steps_per_loop,
        model_dir=f.model_dir, seed=f.seed,
        pipeline_stages=f.pipeline_stages, micro_batches=f.micro_batches)


def recipe_main(loop: str) -> Callable[[list[str]], None]:
    """The `main` of a recipe script: flags -> config -> one experiment.

    Args:
      loop: "fit" or "trainer" (see `experiment.train_and_evaluate`).

    Returns:
      A function for `absl.app.run`. A bad combination of flag values
      becomes an absl usage error that says what is allowed.
    """
    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}; every "
                                 "setting is a --flag.")
        try:
            # tfmulti raises ValueError only for bad arguments, and here
            # every argument comes from a flag.
            experiment.train_and_evaluate(experiment_config(), loop=loop)
        except ValueError as e:
            raise app.UsageError(str(e)) from None

    return main
