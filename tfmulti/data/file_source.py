"""`files_dataset_fn`: a user's list of record files, sharded by file.

A `dataset_fn` that knows its files applies tfmulti's sharding rule (by file
when there are at least as many files as input pipelines, else by element)
instead of tf.data's AUTO guess.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfmulti.data import sharding as sharding_lib

_log = logging.getLogger(__name__)


class FilesDatasetFn(sharding_lib.ShardedDatasetFn):
    """Reads record files sharded per input pipeline; see `files_dataset_fn`."""

    def __init__(self, files: Sequence[str], *, reader: Callable,
                 parse_fn: Callable | None, examples_per_file, sharding: str):
        super().__init__(sharding=sharding)
        self.files = list(files)
        self._reader = reader
        self._parse_fn = parse_fn
        self._lengths = (None if examples_per_file is None
                         else [int(n) for n in examples_per_file])

    def file_lengths(self) -> list[int]:
        if self._lengths is None:
            # One pass over the raw records, once; exact-once evaluation and
            # the too-few-elements check need the counts.
            self._lengths = [
                int(self._reader(f).reduce(np.int64(0), lambda n, _: n + 1))
                for f in self.files]
            _log.info("tfmulti: counted %d records in %d files (pass "
                      "`examples_per_file` to skip the count)",
                      sum(self._lengths), len(self.files))
        return self._lengths

    def read(self, input_context, *, dynamic_split=False):
        del dynamic_split  # no length check to drop
        files = self.files
        if input_context is not None:
            files = files[input_context.input_pipeline_id::
                          input_context.num_input_pipelines]
        dataset = tf.data.Dataset.from_tensor_slices(files).interleave(
            self._reader, cycle_length=min(len(files), 16),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self._parse_fn is not None:
            dataset = dataset.map(self._parse_fn,
                                  num_parallel_calls=tf.data.AUTOTUNE)
        return dataset


def files_dataset_fn(files: str | Sequence[str], *,
                     reader: Callable = tf.data.TFRecordDataset,
                     parse_fn: Callable | None = None,
                     examples_per_file: Sequence[int] | None = None,
                     sharding: str = sharding_lib.AUTO) -> FilesDatasetFn:
    """A `dataset_fn` over record files that shards them per input pipeline.

    Args:
      files: a glob pattern or a list of paths; the order is kept (a pattern
        is sorted), file `k` goes to pipeline `k % num_input_pipelines`.
      reader: `reader(path)` -> dataset of raw records.
      parse_fn: record -> `(features, label)`; required unless the reader
        already yields such pairs.
      examples_per_file: records in each file; counted once if None.
      sharding: `"auto"` (file if enough files, else element), `"file"` or
        `"element"`.

    Returns:
      A `dataset_fn` for `tfmulti.distribute_dataset`.

    Raises:
      ValueError: no files, or `examples_per_file` of the wrong length.
    """
    paths = (sorted(tf.io.gfile.glob(files)) if isinstance(files, str)
             else [str(f) for f in files])
    if not paths:
        raise ValueError(
            f"`files`={files!r} matched no file. Pass a glob pattern such as "
            "'/data/train-*.tfrecord' or a non-empty list of paths.")
    if examples_per_file is not None and len(examples_per_file) != len(paths):
        raise ValueError(
            f"`examples_per_file` has {len(examples_per_file)} entries for "
            f"{len(paths)} files; give one count per file, in file order, or "
            "None to count them.")
    return FilesDatasetFn(paths, reader=reader, parse_fn=parse_fn,
                          examples_per_file=examples_per_file,
                          sharding=sharding)
