"""Logical devices: N simulated replicas on one physical device.

TensorFlow fixes its device layout the first time anything touches the
runtime (creating a tensor, listing logical devices, building a strategy), so
the split must happen first thing in the program.
"""

from __future__ import annotations

import tensorflow as tf

_DEVICE_TYPES = ("CPU", "GPU")
# A logical GPU needs an explicit memory limit; 1 GiB each keeps several on a
# small card and is ample for the models a simulation is used with.
_LOGICAL_GPU_MEMORY_MB = 1024


def simulate_devices(count: int, device_type: str = "CPU") -> list[str]:
    """Splits the first physical device into `count` logical devices.

    Lets N-replica code (MirroredStrategy over N devices) run on a laptop or
    in CI. Call it before any other TensorFlow work in the process.

    Args:
      count: number of logical devices to create, at least 1.
      device_type: "CPU" or "GPU".

    Returns:
      The names of the logical devices of `device_type`, e.g.
      `["/device:CPU:0", "/device:CPU:1"]`.

    Raises:
      ValueError: `count` or `device_type` is invalid, or there is no physical
        device of that type.
      RuntimeError: TensorFlow has already initialised its devices with a
        different layout.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"`count` should be a positive int, got {count!r}. Pass the number "
            "of replicas to simulate, e.g. simulate_devices(4).")
    device_type = str(device_type).upper()
    if device_type not in _DEVICE_TYPES:
        raise ValueError(
            f"`device_type` should be one of {list(_DEVICE_TYPES)}, got "
            f"{device_type!r}.")
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"`device_type`={device_type!r} but this machine has no physical "
            f"{device_type}. Use device_type='CPU' to simulate replicas.")
    if device_type == "GPU":
        config = [tf.config.LogicalDeviceConfiguration(
            memory_limit=_LOGICAL_GPU_MEMORY_MB)] * count
    else:
        config = [tf.config.LogicalDeviceConfiguration()] * count
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError as e:
        existing = tf.config.list_logical_devices(device_type)
        if len(existing) == count:
            # Already laid out as asked (a second call, or a caller that set
            # it up itself): nothing to change.
            return [d.name for d in existing]
        raise RuntimeError(
            f"simulate_devices(count={count}) was called after TensorFlow "
            f"initialised its devices ({len(existing)} logical {device_type} "
            f"device(s) exist already). Call tfmulti.simulate_devices before "
            "any other TensorFlow operation (first thing in main(), before "
            "building models, datasets or strategies), or start a new "
            f"process. TensorFlow said: {e}") from e
    return [d.name for d in tf.config.list_logical_devices(device_type)]
