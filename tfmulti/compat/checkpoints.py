"""TensorFlow checkpoints: what is trackable, and paths with glob
characters."""

from __future__ import annotations

import contextlib
import os
import tempfile

import tensorflow as tf


# --- Distributed iterators cannot be checkpointed --------------------------
# Symptom: iterators of `strategy.experimental_distribute_dataset` /
# `distribute_datasets_from_function` are not trackable in TF 2.21, so a
# resumed job replays the consumed batches instead of restoring the
# position. Checked: TF 2.21.0.
# Guard: test_compat.py (distributed_iterator_not_trackable).
def is_trackable(obj) -> bool:
    """Whether `obj` can go into a `tf.train.Checkpoint`."""
    return isinstance(obj, tf.__internal__.tracking.Trackable)


# --- tf.train.latest_checkpoint globs the directory ------------------------
# Symptom: `latest_checkpoint` checks the path from the `checkpoint` state
# file with a glob, so a `model_dir` containing `[` `]` (a sweep dir like
# `lr[0.1]`) never resumes; a junk state file hides intact checkpoints.
# Checked: TF 2.21.0.
# Guard: test_compat.py::test_latest_checkpoint_still_globs.
def checkpoint_prefixes(directory: str, *, basename: str = "ckpt"
                        ) -> list[tuple[int, str]]:
    """`(number, prefix)` of the complete `<basename>-N` checkpoints in
    `directory`, oldest first, read from the directory listing (no glob, no
    state file). A checkpoint is complete when its `.index` exists."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        stem, _, suffix = name.rpartition(".")
        head, _, number = stem.rpartition("-")
        if suffix == "index" and head == basename and number.isdigit():
            found.append((int(number), os.path.join(directory, stem)))
    return sorted(found)


# --- Checkpoint readers glob the prefix ------------------------------------
# Symptom: `tf.train.Checkpoint.restore` and `tf.train.load_checkpoint` of a
# prefix whose path contains `[` `]` (or `*`, `?`) fail: "Unsuccessful
# TensorSliceReader constructor: Failed to find any matching files", and an
# escaped path is not found either; writing works. Checked: TF 2.21.0.
# Guard: test_compat.py::test_checkpoint_readers_still_glob.
_GLOB_CHARACTERS = frozenset("[]*?")


@contextlib.contextmanager
def readable_checkpoint(prefix: str):
    """Yields a prefix TensorFlow can read for checkpoint `prefix`: itself,
    or, when its path has glob characters, a temporary directory of
    symbolic links to its files."""
    if not _GLOB_CHARACTERS & set(prefix):
        yield prefix
        return
    directory, stem = os.path.split(prefix)
    with tempfile.TemporaryDirectory(prefix="tfmulti-ckpt-") as links:
        for name in os.listdir(directory):
            if name.startswith(stem + "."):
                os.symlink(os.path.join(directory, name),
                           os.path.join(links, name))
        yield os.path.join(links, stem)
