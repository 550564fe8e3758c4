"""Bytes of optimizer state per device, read from where the variables live
(a mirrored variable on every replica's device, a plain one on its own)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmulti.training import shard_placement


def state_bytes_per_device(strategy, variables) -> dict:
    """Bytes of `variables` by the device each copy lives on: a mirrored
    variable counts once on every replica's device, a plain one on its own.

    Args:
      strategy: the strategy of any distributed variables among them.
      variables: Keras or TensorFlow variables (an optimizer's `variables`).
    """
    out = {}
    for variable in variables:
        variable = shard_placement.tf_variable(variable)
        copies = (strategy.experimental_local_results(variable)
                  if isinstance(variable, tf.distribute.DistributedValues)
                  else [variable])
        for copy in copies:
            size = int(np.prod(copy.shape)) * tf.as_dtype(copy.dtype).size
            out[copy.device] = out.get(copy.device, 0) + size
    return out


def state_bytes(strategy, optimizer, sharding=None) -> tuple[dict, int]:
    """The bytes of `optimizer`'s state the replicas' devices hold, by
    device, and those of its host copy, read from where the variables live.

    Unsharded, every variable counts on the device(s) it lives on (a
    mirrored one on each replica's) and the host copy is 0. With
    `sharding` (the ShardedOptimizer applying `optimizer`'s updates), the
    devices hold the shards and `optimizer`'s mirrored scalars; its plain
    (host) variables are the unsharded checkpoint form, once per worker.

    Args:
      strategy: the strategy of the run.
      optimizer: the Keras optimizer the run was given (its `variables`).
      sharding: the `ShardedOptimizer`, or None.

    Returns:
      ({device: bytes}, host bytes).
    """
    variables = list(optimizer.variables)
    if sharding is None:
        return state_bytes_per_device(strategy, variables), 0
    mirrored = [v for v in variables if isinstance(
        shard_placement.tf_variable(v), tf.distribute.DistributedValues)]
    host = [v for v in variables if not isinstance(
        shard_placement.tf_variable(v), tf.distribute.DistributedValues)]
    per_device = state_bytes_per_device(
        strategy, mirrored + [v for opt in sharding.optimizers
                              for v in opt.variables])
    return per_device, sum(state_bytes_per_device(strategy, host).values())
