"""TensorFlow's C++ start-up lines, kept off a run's output; real ones kept.

On a CPU-only machine TensorFlow 2.21 prints, before a program's first line,
absl's "WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR" (once per library that carries its own absl), info lines
(oneDNN, "Could not find cuda drivers"), `E ... failed call to cuInit ...
(303)`, and at each distributed iterator `W ... dataset.cc:997] Input of
GeneratorDatasetOp::Dataset will not be optimized` (MirroredStrategy's
multi-device iterator, inside TensorFlow). No setting reaches only those
(measured, TF 2.21.0; BUILD_NOTES "Quiet start"):

- `TF_CPP_MIN_LOG_LEVEL=1` hides TensorFlow's own info lines, but the lines
  written while its libraries load come before it is read: every level
  leaves them. 2 hides every warning, real ones too; 3 hides cuInit's line
  only by hiding every error.
- `TF_CPP_VMODULE` and `TF_CPP_MAX_VLOG_LEVEL` act on VLOG lines only.

So `quiet(argv)`, called by an entry point before TensorFlow is imported,
sets `TF_CPP_MIN_LOG_LEVEL=1` (unless set) and passes the process's stderr
(file descriptor 2, which C++ writes to) through a filter that drops only
the lines `is_noise` names and forwards everything else as it comes. The
filter is a separate small process (this file run by path, standard library
only), so what a crashing process writes last (a CHECK failure, a
segfault's stack) still gets out: a thread of the process itself would die
with it. `--verbosity` (absl's flag, also in a `--flagfile`) or
`TF_CPP_MIN_LOG_LEVEL=0` turns all of it off.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
from typing import Iterable, Mapping

# Lines dropped, each with why it says nothing a user can act on.
NOISE = tuple(re.compile(p) for p in (
    # absl's note that it is not initialised: once per library, on import.
    r"WARNING: All log messages before absl::InitializeLog\(\) is called "
    r"are written to STDERR$",
    # Info lines: TF_CPP_MIN_LOG_LEVEL=1 hides TensorFlow's own; these are
    # the ones written while its libraries load, before it is read.
    r"I\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] ",
    # No CUDA driver installed (303: the stub found no libcuda); tfmulti's
    # device line says "no GPU found". Other cuInit errors stay.
    r"E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit: "
    r".*\(303\)$",
    # MirroredStrategy's per-device iterator (a generator op inside
    # TensorFlow's MultiDeviceIterator) cannot be graph-optimised; nothing
    # of the user's pipeline is affected.
    r"W\d{4} [\d:.]+ +\d+ dataset\.cc:\d+\] Input of "
    r"GeneratorDatasetOp::Dataset will not be optimized",
    # ParameterServerStrategy's coordinator, after each evaluation: a
    # cleanup TensorFlow has not implemented for remote devices (a cached
    # function handle stays until the process ends).
    r"E\d{4} [\d:.]+ +\d+ function_handle_cache\.cc:\d+\] Failed to clear "
    r"function handle cache: UNIMPLEMENTED: Releasing a multi-device "
    r"component handle on a remote device is not yet implemented\.$",
))
# Set in the environment once stderr is filtered: "<device>:<inode>" of the
# pipe, so a child process that inherits the filtered stderr does not stack
# a second filter (one whose stderr goes elsewhere still gets its own).
FILTER_ENV = "TFMULTI_STDERR_FILTER"
_ABSL_NOTE = b"WARNING: All log messages before absl::InitializeLog()"
_VERBOSITY = re.compile(r"--?(verbosity|v)(=|$)")
# How long the end of a process waits for the filter to write what is left.
_DRAIN_SECONDS = 5.0


def is_noise(line: str | bytes) -> bool:
    """Whether `line` (without its newline) is one of the `NOISE` lines."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.rstrip("\r\n")
    return any(p.match(line) for p in NOISE)


def wants_tensorflow_logs(argv: Iterable[str],
                          environ: Mapping[str, str] | None = None) -> bool:
    """Whether the command line or environment asks for TensorFlow's logs:
    absl's `--verbosity`/`-v` (also inside a `--flagfile`), or
    `TF_CPP_MIN_LOG_LEVEL=0`."""
    environ = os.environ if environ is None else environ
    if environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() == "0":
        return True
    args = list(argv)
    if any(a.startswith("--flagfile") for a in args):
        from absl import flags
        try:
            args = flags.FlagValues().read_flags_from_files(args)
        except flags.Error:
            pass   # the recipe's own parsing reports the bad flagfile
    return any(_VERBOSITY.match(a) for a in args)


def _is_filtered(environ: Mapping[str, str]) -> bool:
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return environ.get(FILTER_ENV) == f"{st.st_dev}:{st.st_ino}"


def quiet(argv: Iterable[str] | None = None) -> bool:
    """Keeps TensorFlow's start-up lines off this process's output.

    Call it first thing in an entry point (a recipe, a launcher worker's
    program), before anything imports TensorFlow; not from a library or a
    test process, since it takes over the process's stderr.

    Args:
      argv: the command line (default `sys.argv[1:]`); `--verbosity` or
        `-v` there leaves every line on.

    Returns:
      Whether the filter is on (False with `--verbosity`, with
      `TF_CPP_MIN_LOG_LEVEL=0`, or when stderr is filtered already).
    """
    argv = sys.argv[1:] if argv is None else argv
    if wants_tensorflow_logs(argv):
        return False
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if _is_filtered(os.environ):
        return True
    sys.stderr.flush()
    try:
        stderr = os.dup(2)
    except OSError:
        return False   # no stderr to filter (closed by a daemoniser)
    read, write = os.pipe()
    filter_proc = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__)],
        stdin=read, stdout=stderr, stderr=stderr, close_fds=True)
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    st = os.fstat(2)
    os.environ[FILTER_ENV] = f"{st.st_dev}:{st.st_ino}"
    atexit.register(_restore, stderr, filter_proc)
    return True


def _restore(stderr: int, filter_proc: subprocess.Popen) -> None:
    """At exit: the filter writes what it holds before the shell's prompt;
    lines written while Python shuts down go to stderr unfiltered."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(stderr, 2)
    os.close(stderr)
    try:
        filter_proc.wait(timeout=_DRAIN_SECONDS)
    except subprocess.TimeoutExpired:
        pass   # a child still holds the pipe; the filter ends with it


def _write_all(fd: int, data: bytes) -> bool:
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:
            return False
    return True


def _could_be_noise(partial: bytes) -> bool:
    """Whether a line still without its newline may become a NOISE line
    (held back until it ends; anything else is forwarded at once)."""
    return (re.match(rb"[IWEF](\d{0,3}$|\d{4} )", partial) is not None
            or _ABSL_NOTE.startswith(partial) or partial.startswith(
                _ABSL_NOTE))


def _filter(source: int = 0, dest: int = 1) -> None:
    """Copies `source` to `dest` line by line, without the NOISE lines,
    until every writer has closed `source`."""
    pending = b""
    writable = True
    while True:
        try:
            chunk = os.read(source, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        out = b"".join(line + b"\n" for line in lines if not is_noise(line))
        if pending and not _could_be_noise(pending):
            out, pending = out + pending, b""
        if out and writable:
            # Keep reading after the reader has gone, so the writers never
            # block on a full pipe.
            writable = _write_all(dest, out)
    if pending and writable and not is_noise(pending):
        _write_all(dest, pending)


if __name__ == "__main__":
    # Ends when the last writer closes the pipe, not on a terminal's Ctrl-C
    # or the launcher's SIGTERM to the group: the process it serves may
    # still print its traceback or where it saved.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _filter()
