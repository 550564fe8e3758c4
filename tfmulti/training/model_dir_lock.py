"""One writer per `model_dir`: a lock file naming its holder (host, pid).

Two jobs writing one `model_dir` silently overwrite each other's
checkpoints (the later writer wins; at times `MergeV2Checkpoints ... did not
exist`). The chief holds an exclusive `flock` on `model_dir/.tfmulti.lock`
while it trains; the kernel releases it when the process exits, however it
exits, so a killed job never leaves a stale lock. Within one process the
lock is shared (a resumed `fit` in the same process is the same writer).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import threading

LOCK_NAME = ".tfmulti.lock"
_held = {}   # realpath -> [file object, count]
_guard = threading.Lock()


class ModelDirLockedError(RuntimeError):
    """Another process is writing the same `model_dir`."""


class Lock:
    """A held `model_dir` lock; `release()` gives it up."""

    def __init__(self, key):
        self._key = key

    def release(self) -> None:
        if self._key is None:
            return
        with _guard:
            entry = _held.get(self._key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del _held[self._key]
                    _unlock(self._key, entry[0])
        self._key = None


def _unlock(key, handle):
    try:
        os.remove(os.path.join(key, LOCK_NAME))
    except OSError:
        pass
    handle.close()   # closing the descriptor releases the flock


def _lock_file(path, model_dir):
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise ModelDirLockedError(
                f"`model_dir` {model_dir!r} is in use by another job "
                f"({holder}); two jobs writing one model_dir overwrite each "
                "other's checkpoints. Give this job its own `model_dir`, or "
                "stop the other job first.") from None
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        # The holder removed the file between our open and our flock: the
        # lock we got is on a file nobody else will open. Try again.
        handle.close()


def acquire(model_dir: str) -> Lock:
    """Locks `model_dir` for this process.

    Raises:
      ModelDirLockedError: another process holds it; the message names it.
    """
    key = os.path.realpath(model_dir)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return Lock(key)
        handle = _lock_file(os.path.join(key, LOCK_NAME), model_dir)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(),
                                 "pid": os.getpid()}))
        handle.flush()
        _held[key] = [handle, 1]
        return Lock(key)


@atexit.register
def _release_all():
    with _guard:
        for key, (handle, _) in list(_held.items()):
            _unlock(key, handle)
        _held.clear()
