"""Keras's own file writers on several workers: the chief writes the user's
paths, every other worker writes to a temporary path of its own, removed
when it is done.

A script written for one machine saves with `model.save(path)`,
`save_weights`, `export` and Keras's `ModelCheckpoint`, `BackupAndRestore`,
`TensorBoard` and `CSVLogger` callbacks, all given one set of paths. Moved
to several workers, every worker runs that code; Keras 3 (unlike Keras 2)
then writes each file from every worker (`compat.wrap_keras_writes` has the
symptoms). Under tfmulti's multi-worker strategy, with the user's code
unchanged:

- every worker still runs each save (saving may read variables through
  collectives); a non-chief writes to `worker_temp_dir(<path's
  directory>)`, removed right after the save, or when `fit` ends for a
  callback's files;
- the chief writes `.keras` and `.weights.h5` files under a temporary name
  in the same directory and renames them into place, so a reader (another
  worker, a restart after SIGKILL) sees the old file or the new one, never
  part of one;
- Keras's `BackupAndRestore` restores on every worker from the chief's
  `backup_dir` (which must be on storage every worker reads) and backs up
  from the chief only.

A Keras writer callback whose path attributes this Keras no longer has
stops `fit` before its first step with an error naming it and the
alternative, `tfmulti.keras.callbacks`. `keras.saving.save_model(model,
path)` called directly (not `model.save`) is not covered.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import warnings

import keras

from tfmulti import cluster as cluster_lib
from tfmulti import compat
from tfmulti.rundir import worker_temp_dir

# A callback's paths as the user gave them, while they are redirected.
_SHARED = "_tfmulti_shared_paths"
# Temporary directories of this process not yet removed (removed at exit).
_pending = set()
# This process's model writes under a multi-worker strategy, counted.
_writes = itertools.count()
# How long a non-chief's save waits for the chief's matching one.
WAIT_SECONDS = 120.0


def install() -> None:
    """Wraps Keras's writers (once per process); a no-op for models not
    under tfmulti's multi-worker strategy."""
    compat.wrap_keras_writes(_model_write, _callback_list_hook)


def _cluster_of(model):
    """The cluster of `model`'s strategy if it is tfmulti's multi-worker
    strategy over more than one worker, else None."""
    strategy = compat.model_strategy(model) if model is not None else None
    if not isinstance(strategy, compat.KerasMultiWorkerMirroredStrategy):
        return None
    cluster = cluster_lib.of_strategy(strategy)
    return cluster if cluster.num_workers > 1 else None


def _temp_dir(path, cluster) -> str:
    directory = worker_temp_dir(path, cluster=cluster)
    os.makedirs(directory, exist_ok=True)
    _pending.add(directory)
    return directory


def _remove(directory) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    _pending.discard(directory)


@atexit.register
def _remove_pending():
    for directory in list(_pending):
        _remove(directory)


def _is_local(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path)


def _private(path, cluster) -> bool:
    """Whether `path` is in this worker's temporary directory already (a
    non-chief's path from `tfmulti.keras.callbacks`)."""
    suffix = f"-worker{cluster.worker_rank}"
    return any(part.startswith("tfmulti-") and part.endswith(suffix)
               for part in os.path.abspath(os.fspath(path)).split(os.sep))


# -- model.save / save_weights / export ---------------------------------------

def _model_write(name, original, model, filepath=None, *args, **kwargs):
    cluster = _cluster_of(model)
    if cluster is None or not isinstance(filepath, (str, os.PathLike)):
        return original(model, filepath, *args, **kwargs)
    # The chief announces its n-th write; a non-chief's n-th write returns
    # once it is done, so a load right after it reads the chief's new
    # file. A chief-only save (`if is_chief: ...`) never waits.
    key = f"tfmulti/keras_write/{next(_writes)}"
    if cluster.is_chief:
        try:
            return _chief_write(name, original, model, filepath, *args,
                                **kwargs)
        finally:
            compat.publish_key(key)
    path = os.path.abspath(os.fspath(filepath))
    if _private(path, cluster):
        result = original(model, filepath, *args, **kwargs)
    else:
        directory = _temp_dir(path, cluster)
        try:
            result = original(model, os.path.join(
                directory, os.path.basename(path)), *args, **kwargs)
        finally:
            _remove(directory)
    if not compat.wait_for_key(key, WAIT_SECONDS):
        warnings.warn(
            f"tfmulti: the chief did not confirm its write matching this "
            f"worker's `model.{name}({filepath!r})` within {WAIT_SECONDS:g} "
            "s; reading the chief's file now may find an older one.",
            UserWarning, stacklevel=3)
    return result


def _chief_write(name, original, model, filepath, *args, **kwargs):
    path = os.path.abspath(os.fspath(filepath))
    if name == "export" or not _is_local(filepath) or kwargs.get(
            "max_shard_size") or (os.path.exists(path) and not kwargs.get(
                "overwrite", args[0] if args else True)):
        # A directory, a remote path, several shards, or Keras's own
        # overwrite prompt.
        return original(model, filepath, *args, **kwargs)
    # Same directory and suffix (Keras checks it): renamed into place.
    directory, base = os.path.split(path)
    partial = os.path.join(directory, f".tfmulti-{os.getpid()}-{base}")
    try:
        result = original(model, partial, *args, **kwargs)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return result


# -- Keras's writer callbacks ---------------------------------------------------

def _writers(callback_list):
    """(callback, attribute names) of the Keras writer callbacks in the list."""
    kinds = compat.callback_write_paths()
    for callback in callback_list.callbacks:
        for cls, names in kinds.items():
            if isinstance(callback, cls):
                yield callback, names
                break


def _check(callback, names, directory=None):
    """Refuses `callback` if it lacks a path attribute, or (on a non-chief,
    redirected to `directory`) one points elsewhere: it keeps its paths
    where tfmulti cannot see them, so every worker would write them."""
    wrong = [n for n in names if not isinstance(
        getattr(callback, n, None), (str, os.PathLike)) or (
            directory is not None and not _inside(getattr(callback, n),
                                                  directory))]
    if wrong:
        raise ValueError(
            f"{type(callback).__name__} cannot be made to write from the "
            f"chief only on several workers: after `set_model` its "
            f"{wrong} are not the paths tfmulti sends to a temporary "
            "directory on the other workers, so every worker would write "
            "the same files. Use tfmulti.keras.callbacks(model_dir) "
            "(BackupAndRestore, ModelCheckpoint, TensorBoard) instead, or "
            "write from the chief only (tfmulti.cluster_config().is_chief).")


def _inside(path, directory) -> bool:
    path = os.path.abspath(os.fspath(path))
    return os.path.commonpath([path, directory]) == directory


def _redirect(callback, names, cluster):
    """Points `callback`'s write paths (those it has now) into this
    worker's temporary directory, keeping the user's to restore."""
    shared = getattr(callback, _SHARED, None)
    if shared is None:
        # The first name is the root (directory or file): the directory is
        # made from it, and the others keep their place below it.
        root = os.path.abspath(os.fspath(getattr(callback, names[0])))
        shared = {"_tfmulti_temp": _temp_dir(root, cluster),
                  "_tfmulti_root": root}
        setattr(callback, _SHARED, shared)
    directory = shared["_tfmulti_temp"]
    base = os.path.dirname(shared["_tfmulti_root"])
    for n in names:
        value = getattr(callback, n, None)
        if not isinstance(value, (str, os.PathLike)) or _inside(value,
                                                                directory):
            continue
        shared.setdefault(n, os.fspath(value))
        setattr(callback, n, os.path.join(directory, os.path.relpath(
            os.path.abspath(os.fspath(value)), base)))
    return directory


def _restore(callback):
    """The user's paths back; returns the temporary directory (or None)."""
    shared = getattr(callback, _SHARED, None)
    if shared is None:
        return None
    for n, value in shared.items():
        if not n.startswith("_tfmulti"):
            setattr(callback, n, value)
    delattr(callback, _SHARED)
    return shared["_tfmulti_temp"]


def _callback_list_hook(name, original, callback_list, *args, **kwargs):
    model = args[0] if name == "set_model" and args else getattr(
        callback_list, "model", None)
    cluster = _cluster_of(model)
    if cluster is None:
        return original(callback_list, *args, **kwargs)
    writers = list(_writers(callback_list))
    if name == "set_model":
        # Each callback's `set_model` may write already (TensorBoard's model
        # summary): its paths are redirected before and after it. Checked
        # before the first step (`fit` makes the list, then trains).
        if not cluster.is_chief:
            for callback, names in writers:
                root = getattr(callback, names[0], None)
                if isinstance(root, (str, os.PathLike)) and not _private(
                        root, cluster):
                    _redirect(callback, names, cluster)
        result = original(callback_list, *args, **kwargs)
        for callback, names in writers:
            directory = None
            if not cluster.is_chief and hasattr(callback, _SHARED):
                directory = _redirect(callback, names, cluster)
            _check(callback, names, directory)
        return result
    if name == "on_train_begin":
        # Keras's BackupAndRestore restores from the chief's backup: on
        # every worker it reads there, then writes to its own again.
        backups = [(callback, names) for callback, names in writers
                   if isinstance(callback, keras.callbacks.BackupAndRestore)
                   and _restore(callback) is not None]
        try:
            return original(callback_list, *args, **kwargs)
        finally:
            for callback, names in backups:
                _redirect(callback, names, cluster)
    # on_train_end: the callbacks close their files, then the temporary
    # directories go; the user's paths come back for a later `fit`.
    try:
        return original(callback_list, *args, **kwargs)
    finally:
        if not cluster.is_chief:
            for callback, _ in writers:
                directory = _restore(callback)
                if directory is not None:
                    _remove(directory)
