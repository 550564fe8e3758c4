"""A model that differs across workers, named where its variables are made.

MultiWorkerMirroredStrategy broadcasts every variable's initial value from
the chief when the variable is created, one collective per variable, before
any tfmulti code runs on the model. Measured (TF 2.21, 2 workers, Dense(3)
on worker 0 and Dense(4) on worker 1): worker 1 failed at once with
`InvalidArgumentError: Shape mismatch in the collective instance 100. Op at
device /job:worker/replica:0/task:1/device:CPU:0 expected shape [4,4] but
another member in the group expected shape [4,3]`, with no variable named;
the chief then failed 10 s later with `UnavailableError: ... The following
tasks are unhealthy (stopped sending heartbeats)`; in other runs the roles
were swapped (which worker meets the mismatch first varies). The config
fingerprint
(`tfmulti.training.agreement`) cannot run before these broadcasts (the
shapes exist only as the variables are made, and each is broadcast as it is
made), so the broadcast's own error is translated here, per variable.
"""

from __future__ import annotations

import re

import tensorflow as tf

from tfmulti import cluster as cluster_lib

_MISMATCH = re.compile(
    r"Op at device \S*task:(\d+)\S* expected shape (\[[^\]]*\]) but another "
    r"member in the group expected shape (\[[^\]]*\])")
# Another collective met this broadcast: a worker creates more variables,
# or in another order (measured: "Collective instance 102 expected type 1
# and data_type 1 but got type 0 and data_type 2").
OTHER_COLLECTIVE = re.compile(r"Collective instance \d+ expected type")
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError)


def _name(kwargs) -> str:
    # Keras 3 enters the layer's name scope around the creation: its path.
    scope = tf.get_current_name_scope()
    name = kwargs.get("name") or "(unnamed)"
    return f"{scope}/{name}" if scope else name


def _describe(kwargs) -> str:
    name = _name(kwargs)
    shape = kwargs.get("shape")
    value = kwargs.get("initial_value")
    if shape is None and hasattr(value, "shape"):
        shape = value.shape
    shape_text = "" if shape is None else f" (shape {list(tf.TensorShape(shape))})"
    return f"{name!r}{shape_text}"


def name_mismatches(strategy) -> None:
    """Makes `strategy` (multi-worker) name a model that differs by worker.

    Wraps the variable creation of this strategy instance only: a shape
    mismatch in the initial-value broadcast becomes a `ConfigMismatchError`
    naming the variable and both shapes; a peer lost during that broadcast
    (it stopped on the mismatch) a `RuntimeError` naming the variable.
    """
    extended = strategy.extended
    create = extended._create_variable
    cluster = cluster_lib.of_strategy(strategy)

    def create_variable(next_creator, **kwargs):
        try:
            return create(next_creator, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            found = _MISMATCH.search(e.message or "")
            if not found:
                raise
            task, mine, other = found.groups()
            raise cluster_lib.ConfigMismatchError(
                f"The workers build different models: the variable "
                f"{_name(kwargs)!r} has shape {mine} on worker {task} "
                f"and {other} on another worker (the chief, worker 0, "
                "broadcasts each variable's initial value as it is created, "
                "so the first variable that differs stops the job). Build "
                "the same model on every worker: same code, flags and input "
                "shape.") from e
        except tf.errors.InternalError as e:
            if not OTHER_COLLECTIVE.search(e.message or ""):
                raise
            raise cluster_lib.ConfigMismatchError(
                f"The workers build different models: worker "
                f"{cluster.worker_rank}'s broadcast of the initial value of "
                f"the variable {_describe(kwargs)} met another kind of "
                "collective on another worker, so the workers create "
                "different variables (in number or order: the model, or "
                "the optimizer built for it, differs). Build the same model "
                "on every worker: same code, flags and input shape.") from e
        except _PEER_ERRORS as e:
            raise RuntimeError(
                f"Worker {cluster.worker_rank} of {cluster.num_workers}: a "
                "peer stopped while the initial value of the variable "
                f"{_describe(kwargs)} was broadcast at its creation. If that "
                "worker's log shows a ConfigMismatchError, the workers build "
                "different models: build the same model on every worker. "
                f"TensorFlow said: {str(e).strip()[:300]}") from e

    extended._create_variable = create_variable
