"""The options a pipeline does not implement, refused in one place.

The Trainer (`PipelineRunner`), Keras `fit` (`tfmulti.keras.pipelined`) and
the recipes (`experiment.ExperimentConfig`) all check their options here, so
each is refused with the same reason and the same fix wherever it is given.
"""

from __future__ import annotations

# name: (the value that means "not used", why a pipeline does not take it).
OPTIONS = {
    "grad_accum_steps": (1, "use more `micro_batches`: they accumulate the "
                         "gradient"),
    "clip_global_norm": (None, "each stage is updated on its own device; "
                         "use the optimizer's clipnorm or clipvalue"),
    "allreduce_dtype": (None, "the groups sum stage gradients in float32"),
    "mixed_precision": (None, "no loss scaling across stages"),
    "on_nonfinite": ("raise", "no update is skipped across stages"),
    "jit_compile": (False, "the stages run as separate device functions, "
                    "not one XLA cluster"),
    "sync": (None, "the pipeline sums its groups' gradients every step"),
    "sync_every": (1, "the pipeline sums its groups' gradients every step"),
    "compression": (None, "the pipeline sums its groups' gradients every "
                    "step"),
    "sync_batchnorm": (False, "the example CNN runs without BatchNorm in a "
                       "pipeline with micro-batches"),
    "num_gpus": (None, "the pipeline uses every visible GPU"),
    "loss_weights": (None, "the pipeline computes one loss"),
    "class_weight": (None, "the pipeline's loss averages every example "
                     "equally"),
    "sample_weight": (None, "the pipeline's loss averages every example "
                      "equally"),
    "validation_split": (0.0, "pass `validation_data` instead"),
}


class UnsupportedOption(ValueError):
    """An option a pipeline does not implement.

    Attributes:
      name: the option (argument or flag) to leave at its default.
    """

    def __init__(self, message: str, *, name: str):
        super().__init__(message)
        self.name = name


def check(where: str, **options) -> None:
    """Raises for the first of `options` given a value a pipeline refuses.

    Args:
      where: how the message names the pipeline, e.g. "for a
        PipelinedModel" or "with `pipeline_stages`=2".
      **options: option name (a key of `OPTIONS`) to the value given.

    Raises:
      UnsupportedOption: names the option, its value, why, and the value to
        leave it at.
    """
    for name, value in options.items():
        default, why = OPTIONS[name]
        # A falsy value is "not used" for options whose default is falsy.
        if value != default and not (not default and not value):
            raise UnsupportedOption(
                f"`{name}`={value!r} is not supported {where} ({why}). "
                f"Leave `{name}` at {default!r}.", name=name)


def check_one_process(where: str, cluster, *, stages: int) -> None:
    """Refuses a pipeline in a multi-process cluster, before anything runs.

    A pipeline places its stages on the devices of the process it runs in;
    it does not span workers, so under `tfmulti-launch --workers N` (or any
    TF_CONFIG with more than one task) each worker would train alone.

    Args:
      where: how the message names the pipeline, e.g. "`pipeline_stages`=2".
      cluster: a `tfmulti.cluster.ClusterConfig` (this process's cluster).
      stages: the number of stages, for the fix's example command.

    Raises:
      UnsupportedOption (name "pipeline_stages"): names the cluster and the
        fix (one process, with as many devices as stages).
    """
    tasks = {t: len(a) for t, a in cluster.cluster.items()}
    if sum(tasks.values()) <= 1:
        return
    shape = ", ".join(f"{t}: {n}" for t, n in sorted(tasks.items()))
    raise UnsupportedOption(
        f"{where} runs in one process (its stages on this process's "
        f"devices), but this process is one task of a cluster ({shape}; "
        "TF_CONFIG, as tfmulti-launch, SLURM or Kubernetes set it). Run it "
        "as one process, without tfmulti-launch: on a CPU `python -m "
        f"recipes.custom_loop --cpu_replicas={stages} --pipeline_stages="
        f"{stages} ...`, on GPUs with {stages} GPUs of one machine.",
        name="pipeline_stages")
