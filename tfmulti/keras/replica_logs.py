"""What a Keras step reports, read across replicas.

`compute_metrics` and `test_step` may return logs that are not the model's
metrics (a custom step's own loss, say); `distributed` keeps them in
variables each replica writes and reads them as one device would. The
model's own metrics are summed over replicas on read, in one traced call.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.training import step as step_lib


def overrides(model, name) -> bool:
    """Whether `model` overrides Keras's method `name` (class or instance)."""
    return name in vars(model) or (
        getattr(type(model), name) is not getattr(keras.Model, name))


class Logs:
    """Values a replica step returns that are not the model's metrics.

    Each replica keeps its value times its number of examples, and the
    examples, in sync-on-read SUM variables: a cross-replica read is the
    mean over replicas weighted by their real shares, which is the
    one-device value of a per-batch mean even when a batch splits unevenly
    (Keras's own step functions take the plain mean over replicas). Names
    of the model's metrics are read from the metrics themselves (summed
    over replicas), so they equal one device where a per-replica `result()`
    would not.
    """

    def __init__(self, model, specs, keys):
        self.keys = list(keys)
        self.variables = {}

        def zeros(shape):
            return tf.Variable(
                tf.zeros(shape, tf.float32), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)

        with model.distribute_strategy.scope():
            self.examples = zeros([])
            for key, spec in specs.items():
                if key in self.keys and key not in metric_names(model):
                    self.variables[key] = zeros(spec.shape)

    def capture(self, logs, batch):
        """In replica context: keeps this replica's values of `logs`."""
        logs = flat_logs(logs)
        examples = tf.cast(tf.shape(step_lib.first_tensor(batch))[0],
                           tf.float32)
        self.examples.assign(examples)
        for key, variable in self.variables.items():
            variable.assign(tf.cast(logs[key], tf.float32) * examples)

    def read(self, metric_results):
        """In cross-replica context: the logs, in the step's key order."""
        examples = self.examples.read_value()
        return {key: tf.math.divide_no_nan(self.variables[key].read_value(),
                                           examples)
                if key in self.variables else metric_results[key]
                for key in self.keys}


def metric_names(model):
    return set(model.get_metrics_result().keys())


def flat_logs(logs):
    """`logs` with nested dicts merged in, as Keras flattens a step's logs
    for the history (a guide's `{m.name: m.result() for m in
    self.metrics}` nests the compiled metrics' dict)."""
    flat = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(flat_logs(value))
        else:
            flat[key] = value
    return flat


def discover_logs(model, replica_fn, element_spec):
    """Traces `strategy.run(replica_fn)` once, without running it, and
    returns the specs of the dict it returns."""
    found = []

    def record(batch):
        logs = replica_fn(batch)
        if not isinstance(logs, dict):
            raise ValueError(
                f"{replica_fn.__name__} of {model.name!r} returned "
                f"{type(logs).__name__}; tfmulti.keras.distributed needs a "
                "dict of logs (name -> scalar), as Keras's own steps return.")
        if not found:
            found.append({k: tf.TensorSpec(tf.convert_to_tensor(v).shape,
                                           tf.convert_to_tensor(v).dtype)
                          for k, v in flat_logs(logs).items()})
        return tf.constant(0.0)

    strategy = model.distribute_strategy
    tf.function(lambda b: strategy.run(record, args=(b,))
                ).get_concrete_function(element_spec)
    for key, spec in found[0].items():
        if not spec.shape.is_fully_defined():
            raise ValueError(
                f"The log {key!r} returned by {replica_fn.__name__} of "
                f"{model.name!r} has shape {spec.shape}; "
                "tfmulti.keras.distributed needs logs of a fixed shape "
                "(scalars).")
    return found[0]

def metrics_function(model):
    # Metric variables are summed over replicas (and workers) on read: one
    # traced read per call, not one eager collective per variable.
    return tf.function(model.get_metrics_result)
