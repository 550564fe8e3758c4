"""Model parallelism: a Keras model split into pipeline stages over devices.

`PipelinedModel` cuts a functional or Sequential Keras 3 model into S stages
(at given layer names, or balanced by parameter count), places each stage's
variables on its own device, and trains with a GPipe or 1F1B schedule over M
micro-batches inside one `tf.function`, optionally in D data-parallel groups
whose stage gradients are summed with TensorFlow collectives. The update
equals one device's on the same global batch.
"""

from tfmulti.pipeline.model import PipelinedModel, PipelineOptions
from tfmulti.pipeline.runner import PipelineRunner, is_pipelined
from tfmulti.pipeline.schedule import theoretical_bubble
from tfmulti.pipeline.split import Stage, balanced_cuts, layer_names, split_model
from tfmulti.training import runner as _runner

# The Trainer (a layer above) runs a PipelinedModel through this runner.
_runner.register_model_runner(is_pipelined, PipelineRunner)

__all__ = [
    "PipelineOptions",
    "PipelinedModel",
    "Stage",
    "balanced_cuts",
    "layer_names",
    "split_model",
    "theoretical_bubble",
]
