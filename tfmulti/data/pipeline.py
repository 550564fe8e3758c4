"""The per-replica input pipeline: shard, shuffle, map, batch, pad, prefetch.

`build_pipeline` is a pure function of a `tf.distribute.InputContext`, so the
whole distribution logic is testable on a grid of pipelines and replicas
without a cluster; `distribute_dataset` hands it to
`strategy.distribute_datasets_from_function`.

Element contract: `dataset_fn(input_context)` yields `(features, label)`
(features a tensor or a dict); `map_fn` maps one such element to another.
Training batches are `(features, label)`; evaluation batches are
`(features, label, sample_weight)` with a float32 weight of 1 for real
examples and 0 for padding, and every replica on every worker gets the same
number of full batches (tensorflow/tensorflow#37112, #58809).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable

import numpy as np
import tensorflow as tf

from tfmulti import compat
from tfmulti.data import eval_padding, finiteness
from tfmulti.data import service as service_lib
from tfmulti.data import sharding as sharding_lib

_log = logging.getLogger(__name__)

# Default shuffle buffer, in elements, when the pipeline's shard is larger.
DEFAULT_SHUFFLE_BUFFER = 10_000
# `cache=None` caches a pipeline's shard in memory up to this size: reading
# and decoding cost 10 ms of CPU per batch of 128 small PNGs, taken from the
# training step on 2 cores; the cached pipeline 0.4 ms (BUILD_NOTES, issue 17).
AUTO_CACHE_BYTES = 256 * 1024 * 1024


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How `build_pipeline` turns a `dataset_fn` into per-replica batches.

    Attributes:
      global_batch_size: examples per step over all replicas.
      training: True repeats, shuffles and drops the remainder; False is an
        exact-once evaluation with padding and sample weights.
      shuffle_buffer: shuffle buffer in elements (training only); None means
        min(pipeline shard size, 10000); 0 turns shuffling off.
      seed: shuffle seed, folded with the input pipeline id so pipelines
        shuffle differently but reproducibly; None for a random seed.
      cache: True caches the sharded, unmapped data in memory; a string
        caches to files with that path prefix (one set per pipeline); None
        (the default) caches in memory when the shard is finite, its
        elements have static shapes and it holds at most
        `AUTO_CACHE_BYTES`; False never caches.
      map_fn: optional `(features, label) -> (features, label)`, applied in
        parallel after caching (so random augmentation differs per epoch).
      drop_remainder: None means True for training and padding for
        evaluation. True in evaluation drops the examples that do not fill a
        step on every replica (faster, not exact-once). False in training is
        refused: a partial batch makes replicas disagree at the epoch end.
      service: a tf.data service dispatcher address (`grpc://host:port`):
        sharding, shuffling and `map_fn` run on its data workers (DYNAMIC
        sharding, one job per pipeline and epoch); repeating, the
        evaluation padding, batching and prefetching stay here. None reads
        in this process.
    """

    global_batch_size: int
    training: bool = True
    shuffle_buffer: int | None = None
    seed: int | None = 0
    cache: bool | str | None = None
    map_fn: Callable | None = None
    drop_remainder: bool | None = None
    service: str | None = None

    def __post_init__(self):
        if not _is_int(self.global_batch_size) or self.global_batch_size < 1:
            raise ValueError(
                "`global_batch_size` should be a positive int (examples per "
                f"step over all replicas), got {self.global_batch_size!r}.")
        if not isinstance(self.training, bool):
            raise ValueError(
                f"`training` should be True or False, got {self.training!r}.")
        if self.shuffle_buffer is not None and (
                not _is_int(self.shuffle_buffer) or self.shuffle_buffer < 0):
            raise ValueError(
                "`shuffle_buffer` should be None (automatic), 0 (no "
                f"shuffling) or a positive int, got {self.shuffle_buffer!r}.")
        if self.seed is not None and (not _is_int(self.seed)
                                      or self.seed < 0):
            raise ValueError(
                "`seed` should be a non-negative int, or None for a random "
                f"shuffle, got {self.seed!r}.")
        if self.cache is not None and not isinstance(self.cache, (bool, str)):
            raise ValueError(
                "`cache` should be None (automatic), True (memory), False, "
                f"or a file path prefix, got {self.cache!r}.")
        if isinstance(self.cache, str):
            parent = os.path.dirname(os.path.abspath(self.cache))
            if not os.path.isdir(parent):
                raise ValueError(
                    f"`cache` is {self.cache!r}, but {parent!r} is not a "
                    "directory" + (" (it is a file)" if os.path.exists(
                        parent) else " (it does not exist)") + ". Give a "
                    "path prefix inside an existing directory.")
        if self.map_fn is not None and not callable(self.map_fn):
            raise ValueError(
                f"`map_fn` should be callable or None, got {self.map_fn!r}.")
        if self.training and self.drop_remainder is False:
            raise ValueError(
                "`drop_remainder`=False with `training`=True: a partial last "
                "batch leaves replicas with different batch sizes or no "
                "batch at all, and the step hangs or fails at the epoch end "
                "(tensorflow/tensorflow#37112). Training repeats the data, "
                "so nothing is lost: leave drop_remainder=None. For an "
                "exact-once pass use training=False.")
        if self.service and self.cache:
            raise ValueError(
                f"`cache`={self.cache!r} with `service`={self.service!r}: "
                "the data workers start every epoch's job afresh, so a "
                "cache would be refilled each epoch and never read. Leave "
                "cache=None (off with a service), or cache inside "
                "dataset_fn what the data workers should keep.")


def _pipeline_seed(seed: int | None, pipeline_id: int) -> int | None:
    if seed is None:
        return None
    state = np.random.SeedSequence([seed, pipeline_id]).generate_state(1)
    return int(state[0])


def _check_element(dataset, what: str) -> None:
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise ValueError(
            f"`{what}` should give `(features, label)` elements, got "
            f"element_spec {spec!r}. Return a 2-tuple, e.g. "
            "`ds.map(lambda ex: (ex['image'], ex['label']))`, or "
            "`as_supervised=True` for TFDS.")
    shapes = [s.shape for s in tf.nest.flatten(spec)]
    if "BatchDataset" in type(dataset).__name__:
        # The last step was .batch()/.padded_batch() (TF's private class
        # names; the warning below covers what this misses).
        raise ValueError(
            f"`{what}` returned a batched dataset (element shapes "
            f"{[str(s) for s in shapes]}); tfmulti batches itself with the "
            "per-replica batch, so batching twice would multiply the batch. "
            "Remove the .batch() and pass `global_batch_size` "
            "(tensorflow/tensorflow#33809).")
    if all(s.rank and s[0] is None for s in shapes):
        # Every component starting with an unknown dimension is what
        # .batch() leaves; batching twice silently multiplies the batch.
        _log.warning(
            "tfmulti: `%s` elements look batched (shapes %s): tfmulti "
            "batches itself with the per-replica batch; return unbatched "
            "elements (tensorflow/tensorflow#33809).", what,
            [str(s) for s in shapes])


def _cardinality(dataset) -> int:
    """Known cardinality, -1 for infinite, else counted once (and logged)."""
    n = int(dataset.cardinality())
    if n == tf.data.INFINITE_CARDINALITY:
        return -1
    if n == tf.data.UNKNOWN_CARDINALITY:
        n = int(dataset.reduce(np.int64(0), lambda count, _: count + 1))
        _log.warning(
            "tfmulti: counted %d elements because the dataset's cardinality "
            "is unknown (after filter() or from files); apply "
            "tf.data.experimental.assert_cardinality(%d) in dataset_fn to "
            "skip the count.", n, n)
    return n


def _fits_auto_cache(dataset, size) -> bool:
    """Whether `size` elements of `dataset` fit `AUTO_CACHE_BYTES`."""
    if not size:
        return False
    element = 0
    for spec in tf.nest.flatten(dataset.element_spec):
        if (not isinstance(spec, tf.TensorSpec) or spec.dtype == tf.string
                or not spec.shape.is_fully_defined()):
            return False
        element += spec.shape.num_elements() * spec.dtype.size
    return size * element <= AUTO_CACHE_BYTES


def _fill_cache(cached) -> None:
    """Reads `cached` (a `.cache()`d shard) once, to its end, now.

    A training run that stops before its iterator has read a whole epoch
    (`--steps`, a preemption, a resume mid-epoch) would otherwise leave the
    cache half written: TensorFlow discards it when the iterator goes and
    warns "The calling iterator did not fully read the dataset being cached"
    (after the run's summary, when the process exits). Iterators of the same
    dataset share its complete cache, so training reads from memory from
    the first step. Costs what the first epoch would have spent reading
    (BUILD_NOTES, "Quiet start"). Only when building eagerly; a dataset
    function traced in a `tf.function` (ParameterServerStrategy's workers)
    keeps filling its cache as it trains.
    """
    if tf.executing_eagerly():
        cached.reduce(np.int64(0), lambda count, _: count + 1)


def _check_service_sharding(dataset_fn, input_context, service) -> None:
    """Refuses element sharding over several pipelines through a service.

    Under DYNAMIC sharding each data worker applies `Dataset.shard` to the
    splits it happens to get, not to the whole dataset: measured on TF 2.21
    with 2 data workers, pipeline 0 of 2 got 101 of 200 elements, 67 of
    them pipeline 1's. File sharding is decided before the data workers see
    the dataset (each pipeline's file list), so it stays exact.
    """
    pipelines = input_context.num_input_pipelines
    if not service or pipelines == 1:
        return
    if isinstance(dataset_fn, sharding_lib.ShardedDatasetFn):
        files = len(dataset_fn.file_lengths())
        if sharding_lib.choose_sharding(
                num_files=files, num_input_pipelines=pipelines,
                sharding=dataset_fn.sharding) == sharding_lib.FILE:
            return
        what = f"{files} file(s) sharded by element"
    else:
        what = "a plain dataset_fn (sharded by element)"
    raise ValueError(
        f"`service`={service!r} with {pipelines} input pipelines needs the "
        f"data sharded by file, but `dataset_fn` is {what}: the data "
        "workers would apply the element sharding to their own part of "
        "the data, so pipelines would see each other's elements and miss "
        "some. Pass `tfmulti.data.files_dataset_fn` or "
        "`tfmulti.tfds_dataset_fn` with at least as many files as input "
        "pipelines (sharding='auto' or 'file'), or read without `service`.")


def _shard(dataset_fn, input_context, service=None):
    """This pipeline's dataset and all pipelines' sizes (None if infinite)."""
    _check_service_sharding(dataset_fn, input_context, service)
    if isinstance(dataset_fn, sharding_lib.ShardedDatasetFn):
        dataset, sizes = dataset_fn.shard(input_context,
                                          dynamic_split=bool(service))
        _check_element(dataset, "dataset_fn")
        return dataset, sizes
    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "`dataset_fn(input_context)` should return a tf.data.Dataset of "
            f"unbatched `(features, label)`, got {type(dataset).__name__}.")
    _check_element(dataset, "dataset_fn")
    pipelines = input_context.num_input_pipelines
    n = _cardinality(dataset)
    if pipelines > 1:
        _log.info("tfmulti: sharding a dataset of %s elements over %d input "
                  "pipelines by element", "infinite" if n < 0 else n,
                  pipelines)
        dataset = dataset.shard(pipelines, input_context.input_pipeline_id)
    if n < 0:
        if pipelines > 1:
            _log.warning(
                "tfmulti: `dataset_fn` returned an infinite dataset, so "
                "pipelines split the repeated stream and each sees every "
                "element over time. Return a finite dataset: tfmulti shards "
                "first and repeats after.")
        return dataset, None
    sharding_lib.check_enough_elements(n, pipelines)
    return dataset, sharding_lib.sizes_by_element(n, pipelines)


def build_pipeline(dataset_fn: Callable, input_context:
                   tf.distribute.InputContext, options: PipelineOptions
                   ) -> tf.data.Dataset:
    """The per-replica batches of one input pipeline.

    Args:
      dataset_fn: `dataset_fn(input_context)` -> unbatched tf.data.Dataset of
        `(features, label)`; sharded here by element, unless it is a
        `ShardedDatasetFn` (TFDS, file lists) that shards itself.
      input_context: which pipeline this is, of how many, and the number of
        replicas in sync.
      options: a `PipelineOptions`.

    Returns:
      A dataset of per-replica batches: `(features, label)` for training
      (infinite), `(features, label, sample_weight)` for evaluation (finite,
      the same number of batches on every pipeline, a multiple of the
      pipeline's replicas).

    Raises:
      ValueError: indivisible batch, too few elements or files, wrong element
        structure, or an infinite dataset in evaluation.
    """
    pipelines = input_context.num_input_pipelines
    pipeline_id = input_context.input_pipeline_id
    per_replica = sharding_lib.per_replica_batch_size(
        options.global_batch_size, input_context.num_replicas_in_sync)
    dataset, sizes = _shard(dataset_fn, input_context, options.service)
    cache = options.cache
    if cache is None:
        cache = not options.service and _fits_auto_cache(
            dataset, sizes and sizes[pipeline_id])
    if cache is not False:
        if sizes is None:
            raise ValueError(
                f"`cache`={options.cache!r} but `dataset_fn` returned an "
                "infinite dataset: the cache would never be complete and "
                "would grow without bound. Remove .repeat() from dataset_fn "
                "(tfmulti repeats after caching) or pass cache=False.")
        dataset = dataset.cache("" if cache is True
                                else f"{cache}_{pipeline_id}")
        if options.training:
            _fill_cache(dataset)
    if options.training:
        size = sizes[pipeline_id] if sizes else None
        buffer = options.shuffle_buffer
        if buffer is None:
            buffer = min(size or DEFAULT_SHUFFLE_BUFFER, DEFAULT_SHUFFLE_BUFFER)
        if buffer > 1:
            dataset = dataset.shuffle(
                buffer, seed=_pipeline_seed(options.seed, pipeline_id),
                reshuffle_each_iteration=True)
        if sizes is not None and not options.service:
            dataset = dataset.repeat()
    elif sizes is None:
        raise ValueError(
            "`training`=False but `dataset_fn` returned an infinite dataset: "
            "an exact-once evaluation needs a finite one. Remove .repeat() "
            "from dataset_fn.")
    if options.map_fn is not None:
        dataset = dataset.map(options.map_fn,
                              num_parallel_calls=tf.data.AUTOTUNE)
        _check_element(dataset, "map_fn")
    local = dataset
    if options.service:
        # Repeating outside the service gives each epoch its own job, so
        # DYNAMIC sharding's "at most once" holds per epoch.
        dataset = service_lib.distribute(dataset, options.service,
                                         transfer_batch=per_replica)
        if sizes is not None:
            dataset = service_lib.count_delivered(
                dataset, expected=sizes[pipeline_id],
                pipeline_id=pipeline_id, training=options.training)
        dataset = dataset.unbatch()
        if options.training and sizes is not None:
            dataset = dataset.repeat()
    if not options.training:
        replicas_here = input_context.num_replicas_in_sync // pipelines
        dataset = eval_padding.pad_to_steps(
            dataset, sizes, pipeline_id=pipeline_id,
            step_examples=replicas_here * per_replica,
            drop_remainder=options.drop_remainder, like=local)
    dataset = dataset.batch(per_replica, drop_remainder=True)
    # From-function input is never auto-sharded; OFF also stops a second,
    # wrong sharding if someone passes this to experimental_distribute_dataset.
    data_options = tf.data.Options()
    data_options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return dataset.with_options(data_options).prefetch(tf.data.AUTOTUNE)


def distribute_dataset(strategy: tf.distribute.Strategy,
                       dataset_fn: Callable, *, global_batch_size: int,
                       training: bool = True,
                       shuffle_buffer: int | None = None,
                       seed: int | None = 0,
                       cache: bool | str | None = None,
                       map_fn: Callable | None = None,
                       drop_remainder: bool | None = None,
                       service: str | None = None):
    """The distributed dataset of `dataset_fn` for `strategy`.

    Each input pipeline (one per worker) calls `dataset_fn(input_context)`,
    shards the result (by element, or by file for `tfds_dataset_fn` and
    `files_dataset_fn`), caches, shuffles with a seed folded per pipeline,
    repeats (training), maps in parallel, batches with the per-replica batch
    and prefetches. Goes through `strategy.distribute_datasets_from_function`.

    Args:
      strategy: the tf.distribute strategy the data feeds.
      dataset_fn: `dataset_fn(input_context)` -> UNBATCHED tf.data.Dataset of
        `(features, label)`.
      global_batch_size: examples per step over all replicas; divided by the
        number of replicas in sync.
      training: True for an infinite, shuffled stream of full batches (pass
        `steps_per_epoch` to Keras `fit`); False for one exact-once pass
        with `(features, label, sample_weight)` batches, the weight 0 on
        padding (in Keras `compile`, use `weighted_metrics` so padding does
        not count; the `loss` of `tfmulti.keras.distributed`'s `evaluate`
        leaves it out itself).
      shuffle_buffer: elements in the shuffle buffer; None is automatic, 0
        turns shuffling off.
      seed: shuffle seed (None: random).
      cache: True caches the sharded data in memory, a string to files;
        None (default) in memory when it is finite and small (see
        `PipelineOptions`).
      map_fn: `(features, label) -> (features, label)`, run in parallel.
      drop_remainder: see `PipelineOptions`.
      service: a tf.data service dispatcher's `host:port`: sharding,
        shuffling and `map_fn` run on its data workers (each element at
        most once per epoch, all of them unless a data worker dies;
        evaluation still exactly once per pipeline without faults). None
        (default) reads `TFMULTI_DATA_SERVICE`; "" never uses a service.

    Returns:
      A `tf.distribute.DistributedDataset` of per-replica batches.

    Raises:
      ValueError: bad arguments (named).
      ConnectionError: `service` given but no dispatcher reachable there
        within `tfmulti.data.service.CONNECT_TIMEOUT_SECONDS`.
    """
    if not callable(dataset_fn):
        raise ValueError(
            "`dataset_fn` should be a callable dataset_fn(input_context) "
            f"returning an unbatched tf.data.Dataset, got "
            f"{type(dataset_fn).__name__}. Wrap a dataset as "
            "`lambda input_context: dataset`.")
    address = service_lib.resolve_address(service)
    options = PipelineOptions(
        global_batch_size=global_batch_size, training=training,
        shuffle_buffer=shuffle_buffer, seed=seed, cache=cache, map_fn=map_fn,
        drop_remainder=drop_remainder, service=address)
    if address:
        service_lib.check_reachable(address)
        _log.info("tfmulti: input preprocessing on the tf.data service at "
                  "%s (DYNAMIC sharding: each element at most once per "
                  "epoch)", address)
    replicas = strategy.num_replicas_in_sync
    per_replica = sharding_lib.per_replica_batch_size(global_batch_size,
                                                      replicas)
    _log.info("tfmulti: global batch %d = %d replica(s) x per-replica batch "
              "%d (%s)", global_batch_size, replicas, per_replica,
              "training" if training else "evaluation")
    distributed = strategy.distribute_datasets_from_function(
        functools.partial(build_pipeline, dataset_fn, options=options))
    if training:
        return finiteness.mark_endless(distributed)
    compat.set_global_steps(distributed, strategy)
    eval_padding.mark(distributed)
    return distributed
