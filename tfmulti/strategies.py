"""create_strategy: one name -> a tf.distribute.Strategy that works with Keras 3.

The strategy also carries the communication options (algorithm, pack size,
timeout) so that tfmulti's explicit gradient reduction uses the same ones the
user asked for, on MirroredStrategy too, which has no place for them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import warnings

import tensorflow as tf

from tfmulti import cluster as cluster_lib
from tfmulti import compat, parameter_server, startup, watchdog
from tfmulti import chief_writes, initial_values

STRATEGY_NAMES = ("auto", "one_device", "mirrored", "multi_worker",
                  "parameter_server")
MIRRORED_ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
MULTI_WORKER_ALL_REDUCE = ("auto", "ring", "nccl")

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}

# A multi-worker training call (a loop of steps, an evaluation pass, a save)
# that makes no progress for this long fails: a peer alive but stuck. A dead
# peer is caught sooner by the coordination service's heartbeat (~10 s).
# Long enough for a slow first trace or a chief-only save on another worker.
DEFAULT_STALL_TIMEOUT_SECONDS = 600.0

# Gradient packs of about this many bytes when `pack_bytes` is None. Chosen
# by time (tfmulti.bench.communication, 2 workers on loopback, 10M float32
# parameters in 8 tensors, paired rounds): 4 MiB packs took 0.50-0.59x the
# time of TensorFlow's one pack of every gradient (0 below); one collective
# per tensor was no faster than 4 MiB packs. Many small tensors still share
# a pack, so the collectives stay few.
DEFAULT_PACK_BYTES = 4 << 20

# Threads TensorFlow keeps alive per second of collectives with a
# per-collective timeout, measured on a 2-worker loop of 5-step calls
# (BUILD_NOTES, issue 19): the warning below quotes it.
_THREADS_PER_SECOND_MEASURED = 1000
_warned_timeout = False

_log = logging.getLogger(__name__)


def communication_options(strategy: tf.distribute.Strategy
                          ) -> tf.distribute.experimental.CommunicationOptions:
    """The communication options `create_strategy` attached to `strategy`.

    A strategy made elsewhere gets TensorFlow's defaults.
    """
    return getattr(strategy, "_tfmulti_communication_options", None) or (
        tf.distribute.experimental.CommunicationOptions())


def _check_choice(arg: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"`{arg}` is {value!r}; valid values are "
                         f"{list(choices)}.")
    return value


def create_strategy(name: str = "auto", *, devices=None, num_gpus=None,
                    all_reduce: str = "auto", pack_bytes: int | None = None,
                    timeout_seconds: float | None = None,
                    stall_timeout_seconds: float | None = (
                        DEFAULT_STALL_TIMEOUT_SECONDS),
                    cluster: cluster_lib.ClusterConfig | None = None,
                    startup_timeout_seconds: float | None = None
                    ) -> tf.distribute.Strategy:
    """Creates the distribution strategy named `name`.

    Args:
      name: "one_device", "mirrored" (N devices, one process), "multi_worker"
        (N processes, TensorFlow's gRPC collectives), "parameter_server"
        (asynchronous: a chief, workers and `ps` tasks; on a worker or ps
        task this call runs its server and never returns, see
        `tfmulti.parameter_server`) or "auto": parameter_server when the
        cluster has `ps` tasks, multi_worker when it has more than one
        task, mirrored when more than one local device, else one_device.
      devices: device names for one_device / mirrored; default: the first
        `num_gpus` GPUs, else every GPU, else every logical CPU.
      num_gpus: how many local GPUs to use; more than present is an error.
      all_reduce: the all-reduce algorithm. Mirrored: "nccl",
        "hierarchical_copy", "reduce_to_one". Multi-worker: "ring", "nccl".
        "auto" lets TensorFlow choose.
      pack_bytes: pack gradients into chunks of about this many bytes for
        the all-reduce (a tensor larger than that is a pack of its own);
        None: `DEFAULT_PACK_BYTES` (4 MiB, the fastest measured on
        loopback workers); 0: TensorFlow's own packing (every gradient in
        one collective).
      timeout_seconds: TensorFlow's per-collective timeout: a collective
        that waits longer fails. Default none. TensorFlow keeps one thread
        alive per collective for this long, so a long timeout on a fast loop
        exhausts the machine's threads; prefer `stall_timeout_seconds`.
      stall_timeout_seconds: multi_worker only: when a tfmulti training call
        (`Trainer.fit`, or `fit` of a `tfmulti.keras.distributed` model)
        makes no progress for this long (no loop of steps completes: a peer
        is stuck), its collectives are aborted and it raises
        `tfmulti.PeerFailureError`. One watchdog thread per process.
        parameter_server: when every worker stays unreachable this long,
        `Trainer.fit` raises `WorkersLostError`.
        Default 600; None or `math.inf` for none.
      cluster: the cluster; default `tfmulti.cluster_config()` (TF_CONFIG,
        SLURM or Kubernetes from the environment).
      startup_timeout_seconds: multi_worker: how long to wait for the
        peers' hostnames to resolve and for the cluster to form, each;
        default $TFMULTI_STARTUP_TIMEOUT (`tfmulti-launch` sets 120), else
        `startup.DEFAULT_STARTUP_TIMEOUT_SECONDS` (600). While it waits the
        worker prints, after 5 s and then every 30 s, what it waits for and
        for how much longer; a worker that waits longer is killed
        (SIGKILL) after printing which peers did not answer.

    Returns:
      A `tf.distribute.Strategy`. For multi_worker it is a subclass of
      `tf.distribute.MultiWorkerMirroredStrategy` under which Keras 3's
      `model.fit` and `model.evaluate` work.

    Raises:
      ValueError: an unknown name or algorithm, a bad option, more GPUs than
        present, NCCL without GPUs, a single-process strategy in a
        multi-worker cluster, a peer hostname that does not resolve, or
        this task's port in use.
      RuntimeError: multi_worker created after TensorFlow ran other ops.
    """
    _check_choice("name", name, STRATEGY_NAMES)
    if pack_bytes is not None and (isinstance(pack_bytes, bool) or not
                                   isinstance(pack_bytes, int) or
                                   pack_bytes < 0):
        raise ValueError(f"`pack_bytes` should be a non-negative int or None, "
                         f"got {pack_bytes!r}.")
    for arg, value in (("timeout_seconds", timeout_seconds),
                       ("stall_timeout_seconds", stall_timeout_seconds)):
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, (int, float)) or not value > 0):
            raise ValueError(f"`{arg}` should be a positive number, "
                             f"`math.inf` or None, got {value!r}.")
    startup_timeout_seconds = startup.startup_timeout_seconds(
        startup_timeout_seconds)
    if cluster is None:
        cluster = cluster_lib.cluster_config()
    if name == "auto" and cluster.num_ps:
        name = "parameter_server"
    if name == "parameter_server":
        return parameter_server.create(
            cluster, stall_timeout_seconds=stall_timeout_seconds)
    if cluster.num_ps:
        raise ValueError(
            f"`cluster` has parameter servers ({list(cluster.cluster['ps'])}) "
            f"but the strategy is {name!r}, which does not use them. Use "
            "strategy 'parameter_server', or remove `cluster.ps`.")
    if name in ("one_device", "mirrored") and cluster.num_workers > 1 and (
            cluster.task_type != "evaluator"):
        # Each worker would train alone on all the data and write the same
        # checkpoints.
        raise ValueError(
            f"`name` is {name!r}, a single-process strategy, but this process "
            f"is {cluster.task_type} {cluster.task_index} of a cluster of "
            f"{cluster.num_workers} workers (TF_CONFIG, SLURM or Kubernetes "
            "variables, or tfmulti-launch). Use 'multi_worker' (or 'auto'), "
            "or run one process without a cluster.")
    if name == "auto":
        if cluster.num_workers > 1:
            name = "multi_worker"
        elif len(devices if devices is not None else
                 _local_devices(num_gpus)) > 1:
            name = "mirrored"
        else:
            name = "one_device"
        _log.info("tfmulti: strategy 'auto' chose %r", name)
    valid = MULTI_WORKER_ALL_REDUCE if name == "multi_worker" else (
        MIRRORED_ALL_REDUCE)
    if all_reduce not in valid:
        raise ValueError(
            f"`all_reduce` is {all_reduce!r}; with strategy {name!r} valid "
            f"values are {list(valid)}.")
    if all_reduce == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "`all_reduce`='nccl' needs GPUs, and this machine has none. Use "
            f"all_reduce='auto' (or {'ring' if name == 'multi_worker' else 'reduce_to_one'!r}).")
    if timeout_seconds == math.inf:
        timeout_seconds = None
    if timeout_seconds is not None:
        _warn_timeout_threads(timeout_seconds)
    if stall_timeout_seconds == math.inf or name != "multi_worker":
        stall_timeout_seconds = None
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=DEFAULT_PACK_BYTES if pack_bytes is None
        else pack_bytes, timeout_seconds=timeout_seconds,
        implementation=_IMPLEMENTATIONS.get(all_reduce, _IMPLEMENTATIONS[
            "auto"]))
    if name == "multi_worker":
        strategy = _multi_worker(cluster, num_gpus, options,
                                 startup_timeout_seconds)
        initial_values.name_mismatches(strategy)
        _keras_writes_from_chief()
    else:
        if devices is None:
            devices = _local_devices(num_gpus)
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` is empty; give at least one device.")
        if name == "one_device":
            if len(devices) > 1 and num_gpus is None:
                devices = devices[:1]
            elif len(devices) > 1:
                raise ValueError(
                    f"strategy 'one_device' uses one device but `num_gpus` is "
                    f"{num_gpus}. Use strategy 'mirrored' for several.")
            strategy = tf.distribute.OneDeviceStrategy(devices[0])
        else:
            strategy = _mirrored(devices, _mirrored_ops(all_reduce))
    strategy._tfmulti_communication_options = options
    _keras_fixes()
    watchdog.attach(strategy, stall_timeout_seconds)
    _log.info("tfmulti: %s with %d replica(s) in sync",
              type(strategy).__name__, strategy.num_replicas_in_sync)
    return strategy


def _warn_timeout_threads(timeout_seconds):
    global _warned_timeout
    if _warned_timeout:
        return
    _warned_timeout = True
    warnings.warn(
        f"`timeout_seconds`={timeout_seconds:g}: TensorFlow keeps one thread "
        "alive per collective until its timeout expires (about "
        f"{_THREADS_PER_SECOND_MEASURED} threads per second of training "
        "measured on a 2-worker loop), so a long job can exhaust the "
        "machine's threads. To bound a stuck peer use "
        "`stall_timeout_seconds` (one thread per process) and leave "
        "`timeout_seconds` unset.", stacklevel=3)


def _check_num_gpus(num_gpus, available):
    if num_gpus is None:
        return
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or (
            num_gpus < 0):
        raise ValueError(f"`num_gpus` should be a non-negative int, got "
                         f"{num_gpus!r}.")
    if num_gpus > available:
        raise ValueError(
            f"`num_gpus` is {num_gpus} but this machine has {available} "
            "GPU(s) visible to TensorFlow. Ask for at most that many, or "
            "check CUDA_VISIBLE_DEVICES and the CUDA install "
            "(pip install 'tfmulti[gpu]').")


def _local_devices(num_gpus):
    gpus = tf.config.list_logical_devices("GPU")
    _check_num_gpus(num_gpus, len(gpus))
    if num_gpus is not None:
        if num_gpus > 0:
            return [d.name for d in gpus[:num_gpus]]
    elif gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]


# Every MirroredStrategy numbers its collective groups from 1 +
# `_collective_key_base`; two of them over different device sets in one
# process (a benchmark over 1, 2 and 4 replicas, say) would join the same
# group with different sizes and abort. Each gets its own key range.
_KEY_BASES = itertools.count(0, 100_000)


def _mirrored(devices, cross_device_ops):
    cls = compat.mirrored_strategy_class()
    previous = cls._collective_key_base
    # The extended strategy copies the class attribute when it is built;
    # TensorFlow's own tests separate strategies the same way.
    cls._collective_key_base = next(_KEY_BASES)
    try:
        strategy = cls(devices, cross_device_ops=cross_device_ops)
    finally:
        cls._collective_key_base = previous
    # Keras fit with steps_per_execution > 1 and lazily built optimizers
    # in custom loops need trace-time collective keys (see compat).
    compat.bind_collective_keys_at_trace_time(strategy)
    return strategy


def _mirrored_ops(all_reduce):
    # MirroredStrategy's ops take no communication options; tfmulti's own
    # gradient reduction passes them per call (see communication_options).
    if all_reduce == "nccl":
        return tf.distribute.NcclAllReduce()
    if all_reduce == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    if all_reduce == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice()
    return None


def _multi_worker(cluster, num_gpus, options, startup_timeout_seconds):
    if num_gpus is not None:
        # Physical, not logical: listing logical devices would initialise
        # the runtime before the strategy can configure collectives.
        gpus = tf.config.list_physical_devices("GPU")
        _check_num_gpus(num_gpus, len(gpus))
        tf.config.set_visible_devices(gpus[:num_gpus], "GPU")
    resolver = None
    if cluster.cluster:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({t: list(a)
                                  for t, a in cluster.cluster.items()}),
            task_type=cluster.task_type, task_id=cluster.task_index,
            rpc_layer="grpc")
    cls = compat.multi_worker_strategy_class()
    join = contextlib.nullcontext()
    if cluster.cluster:
        startup.check_hosts_resolve(cluster,
                                    timeout_seconds=startup_timeout_seconds)
        if cluster.task_type != "evaluator":
            startup.check_port_free(cluster)
        join = startup.bounded_join(cluster,
                                    timeout_seconds=startup_timeout_seconds)
    try:
        with join:
            return cls(cluster_resolver=resolver,
                       communication_options=options)
    except RuntimeError as e:
        if "program startup" in str(e) or "initialized" in str(e):
            raise RuntimeError(
                "create_strategy('multi_worker') was called after TensorFlow "
                "had started running operations, so its collective ops can no "
                "longer be configured (tf#34568). Create the strategy first "
                "thing in the program, before building models or datasets or "
                f"running any TensorFlow op. TensorFlow said: {e}") from e
        raise


def multi_worker_on_cpus(local_cpus: int, *,
                         stall_timeout_seconds: float | None = (
                             DEFAULT_STALL_TIMEOUT_SECONDS),
                         cluster: cluster_lib.ClusterConfig | None = None
                         ) -> tf.distribute.Strategy:
    """A multi-worker strategy with `local_cpus` simulated CPU replicas per
    worker process: the topology of N hosts x M GPUs, on CPUs.

    MultiWorkerMirroredStrategy puts one replica on a worker without GPUs;
    this one splits the CPU into `local_cpus` logical devices (without
    initialising TensorFlow, which would stop the strategy configuring its
    collectives) and replicates over them. Call it first thing in the
    program, like `create_strategy("multi_worker")`.

    Args:
      local_cpus: replicas per worker, at least 1.
      stall_timeout_seconds: as for `create_strategy("multi_worker")`: a
        training call that makes no progress this long fails.
      cluster: the cluster; default `tfmulti.cluster_config()`.
    """
    if isinstance(local_cpus, bool) or not isinstance(local_cpus, int) or (
            local_cpus < 1):
        raise ValueError(f"`local_cpus` should be an int >= 1, got "
                         f"{local_cpus!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * local_cpus)

    if cluster is None:
        cluster = cluster_lib.cluster_config()
    # No per-collective timeout (a thread per collective, issue 19): the
    # watchdog bounds a stuck peer, as for create_strategy.
    options = tf.distribute.experimental.CommunicationOptions()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({t: list(a) for t, a in cluster.cluster.items()}),
        task_type=cluster.task_type, task_id=cluster.task_index,
        rpc_layer="grpc")
    strategy = compat.multi_worker_on_local_cpus(resolver, options,
                                                 local_cpus)
    strategy._tfmulti_communication_options = options
    initial_values.name_mismatches(strategy)
    _keras_writes_from_chief()
    _keras_fixes()
    watchdog.attach(strategy, stall_timeout_seconds)
    return strategy


def _keras_fixes():
    """What every tfmulti strategy fixes in Keras, installed once per
    process (tfmulti.compat says why): one random stream per replica, and models
    without `call` (the keras-io GAN) trained by `fit`."""
    compat.draw_seeds_per_replica()
    compat.build_models_without_call()


def _keras_writes_from_chief():
    """Keras's saves and file-writing callbacks write from the chief only
    under a multi-worker strategy (`tfmulti.chief_writes`): the user's
    one-machine code, run by every worker, gives one file of each."""
    chief_writes.install()


def outside_scope(strategy, variables):
    """The first of `variables` not created under `strategy`, else None."""
    return next((v for v in variables
                 if not strategy.extended.variable_created_in_scope(
                     getattr(v, "value", v))), None)


def check_created_in_scope(strategy, model, optimizer):
    """Raises ValueError naming a model or optimizer variable created
    outside `strategy`'s scope (the Trainer and `tfmulti.keras.distributed`
    check it before their first step)."""
    fix = ("Create the model and the optimizer inside `with "
           "strategy.scope():` (the same strategy you pass to the Trainer), "
           "before building them.")
    variable = outside_scope(strategy, model.variables)
    if variable is not None:
        raise ValueError(
            f"The model's variable {variable.path!r} was not created "
            f"under the scope of the strategy "
            f"{type(strategy).__name__}. {fix}")
    # Keras's TF optimizer binds the strategy current at its construction
    # and updates variables through it.
    bound = compat.optimizer_strategy(optimizer)
    if bound is not None and bound is not strategy:
        raise ValueError(
            f"The optimizer {type(optimizer).__name__} was created outside "
            f"the scope of the strategy {type(strategy).__name__} (its slot "
            f"variables would land under another scope, tf#55713). {fix}")
