"""Which device runs which stage, and putting each stage's variables there.

D data-parallel groups of S stages use D * S devices: group d, stage s runs
on device d * S + s, so one group's stages are neighbours (on GPUs, the
activation transfers of a group stay between adjacent cards, and the
all-reduce of a stage spans the groups).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmulti import compat


def available_devices() -> list[str]:
    """The logical GPUs, or the logical CPUs when there is no GPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def layout(devices, *, num_stages: int, data_parallel: int
           ) -> list[list[str]]:
    """devices[d][s]: the device of stage s in data-parallel group d."""
    needed = num_stages * data_parallel
    if needed > len(devices):
        raise ValueError(
            f"`num_stages`={num_stages} x `data_parallel`={data_parallel} "
            f"needs {needed} devices, but {len(devices)} are available "
            f"({list(devices)}). Use fewer stages or groups, or on a CPU "
            f"simulate more devices first thing in the program: "
            f"tfmulti.simulate_devices({needed}).")
    return [[devices[d * num_stages + s] for s in range(num_stages)]
            for d in range(data_parallel)]


def same_device(a: str, b: str) -> bool:
    """True if two device strings name the same device."""
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.device_type, a.device_index) == (b.device_type, b.device_index)


def move_variables(variables, device: str) -> None:
    """Re-creates each Keras variable's storage on `device`, value kept.

    A Keras 3 variable on TensorFlow wraps one `tf.Variable`, created where
    the layer was built (usually the first device). Keras has no public way
    to move it (`tfmulti.compat.adopt_variable` says how it is done).
    """
    for v in variables:
        value = getattr(v, "value", None)
        if not isinstance(value, tf.Variable) or isinstance(
                value, tf.distribute.DistributedValues):
            raise ValueError(
                f"Variable {v.path!r} is a {type(value).__name__}, not a "
                "plain tf.Variable (was `model` built inside a "
                "tf.distribute strategy scope?). Build the model outside "
                "any strategy scope; the pipeline places its variables.")
        if same_device(value.device, device):
            continue
        with tf.device(device):
            moved = tf.Variable(tf.identity(value), trainable=value.trainable,
                                name=value.name.split(":")[0])
        compat.adopt_variable(v, moved)


def copy_variables(variables, device: str) -> list:
    """New Keras variables on `device` with the values of `variables`."""
    copies = []
    with tf.device(device):
        for v in variables:
            copies.append(keras.Variable(
                tf.identity(v.value), trainable=v.trainable,
                name=f"{v.name}_copy"))
    return copies


def variable_bytes(variables) -> int:
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                   for v in variables))


def bytes_by_device(variables) -> dict[str, int]:
    """Bytes of `variables` on each device they live on."""
    out: dict[str, int] = {}
    for v in variables:
        device = getattr(v, "value", v).device
        spec = tf.DeviceSpec.from_string(device)
        key = f"{spec.device_type}:{spec.device_index}"
        out[key] = out.get(key, 0) + variable_bytes([v])
    return out
