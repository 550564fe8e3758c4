"""tfmulti: data-parallel training of Keras 3 models on TensorFlow.

One flag moves a job from one device to N simulated CPU replicas, N GPUs
(MirroredStrategy) or N hosts (MultiWorkerMirroredStrategy), with the same
results as one device.

`import tfmulti` is light: each public name imports its module (and
TensorFlow) on first use, so `tfmulti-launch` starts without TensorFlow.
What tfmulti registers (the serialisable `ScaledLearningRate` for loading
`.keras` files, the `tfmulti_shapes` TFDS builder) is registered at `import
tfmulti` when Keras / TFDS are already loaded (it then costs nothing), else
as soon as they are imported.
"""

import importlib
import importlib.abc
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

# What registers tfmulti's objects with each library.
_REGISTRARS = {"keras": "tfmulti.schedules",
               "tensorflow_datasets": "tfmulti.data"}


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers tfmulti's objects right after Keras / TFDS are imported, so
    `import tfmulti; import keras; keras.saving.load_model(...)` finds
    `tfmulti>ScaledLearningRate` whatever the import order. Finds nothing
    itself: it asks the other finders and wraps the loader they return."""

    def __init__(self, pending):
        self.pending = dict(pending)

    def find_spec(self, name, path=None, target=None):
        registrar = self.pending.get(name)
        if registrar is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            del self.pending[name]
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            importlib.import_module(registrar)

        loader.exec_module = exec_module
        return spec


_pending = {}
for _library, _registrar in _REGISTRARS.items():
    if _library in sys.modules:
        importlib.import_module(_registrar)
    else:
        _pending[_library] = _registrar
if _pending:
    sys.meta_path.insert(0, _RegisterOnImport(_pending))


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
