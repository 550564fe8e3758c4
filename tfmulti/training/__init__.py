"""The training layer: replica step, inner loop, controller and actions,
Trainer, the one checkpoint format, summaries."""

from tfmulti.training.checkpoints import Checkpointer, Position
from tfmulti.training.controller import (Action, Controller, LoopResult,
                                         PeriodicAction, Schedule)
from tfmulti.training.gradients import (all_reduce_sum, clip_by_global_norm,
                                        disable_optimizer_reduction)
from tfmulti.training.loop import create_train_loop
from tfmulti.training.numerics import NonFiniteLossError
from tfmulti.training.preemption import PreemptionWatcher
from tfmulti.training.step import GradientOptions, TrainStep
from tfmulti.training.summaries import ScalarWriter
from tfmulti.training.trainer import Trainer
from tfmulti.training.xla import XlaCompileError

__all__ = [
    "Action",
    "Checkpointer",
    "Controller",
    "LoopResult",
    "PeriodicAction",
    "Position",
    "Schedule",
    "GradientOptions",
    "NonFiniteLossError",
    "PreemptionWatcher",
    "ScalarWriter",
    "TrainStep",
    "Trainer",
    "XlaCompileError",
    "all_reduce_sum",
    "clip_by_global_norm",
    "create_train_loop",
    "disable_optimizer_reduction",
]
