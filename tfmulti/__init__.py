"""tfmulti: data-parallel training of Keras 3 models on TensorFlow.

One flag moves a job from one device to N simulated CPU replicas, N GPUs
(MirroredStrategy) or N hosts (MultiWorkerMirroredStrategy), with the same
results as one device.
"""

from tfmulti import keras
from tfmulti import pipeline
from tfmulti.cluster import ClusterConfig, cluster_config
from tfmulti.data import distribute_dataset, tfds_dataset_fn
from tfmulti.devices import simulate_devices
from tfmulti.peer_failure import PeerFailureError
from tfmulti.schedules import scaled_learning_rate
from tfmulti.strategies import create_strategy
from tfmulti.training import NonFiniteLossError, Trainer

__version__ = "0.1.0"

__all__ = [
    "ClusterConfig",
    "NonFiniteLossError",
    "PeerFailureError",
    "Trainer",
    "cluster_config",
    "create_strategy",
    "distribute_dataset",
    "keras",
    "pipeline",
    "scaled_learning_rate",
    "simulate_devices",
    "tfds_dataset_fn",
]
