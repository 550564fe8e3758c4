"""tf.data for data-parallel training: sharding, batching, exact-once eval.

Importing it registers the offline TFDS dataset `tfmulti_shapes`.
"""

from tfmulti.data.file_source import files_dataset_fn
from tfmulti.data.pipeline import (PipelineOptions, build_pipeline,
                                   distribute_dataset)
from tfmulti.data.shapes import prepare_default
from tfmulti.data.sharding import ShardedDatasetFn, choose_sharding
from tfmulti.data.tfds_source import tfds_dataset_fn

__all__ = [
    "PipelineOptions",
    "ShardedDatasetFn",
    "build_pipeline",
    "choose_sharding",
    "distribute_dataset",
    "files_dataset_fn",
    "prepare_default",
    "tfds_dataset_fn",
]
