"""Gradient all-reduce between worker processes: time, bytes, collectives.

Every worker of a MultiWorkerMirroredStrategy cluster all-reduces gradients
shaped like a model's (about 10M parameters by default) with tfmulti's own
reduction (`training.gradients.all_reduce_sum`, the Trainer's), once per
configuration: per-tensor collectives (what a loop reducing gradient by
gradient does), TensorFlow's default packing (all gradients concatenated into
one collective), `pack_bytes` chunks, and float32 vs bfloat16/float16 on the
wire. Per configuration: seconds per all-reduce (median over repeats), bytes
per step (payload, and what a ring moves per worker) and the collectives in
the traced graph with their wire dtype. The default packing is judged
again inside a whole training step (forward, backward, all-reduce, SGD
update of the MLP those gradients belong to), where packs launched last
gradient first can overlap the backward pass.

    python -m tfmulti.bench   # runs it on 2 local worker processes
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import tensorflow as tf

from tfmulti import strategies
from tfmulti.bench import stats
from tfmulti.training import gradients as gradients_lib

COLLECTIVE_OP = "CollectiveReduceV2"


def count_ops(graph_def, op_type: str = COLLECTIVE_OP, *,
              within: str = "") -> int:
    """Counts the ops of type `op_type` in a traced graph.

    Args:
      graph_def: a `tf.compat.v1.GraphDef` (`concrete_fn.graph.as_graph_def()`).
      op_type: the op to count, e.g. "CollectiveReduceV2".
      within: count only inside library functions whose name contains this
        (e.g. "while_body": once per loop iteration); "" counts the top-level
        graph and every library function.
    """
    functions = [f.node_def for f in graph_def.library.function
                 if within in f.signature.name]
    if not within:
        functions.append(graph_def.node)
    return sum(1 for nodes in functions for node in nodes
               if node.op == op_type)


def op_dtypes(graph_def, op_type: str = COLLECTIVE_OP) -> list[str]:
    """The distinct `T` (data type) attributes of `op_type` ops in a graph."""
    nodes = [n for f in graph_def.library.function for n in f.node_def]
    nodes += list(graph_def.node)
    return sorted({tf.dtypes.as_dtype(n.attr["T"].type).name
                   for n in nodes if n.op == op_type})


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """One way to all-reduce the gradients.

    Attributes:
      name: label in the results.
      pack_bytes: None: TensorFlow's default (one pack: every gradient
        concatenated into a single collective); N: packs of about N bytes.
      dtype: None (float32) or "bfloat16"/"float16" on the wire.
      per_tensor: one collective per gradient tensor (no batching at all).
    """

    name: str
    pack_bytes: int | None = None
    dtype: str | None = None
    per_tensor: bool = False

    def __post_init__(self):
        if self.pack_bytes is not None and self.pack_bytes <= 0:
            raise ValueError(f"`pack_bytes` should be None or positive, got "
                             f"{self.pack_bytes!r}.")
        if self.dtype is not None and (
                self.dtype not in gradients_lib.ALLREDUCE_DTYPES):
            raise ValueError(
                f"`dtype` is {self.dtype!r}; use None or one of "
                f"{list(gradients_lib.ALLREDUCE_DTYPES)}.")


DEFAULT_CONFIGS = (
    ReduceConfig("per_tensor_float32", per_tensor=True),
    ReduceConfig("one_pack_float32"),
    ReduceConfig("pack_1MiB_float32", pack_bytes=1 << 20),
    ReduceConfig("pack_4MiB_float32", pack_bytes=4 << 20),
    ReduceConfig("pack_16MiB_float32", pack_bytes=16 << 20),
    ReduceConfig("one_pack_bfloat16", dtype="bfloat16"),
    ReduceConfig("pack_4MiB_bfloat16", pack_bytes=4 << 20, dtype="bfloat16"),
    ReduceConfig("one_pack_float16", dtype="float16"),
)
# What every other configuration's time is judged against (paired ratios).
BASELINE = "one_pack_float32"
# Timed inside a whole training step too: the default packing
# (`strategies.DEFAULT_PACK_BYTES`) against TensorFlow's one pack.
TRAIN_STEP_CONFIGS = ("one_pack_float32", "pack_4MiB_float32")
# Examples per replica in the timed training step.
TRAIN_STEP_BATCH = 64


def gradient_shapes(params: int) -> list[tuple[int, ...]]:
    """Variable shapes of an MLP with about `params` parameters.

    Four dense layers of equal width `w` on `w` inputs (4w^2 + 4w
    parameters), so the gradient list mixes large kernels and small biases
    as a real model's does.
    """
    width = max(int((params / 4) ** 0.5), 1)
    shapes = []
    for _ in range(4):
        shapes += [(width, width), (width,)]
    return shapes


def _options(strategy, pack_bytes):
    # The strategy's own options (timeout, implementation) with this
    # configuration's pack size: one strategy per process, several packings.
    base = strategies.communication_options(strategy)
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=pack_bytes or 0, timeout_seconds=base.timeout_seconds,
        implementation=base.implementation)


def _reduce_fn(strategy, shapes, config):
    options = _options(strategy, config.pack_bytes)

    def replica_fn(step):
        # Different values per replica and step; generated on the fly so no
        # 40 MB constant is baked into the graph.
        replica = tf.cast(
            tf.distribute.get_replica_context().replica_id_in_sync_group,
            tf.float32)
        grads = [tf.fill(shape, replica + tf.cast(step, tf.float32))
                 for shape in shapes]
        reduced = _reduced(grads, options, config)
        return tf.add_n([r[0] if r.shape.rank == 1 else r[0, 0]
                         for r in reduced])

    return _loop(strategy, replica_fn)


def _reduced(grads, options, config):
    if config.per_tensor:
        return [gradients_lib.all_reduce_sum(
            [g], options=options, dtype=config.dtype)[0] for g in grads]
    return gradients_lib.all_reduce_sum(grads, options=options,
                                        dtype=config.dtype)


def _train_step_fn(strategy, shapes, config, *, batch=TRAIN_STEP_BATCH):
    """`loop(num_steps)`: training steps of the MLP whose gradients
    `gradient_shapes` describes (Keras dense layers, SGD), each reducing
    its gradients with `config` (None: not at all) and applying them as the
    Trainer does (one explicit reduction, none in the optimizer)."""
    import keras

    width = shapes[0][0]
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((width,))] +
            [keras.layers.Dense(width, activation="relu")
             for _ in range(len(shapes) // 2)])
        optimizer = keras.optimizers.SGD(1e-6)
        optimizer.build(model.trainable_variables)
    gradients_lib.disable_optimizer_reduction(optimizer)
    variables = model.trainable_variables
    options = None if config is None else _options(strategy,
                                                   config.pack_bytes)
    x = tf.random.stateless_normal((batch, width), seed=(0, 1))

    def replica_fn(step):
        del step
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, variables)
        if config is not None:
            grads = _reduced(grads, options, config)
        optimizer.apply(grads, variables)
        return loss

    return _loop(strategy, replica_fn)


def _fill_only_fn(strategy, shapes):
    def replica_fn(step):
        grads = [tf.fill(shape, tf.cast(step, tf.float32)) for shape in shapes]
        return tf.add_n([tf.reduce_sum(g[:1]) for g in grads])

    return _loop(strategy, replica_fn)


def _loop(strategy, replica_fn):
    """`loop(num_steps)`: `replica_fn(step)` on every replica, num_steps
    times in one `tf.function`; the sum of its values keeps it live."""

    @tf.function
    def loop(num_steps):
        total = tf.constant(0.0)
        for step in tf.range(num_steps):
            total += strategy.experimental_local_results(
                strategy.run(replica_fn, args=(step,)))[0]
        return total

    return loop


def _time_once(loop, steps):
    began = time.perf_counter()
    loop(tf.constant(steps)).numpy()
    return (time.perf_counter() - began) / steps


def _time(loop, steps, repeats):
    loop(tf.constant(1))  # trace and warm up
    per_step = [_time_once(loop, steps) for _ in range(repeats)]
    return statistics.median(per_step), per_step


def measure(strategy, *, params: int = 10_000_000, steps: int = 3,
            repeats: int = 5, configs=DEFAULT_CONFIGS) -> dict:
    """Times each all-reduce configuration on this worker.

    Every worker of the cluster must call it with the same arguments (the
    collectives pair up in order).

    Args:
      strategy: a multi-worker strategy (from `create_strategy`).
      params: parameters of the model whose gradients are reduced.
      steps: all-reduces per timed call.
      repeats: rounds; each round times every configuration once, in a
        rotating order, so a burst of load hits neighbours alike; the
        median per configuration is reported, and per configuration the
        paired ratio to `BASELINE` with its 95% interval.
      configs: `ReduceConfig`s to measure.

    Returns:
      {"params", "workers", "gradient_tensors", "fill_only_s": seconds per
      step to make the gradients without reducing them, "configs": {name:
      {"seconds_per_step", "rounds", "collectives_per_step", "wire_dtypes",
      "payload_bytes", "ring_bytes_per_worker", "pack_bytes", "dtype",
      "per_tensor", "speedup_vs_baseline": {"ratio", "low", "high",
      "rounds"} (BASELINE's time / this one's; > 1 is faster)}},
      "train_step": {"batch" (per replica), "layers", "compute_only_s":
      seconds per training step without the all-reduce, "configs": {name
      in TRAIN_STEP_CONFIGS: {"seconds_per_step", "rounds",
      "speedup_vs_baseline"}}}}.
    """
    configs = tuple(configs)
    shapes = gradient_shapes(params)
    num_params = sum(int(tf.TensorShape(s).num_elements()) for s in shapes)
    workers = strategy.num_replicas_in_sync
    fill_only, _ = _time(_fill_only_fn(strategy, shapes), steps, repeats)
    loops = {}
    for config in configs:
        loops[config.name] = _reduce_fn(strategy, shapes, config)
        loops[config.name](tf.constant(1))  # trace and warm up
    times = _rotated_rounds(loops, steps, repeats)
    results = {}
    for config in configs:
        loop = loops[config.name]
        rounds = times[config.name]
        seconds = statistics.median(rounds)
        graph = loop.get_concrete_function(tf.constant(1)).graph.as_graph_def()
        itemsize = tf.dtypes.as_dtype(config.dtype or "float32").size
        payload = num_params * itemsize
        results[config.name] = {
            "seconds_per_step": seconds, "rounds": rounds,
            "collectives_per_step": count_ops(graph, within="while_body"),
            "wire_dtypes": op_dtypes(graph),
            "payload_bytes": payload,
            # A ring all-reduce sends (and receives) 2 (W - 1) / W of the
            # payload per worker: reduce-scatter, then all-gather.
            "ring_bytes_per_worker": int(2 * (workers - 1) / workers *
                                         payload),
            "pack_bytes": config.pack_bytes, "dtype": config.dtype or "float32",
            "per_tensor": config.per_tensor}
        if BASELINE in times:
            results[config.name]["speedup_vs_baseline"] = stats.paired_ratio(
                times[BASELINE], rounds)
    return {"params": num_params, "workers": workers,
            "gradient_tensors": len(shapes), "fill_only_s": fill_only,
            "steps": steps, "repeats": repeats, "configs": results,
            "train_step": _measure_train_step(
                strategy, shapes, [c for c in configs
                                   if c.name in TRAIN_STEP_CONFIGS],
                steps=steps, repeats=repeats)}


def _rotated_rounds(loops, steps, repeats):
    """{name: seconds per step of each round}: each round times every loop
    of `loops` ({name: loop}) once, in an order rotated by the round,
    identically on every worker (the collectives pair up)."""
    names = list(loops)
    times = {name: [] for name in names}
    for index in range(repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_time_once(loops[name], steps))
    return times


def _measure_train_step(strategy, shapes, configs, *, steps, repeats):
    """Seconds per whole training step with each of `configs`, paired
    against one pack, and without any reduction ("compute_only_s")."""
    loops = {"compute_only": _train_step_fn(strategy, shapes, None)}
    for config in configs:
        loops[config.name] = _train_step_fn(strategy, shapes, config)
    for loop in loops.values():
        loop(tf.constant(1))  # trace and warm up
    times = _rotated_rounds(loops, steps, repeats)
    results = {name: {"seconds_per_step": statistics.median(rounds),
                      "rounds": rounds}
               for name, rounds in times.items() if name != "compute_only"}
    if BASELINE in times:
        for name, result in results.items():
            result["speedup_vs_baseline"] = stats.paired_ratio(
                times[BASELINE], times[name])
    return {"batch": TRAIN_STEP_BATCH, "layers": len(shapes) // 2,
            "compute_only_s": statistics.median(times["compute_only"]),
            "configs": results}


def worker_main(*, params: int, steps: int, repeats: int) -> dict:
    """One worker process: creates the strategy from TF_CONFIG, measures."""
    strategy = strategies.create_strategy("multi_worker")
    return measure(strategy, params=params, steps=steps, repeats=repeats)
