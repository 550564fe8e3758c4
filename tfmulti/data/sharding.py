"""Sharding of a dataset over input pipelines: the rule, its checks, its sizes.

tf.data's AUTO policy guesses (FILE if it can find files, else DATA) and a
wrong guess starves or hangs a worker (tensorflow/tensorflow#35878, #36846).
tfmulti decides instead, with one rule, and logs the decision:

* by file when there are at least as many files as input pipelines: file `k`
  goes to pipeline `k % num_input_pipelines`, and no pipeline reads another's
  files;
* else by element: every pipeline reads everything and keeps element `k` when
  `k % num_input_pipelines` is its id.

Too few files (when file sharding is forced) or too few elements is an error
that gives the numbers and the fix, raised before any step can hang.
"""

from __future__ import annotations

import abc
import logging
from typing import Sequence

import tensorflow as tf

_log = logging.getLogger(__name__)

AUTO = "auto"
FILE = "file"
ELEMENT = "element"
POLICIES = (AUTO, FILE, ELEMENT)


def check_policy(sharding: str) -> str:
    """Returns `sharding` if it is one of `POLICIES`, else raises ValueError."""
    if sharding not in POLICIES:
        raise ValueError(
            f"`sharding` should be one of {list(POLICIES)}, got {sharding!r}. "
            "Use 'auto' to shard by file when there are enough files and by "
            "element otherwise.")
    return sharding


def choose_sharding(*, num_files: int, num_input_pipelines: int,
                    sharding: str = AUTO) -> str:
    """Decides how a file-backed source is sharded, and logs the decision.

    Args:
      num_files: number of files the source reads.
      num_input_pipelines: number of input pipelines (workers) sharing it.
      sharding: `"auto"` applies the rule (file when `num_files >=
        num_input_pipelines`, else element); `"file"` or `"element"` forces
        a policy.

    Returns:
      `"file"` or `"element"`.

    Raises:
      ValueError: `sharding` is unknown, or `"file"` was forced with fewer
        files than input pipelines.
    """
    check_policy(sharding)
    if sharding == FILE:
        check_enough_files(num_files, num_input_pipelines)
        chosen = FILE
    elif sharding == ELEMENT or num_input_pipelines == 1:
        chosen = ELEMENT
    else:
        chosen = FILE if num_files >= num_input_pipelines else ELEMENT
    _log.info("tfmulti: sharding %d file(s) over %d input pipeline(s) by %s "
              "(sharding=%r)", num_files, num_input_pipelines, chosen,
              sharding)
    return chosen


def check_enough_files(num_files: int, num_input_pipelines: int) -> None:
    """Raises ValueError unless every input pipeline gets at least one file."""
    if num_files < num_input_pipelines:
        raise ValueError(
            f"`sharding`='file' but the dataset has {num_files} file(s) for "
            f"{num_input_pipelines} input pipelines: "
            f"{num_input_pipelines - num_files} pipeline(s) would read "
            "nothing and their replicas would wait forever at the first "
            "step. Use sharding='auto' or 'element', write the data into at "
            f"least {num_input_pipelines} files (for TFDS: "
            f"download_and_prepare(download_config=tfds.download."
            f"DownloadConfig(num_shards={num_input_pipelines}))), or run "
            "fewer workers.")


def check_enough_elements(num_elements: int, num_shards: int) -> None:
    """Raises ValueError unless every one of `num_shards` gets an element."""
    if num_elements < num_shards:
        raise ValueError(
            f"The dataset has {num_elements} element(s) but is sharded over "
            f"{num_shards} input pipelines: {num_shards - num_elements} "
            "pipeline(s) would get no data and their replicas would wait "
            f"forever. Use a dataset of at least {num_shards} elements or run "
            f"fewer than {max(num_elements, 1) + 1} workers.")


def per_replica_batch_size(global_batch_size: int,
                           num_replicas_in_sync: int) -> int:
    """The per-replica batch; raises ValueError if the split is uneven."""
    if global_batch_size % num_replicas_in_sync:
        lower = global_batch_size // num_replicas_in_sync * num_replicas_in_sync
        upper = lower + num_replicas_in_sync
        suggestion = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"`global_batch_size`={global_batch_size} is not divisible by "
            f"the {num_replicas_in_sync} replicas in sync "
            f"({global_batch_size} % {num_replicas_in_sync} = "
            f"{global_batch_size % num_replicas_in_sync}); every replica "
            "needs the same batch. Use a multiple of "
            f"{num_replicas_in_sync}, e.g. {suggestion}.")
    return global_batch_size // num_replicas_in_sync


def sizes_by_element(num_elements: int, num_shards: int) -> list[int]:
    """Elements each shard gets from `Dataset.shard(num_shards, i)`."""
    return [len(range(i, num_elements, num_shards))
            for i in range(num_shards)]


def sizes_by_file(file_lengths: Sequence[int], num_shards: int) -> list[int]:
    """Elements each shard gets when file `k` goes to shard `k % num_shards`."""
    return [sum(file_lengths[i::num_shards]) for i in range(num_shards)]


class ShardedDatasetFn(abc.ABC):
    """A `dataset_fn` over files that shards itself per input pipeline.

    `tfmulti.distribute_dataset` shards a plain `dataset_fn` by element. A
    subclass (`tfmulti.tfds_dataset_fn`, `tfmulti.data.files_dataset_fn`)
    knows its files and their lengths, so it applies the file-or-element rule
    and tells the pipeline how many examples each input pipeline gets, which
    exact-once evaluation needs.
    """

    def __init__(self, *, sharding: str = AUTO):
        self.sharding = check_policy(sharding)

    @abc.abstractmethod
    def file_lengths(self) -> list[int]:
        """Examples in each file, in reading order."""

    @abc.abstractmethod
    def read(self, input_context: tf.distribute.InputContext | None, *,
             dynamic_split: bool = False) -> tf.data.Dataset:
        """`(features, label)` elements of this pipeline's files, or of every
        file when `input_context` is None. With `dynamic_split` the dataset
        runs on tf.data service data workers, each of which reads only the
        files the dispatcher hands it: no check of the total length there."""

    def shard(self, input_context: tf.distribute.InputContext, *,
              dynamic_split: bool = False
              ) -> tuple[tf.data.Dataset, list[int]]:
        """This pipeline's part of the data, and every pipeline's size.

        Args:
          input_context: which pipeline this is, of how many.
          dynamic_split: the dataset is split among tf.data service data
            workers (see `read`).

        Returns:
          `(dataset, sizes)`: this pipeline's `(features, label)` elements,
          sharded by file or by element, and the number of examples each
          input pipeline gets, in pipeline order.
        """
        pipelines = input_context.num_input_pipelines
        lengths = self.file_lengths()
        policy = choose_sharding(num_files=len(lengths),
                                 num_input_pipelines=pipelines,
                                 sharding=self.sharding)
        check_enough_elements(sum(lengths), pipelines)
        if policy == FILE:
            sizes = sizes_by_file(lengths, pipelines)
            if min(sizes) == 0:
                raise ValueError(
                    f"Sharding {len(lengths)} files by file gives input "
                    f"pipelines {sizes} examples: pipeline "
                    f"{sizes.index(0)} would read only empty files and its "
                    "replicas would wait forever. Use sharding='element' or "
                    "drop the empty files.")
            return self.read(input_context, dynamic_split=dynamic_split), sizes
        dataset = self.read(None, dynamic_split=dynamic_split)
        if pipelines > 1:
            dataset = dataset.shard(pipelines, input_context.input_pipeline_id)
        return dataset, sizes_by_element(sum(lengths), pipelines)

    def __call__(self, input_context: tf.distribute.InputContext
                 ) -> tf.data.Dataset:
        """This pipeline's part of the data (see `shard`)."""
        return self.shard(input_context)[0]
