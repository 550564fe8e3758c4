"""Every version-guarded Keras / TensorFlow workaround, in one package.

Each workaround is one function or class, headed by a short comment: the
upstream symptom, the upstream issue, the versions checked, and the test
that fails once an upstream release fixes it (then delete the workaround
and its test). No other tfmulti module touches a private Keras or
TensorFlow attribute: it calls an accessor here (`tests/test_private_access.py`
fails on a new site outside this package).

The modules are named after the upstream area they work around:
optimizers, strategies (and Keras's steps on them), collectives,
parameter_servers (the coordinator), cluster (SLURM host lists),
keras_losses, keras_models (and the layer graph), checkpoints, data
(tf.data under a strategy), multi_worker_files (what Keras writes from
every worker) and versions. Callers use the
names below (`compat.loss_tracker(model)`). To add one: append a function
or class with the same header to the module of its area, export it here,
and add its guard test.
"""

from tfmulti.compat.checkpoints import (checkpoint_prefixes, is_trackable,
                                        readable_checkpoint)
from tfmulti.compat.cluster import (expand_slurm_hostlist,
                                    expand_slurm_tasks_per_node)
from tfmulti.compat.collectives import (abort_collectives,
                                        all_reduce_in_replica,
                                        all_to_all_in_replica,
                                        bind_collective_keys_at_trace_time,
                                        collective_all_reduce,
                                        local_collective_all_reduce)
from tfmulti.compat.data import (data_worker_address,
                                 distributed_input_autotuned, iterator_dataset,
                                 replica_spec, set_global_steps)
from tfmulti.compat.keras_losses import (additional_loss,
                                         call_has_training_arg, compiled_loss,
                                         compiled_loss_objects,
                                         compute_compiled_loss,
                                         LOSS_SCALE_FUNCTIONS, loss_tracker,
                                         losses_unscaled_in,
                                         unscaled_keras_loss,
                                         unscaled_keras_losses)
from tfmulti.compat.keras_models import (adopt_variable,
                                         build_models_without_call,
                                         draw_seeds_per_replica,
                                         flatten_layers, graph_nodes,
                                         has_layer_graph, needs_symbolic_build,
                                         producer, sequential_graph,
                                         set_initial_epoch,
                                         stock_symbolic_build, symbolic_build)
from tfmulti.compat.multi_worker_files import (callback_write_paths,
                                               MODEL_WRITE_METHODS,
                                               publish_key, wait_for_key,
                                               wrap_keras_writes)
from tfmulti.compat.optimizers import (excludes_from_weight_decay,
                                       LOCAL_UPDATE_METHODS,
                                       make_optimizer_local,
                                       optimizer_built_variables,
                                       OPTIMIZER_REDUCE_METHOD, plain_variable,
                                       replace_optimizer_reduction)
from tfmulti.compat.parameter_servers import (coordinator_workers,
                                              count_retries,
                                              is_sharded_variable,
                                              worker_failed)
from tfmulti.compat.strategies import (called_by_keras_build, check_keras_step,
                                       cluster_resolver, COLLECTIVE_DTYPES,
                                       is_keras_train_step, KERAS_BUILD_CALLER,
                                       KerasMirroredStrategy,
                                       KerasMultiWorkerMirroredStrategy,
                                       local_batch_sizes, made_by_tfmulti,
                                       mirrored_strategy_class, model_strategy,
                                       multi_worker_on_local_cpus,
                                       multi_worker_strategy_class,
                                       optimizer_strategy,
                                       statistics_averaged_after,
                                       tfmulti_replica_context,
                                       unequal_shapes_error, variable_strategy,
                                       warn_if_keras_step_uneven)
from tfmulti.compat.versions import (keras_major, SUPPORTED_KERAS_MAJOR)

__all__ = [
    "abort_collectives", "additional_loss", "adopt_variable",
    "all_reduce_in_replica", "all_to_all_in_replica",
    "bind_collective_keys_at_trace_time",
    "build_models_without_call", "call_has_training_arg",
    "callback_write_paths", "called_by_keras_build", "check_keras_step",
    "checkpoint_prefixes", "cluster_resolver", "collective_all_reduce",
    "COLLECTIVE_DTYPES", "compiled_loss", "compiled_loss_objects",
    "compute_compiled_loss", "coordinator_workers", "count_retries",
    "data_worker_address", "distributed_input_autotuned",
    "draw_seeds_per_replica", "excludes_from_weight_decay",
    "expand_slurm_hostlist", "expand_slurm_tasks_per_node", "flatten_layers",
    "graph_nodes", "has_layer_graph", "is_keras_train_step",
    "is_sharded_variable", "is_trackable", "iterator_dataset",
    "KERAS_BUILD_CALLER", "keras_major", "KerasMirroredStrategy",
    "KerasMultiWorkerMirroredStrategy", "local_batch_sizes",
    "local_collective_all_reduce", "LOCAL_UPDATE_METHODS",
    "LOSS_SCALE_FUNCTIONS", "loss_tracker", "losses_unscaled_in",
    "made_by_tfmulti", "make_optimizer_local", "mirrored_strategy_class",
    "model_strategy", "MODEL_WRITE_METHODS", "multi_worker_on_local_cpus",
    "multi_worker_strategy_class", "needs_symbolic_build",
    "optimizer_built_variables", "OPTIMIZER_REDUCE_METHOD",
    "optimizer_strategy", "plain_variable", "producer", "publish_key",
    "readable_checkpoint", "replace_optimizer_reduction", "replica_spec",
    "sequential_graph", "set_global_steps", "set_initial_epoch",
    "statistics_averaged_after", "stock_symbolic_build",
    "SUPPORTED_KERAS_MAJOR", "symbolic_build", "tfmulti_replica_context",
    "unequal_shapes_error", "unscaled_keras_loss", "unscaled_keras_losses",
    "variable_strategy", "wait_for_key", "warn_if_keras_step_uneven",
    "worker_failed", "wrap_keras_writes",
]
