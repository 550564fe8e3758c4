"""How to pipeline a model (`PipelineOptions`), and what a model must be
for the pipelined step to equal one device's (`check_batch_norm`)."""

from __future__ import annotations

import dataclasses

import keras

from tfmulti import compat
from tfmulti.pipeline import schedule as schedule_lib


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline a model.

    Attributes:
      num_stages: S, the number of stages (devices per group).
      micro_batches: M, micro-batches per group per step.
      data_parallel: D, data-parallel groups of S stages (D * S devices).
      cuts: names of the last layer of each stage but the last; None
        balances the stages by parameter count and prints the cut.
      schedule: "gpipe" (all forwards, then all backwards) or "1f1b" (one
        forward, one backward: at most S - s micro-batches' activations on
        stage s).
      carry_skips: carry tensors of skip connections across cuts.
    """

    num_stages: int
    micro_batches: int = 1
    data_parallel: int = 1
    cuts: tuple[str, ...] | None = None
    schedule: str = "gpipe"
    carry_skips: bool = False

    def __post_init__(self):
        for name in ("num_stages", "micro_batches", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (
                    value < 1):
                raise ValueError(f"`{name}` should be a positive int, got "
                                 f"{value!r}.")
        if self.schedule not in schedule_lib.SCHEDULES:
            raise ValueError(f"`schedule` is {self.schedule!r}; valid values "
                             f"are {list(schedule_lib.SCHEDULES)}.")
        if self.cuts is not None:
            if isinstance(self.cuts, str):
                raise ValueError(f"`cuts` should be a sequence of layer "
                                 f"names, got the string {self.cuts!r}; "
                                 f"write cuts=[{self.cuts!r}].")
            object.__setattr__(self, "cuts", tuple(self.cuts))
            if len(self.cuts) != self.num_stages - 1:
                raise ValueError(
                    f"`cuts`={list(self.cuts)} gives {len(self.cuts) + 1} "
                    f"stages but `num_stages`={self.num_stages}; give "
                    f"{self.num_stages - 1} layer names, or cuts=None to "
                    "balance by parameter count.")


def check_batch_norm(model, options: PipelineOptions) -> None:
    """A trainable BatchNormalization must see the whole batch at once."""
    pieces = options.micro_batches * options.data_parallel
    if pieces == 1:
        return
    for layer in compat.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization) and (
                layer.trainable):
            raise ValueError(
                f"Layer {layer.name!r} is a BatchNormalization, whose batch "
                "statistics would be computed per piece of the batch "
                f"(`micro_batches`={options.micro_batches} x "
                f"`data_parallel`={options.data_parallel}) instead of over "
                "the whole batch, so training would differ from one device. "
                "Use micro_batches=1 and data_parallel=1, freeze it "
                "(layer.trainable = False), or use LayerNormalization / "
                "GroupNormalization, which do not mix examples.")
