"""How a recipe's `--pipeline_stages=S --micro_batches=M` becomes a pipeline.

`experiment.train_and_evaluate` runs a pipelined config through the same run
as every other recipe flag (progress lines, summary, config.json,
metrics.json, run directory); what differs is decided here: the devices
(S stages per group, D = devices // S data-parallel groups), whether the
example CNN keeps BatchNormalization (a split batch would normalise each
micro-batch on its own, which `PipelinedModel` refuses), the
`PipelinedModel` itself, and what config.json and metrics.json record.
"""

from __future__ import annotations

import dataclasses

from tfmulti.pipeline import model as model_lib
from tfmulti.pipeline import placement


@dataclasses.dataclass(frozen=True)
class Plan:
    """The pipeline of one recipe run.

    Attributes:
      devices: every device the stages may use.
      stages: S, stages per group.
      micro_batches: M, micro-batches per step and group.
      data_parallel: D, groups of stages.
      batch_norm: whether the example CNN keeps BatchNormalization.
      model_note: one line for the user when the model differs from the
        one `--batchnorm` asked for, else "".
    """

    devices: tuple[str, ...]
    stages: int
    micro_batches: int
    data_parallel: int
    batch_norm: bool
    model_note: str

    def record(self) -> dict:
        """What config.json records about the pipeline and its model."""
        return {"stages": self.stages, "micro_batches": self.micro_batches,
                "data_parallel": self.data_parallel,
                "batchnorm": self.batch_norm,
                "model_changed": self.model_note or None}

    def build(self, model, optimizer, loss) -> model_lib.PipelinedModel:
        """`model` cut into the planned stages (call once per run)."""
        return model_lib.PipelinedModel(
            model, optimizer=optimizer, loss=loss, num_stages=self.stages,
            micro_batches=self.micro_batches,
            data_parallel=self.data_parallel, devices=list(self.devices))

    def metrics(self, pipe: model_lib.PipelinedModel) -> dict:
        """What metrics.json records about the trained pipeline."""
        return {"stages": self.stages, "micro_batches": self.micro_batches,
                "data_parallel": self.data_parallel, "cuts": list(pipe.cuts),
                "parameter_bytes_per_device":
                    pipe.parameter_bytes_per_device(),
                "optimizer_checkpoint": pipe.checkpoint_optimizer()[1]}


def plan(config) -> Plan:
    """The pipeline for an `ExperimentConfig` with `pipeline_stages` > 1.

    Call after the devices are set up (`simulate_devices`); the caller
    checks that `global_batch_size` splits into D x M micro-batches.
    """
    devices = tuple(placement.available_devices())
    stages = config.pipeline_stages
    groups = max(1, len(devices) // stages)
    pieces = config.micro_batches * groups
    batch_norm = config.batchnorm and pieces == 1
    note = "" if batch_norm == config.batchnorm else (
        f"model: the example CNN without BatchNormalization ({groups} "
        f"group(s) x {config.micro_batches} micro-batches would normalise "
        "each piece of the batch on its own); --batchnorm=false trains the "
        "same model with any strategy.")
    return Plan(devices=devices, stages=stages,
                micro_batches=config.micro_batches, data_parallel=groups,
                batch_norm=batch_norm, model_note=note)
