"""tfmulti: data-parallel training of Keras 3 models on TensorFlow.

One flag moves a job from one device to N simulated CPU replicas, N GPUs
(MirroredStrategy) or N hosts (MultiWorkerMirroredStrategy), with the same
results as one device.

`import tfmulti` is light: each public name imports its module (and
TensorFlow) on first use, so `tfmulti-launch` starts without TensorFlow.
What tfmulti registers (the serialisable `ScaledLearningRate` for loading
`.keras` files, the `tfmulti_shapes` TFDS builder) is registered at `import
tfmulti` when Keras / TFDS are already loaded (it then costs nothing), else
on first use of `tfmulti.schedules` / `tfmulti.data` (any of their names).
"""

import importlib
import sys

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "ClusterConfig": "tfmulti.cluster",
    "ConfigMismatchError": "tfmulti.training.agreement",
    "LocalSGD": "tfmulti.training.local_sgd",
    "NonFiniteLossError": "tfmulti.training",
    "OuterSGD": "tfmulti.training.local_sgd",
    "PeerFailureError": "tfmulti.peer_failure",
    "PowerSGD": "tfmulti.training.powersgd",
    "Trainer": "tfmulti.training",
    "cluster_config": "tfmulti.cluster",
    "create_strategy": "tfmulti.strategies",
    "distribute_dataset": "tfmulti.data",
    "scaled_learning_rate": "tfmulti.schedules",
    "simulate_devices": "tfmulti.devices",
    "tfds_dataset_fn": "tfmulti.data",
}

# Subpackages, imported on first use.
_SUBPACKAGES = ("keras", "pipeline")

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES])

if "keras" in sys.modules:
    importlib.import_module("tfmulti.schedules")
if "tensorflow_datasets" in sys.modules:
    importlib.import_module("tfmulti.data")


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tfmulti.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfmulti' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
