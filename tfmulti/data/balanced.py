"""The global batch re-split among replicas by shares held in a variable.

Every replica (on every worker) receives the whole global batch, from the
same seeded stream; inside the traced step, replica `r` keeps rows
`[offset_r, offset_r + count_r)`, where the counts are read from a
`tf.Variable`. So:

* every example of the global batch is used exactly once per step, whatever
  the shares, and the global batch is the one an even split (or one device)
  sees: balancing changes speed, never results;
* a change of the shares is an `assign` between loops: the traced batch
  dimension is unknown, nothing is retraced;
* the cut happens at step time, not in the input pipeline, so batches that
  were prefetched before a change cannot be cut with the old shares on one
  worker and the new ones on another;
* a replica computes only its own rows (padding to the largest share would
  make the slow replica compute as many rows as the fast one).

The cost: each worker reads, and each local replica holds, the whole
global batch every step.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.data import pipeline as pipeline_lib


class _OneContext:
    """The input context of the one, unsharded global stream."""

    num_input_pipelines = 1
    input_pipeline_id = 0
    num_replicas_in_sync = 1


def global_batches(dataset_fn, *, global_batch_size: int, seed: int | None
                   = 0, shuffle_buffer: int | None = None, map_fn=None,
                   cache=None) -> tf.data.Dataset:
    """The training stream of whole global batches: `dataset_fn` read
    unsharded, shuffled with `seed`, repeated, mapped and batched, the same
    on every worker (so `seed` must not be None on several workers)."""
    return pipeline_lib.build_pipeline(
        dataset_fn, _OneContext(), pipeline_lib.PipelineOptions(
            global_batch_size=global_batch_size, training=True, seed=seed,
            shuffle_buffer=shuffle_buffer, map_fn=map_fn, cache=cache))


def static_batch_size(dataset) -> int | None:
    """The one static batch size of `dataset`'s elements, else None."""
    shapes = [s.shape for s in tf.nest.flatten(dataset.element_spec)]
    sizes = {s[0] if s.rank else None for s in shapes}
    return sizes.pop() if len(sizes) == 1 else None


class BalancedIterator:
    """Per-replica slices of each global batch, cut by `counts`.

    Used like a distributed iterator inside the traced train loop:
    `next(iterator)` (in cross-replica context) returns per-replica values
    whose batch dimension is the replica's count.

    Args:
      strategy: the strategy whose replicas train.
      dataset: a `tf.data.Dataset` of whole global batches of static size
        `global_batch_size` (`global_batches` builds one from a
        `dataset_fn`), identical on every worker.
      counts: an int32 `tf.Variable` of shape [num_replicas_in_sync], the
        examples each replica takes; it must sum to the global batch.
    """

    def __init__(self, strategy, dataset: tf.data.Dataset, counts):
        size = static_batch_size(dataset)
        if size is None:
            raise ValueError(
                "Balanced training needs global batches of one static size, "
                f"got element_spec {dataset.element_spec!r}. Batch with "
                "drop_remainder=True, or pass a dataset_fn with "
                "`global_batch_size`.")
        replicas = strategy.num_replicas_in_sync
        if counts.shape != (replicas,):
            raise ValueError(
                f"`counts` has shape {counts.shape}, not ({replicas},): one "
                "count per replica in sync.")
        self.global_batch_size = size
        self._strategy = strategy
        self._counts = counts
        local = len(strategy.extended.worker_devices)
        # Local replicas take consecutive elements of a worker's dataset:
        # each gets its own copy of the same global batch.
        repeated = dataset.flat_map(
            lambda *batch: tf.data.Dataset.from_tensors(
                batch if len(batch) > 1 else batch[0]).repeat(local))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        repeated = repeated.with_options(options)
        # Kept for Keras's `fit`, which takes a distributed dataset and then
        # trains from the iterator `iter()` gives (`tfmulti.keras.
        # fit_balance`): each replica's whole global batch, before the cut.
        self.distributed = strategy.distribute_datasets_from_function(
            lambda _: repeated)
        self._inner = iter(self.distributed)
        self.element_spec = tf.nest.map_structure(
            lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype),
            dataset.element_spec)

    @property
    def counts(self):
        return self._counts

    def _cut(self, batch):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        counts = tf.convert_to_tensor(self._counts)
        begin = tf.reduce_sum(counts[:replica])
        end = begin + counts[replica]
        return tf.nest.map_structure(lambda t: t[begin:end], batch)

    def __iter__(self):
        return self

    def __next__(self):
        return self._strategy.run(self._cut, args=(next(self._inner),))

    def get_next(self):
        return next(self)


def create_counts(strategy, counts) -> tf.Variable:
    """The int32 share variable for `BalancedIterator`, mirrored on every
    replica of `strategy` (assigned between loops, read in replica
    context)."""
    with strategy.scope():
        return tf.Variable(tf.constant(counts, tf.int32), trainable=False,
                           name="balance_counts")
