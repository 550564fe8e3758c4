"""Run directories: a fresh one per run, resuming only when asked.

A run writes checkpoints, TensorBoard events, `config.json` (at start) and
`metrics.json` (at the end) to its `model_dir`. Reusing a directory silently
mixes runs (a short Keras run overwrites `model-0001.keras` and leaves an
older `model-0003.keras` that looks newer) or trains nothing (a Trainer run
restores the final step of the last one), so here:

- the default is a new `./runs/<name>-<YYYYmmdd-HHMMSS>` (never a directory
  called `tfmulti`, which `import tfmulti` would find as a namespace package
  when Python runs from its parent);
- a directory that holds a run is continued only with `resume=True`, and
  only with the same training configuration (`config.json`), except where
  training ends (`steps`, `epochs`): a later end extends the run from its
  last checkpoint, and `config.json` records each end (`ends`);
- a finished run (it has `metrics.json`) asked for the same end is
  "nothing to train".

Nothing here imports TensorFlow: the decision is made before the strategy
exists, by every worker alike, from what the shared directory holds.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys
import tempfile
from typing import Any, Mapping

from tfmulti import cluster as cluster_lib

RUNS_ROOT = "runs"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
# Set by tfmulti-launch to one value for all workers and all restarts of a
# launch, so a default directory is the same on every worker.
RUN_ID_ENV = "TFMULTI_RUN_ID"
_PACKAGE = "tfmulti"


class RunDirError(ValueError):
    """`model_dir` cannot be used as asked; the message says what to do."""


class NothingToTrain(Exception):
    """`model_dir` holds a run that has reached the end asked for."""


# The settings that say where training ends, not what is trained: a resumed
# run may change them (to train longer).
END_KEYS = ("steps", "epochs")


def timestamp(now: datetime.datetime | None = None) -> str:
    """`YYYYmmdd-HHMMSS` of `now` (default: the local time)."""
    return (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")


def default_model_dir(name: str, *, root: str = RUNS_ROOT,
                      environ: Mapping[str, str] | None = None) -> str:
    """A new directory `root/<name>-<run id>` for one run.

    Args:
      name: what runs, e.g. the recipe ("keras_fit").
      root: the parent directory, relative to the working directory.
      environ: where to read `TFMULTI_RUN_ID` (the launcher's id, shared by
        its workers); default `os.environ`. Without it the id is the time.

    Returns:
      A path that does not exist yet, unless the run id came from the
      environment (then every worker of the launch gets the same path).
    """
    environ = os.environ if environ is None else environ
    shared = environ.get(RUN_ID_ENV)
    base = os.path.join(root, f"{name}-{shared or timestamp()}")
    if shared:
        return base
    path, n = base, 1
    while os.path.exists(path):
        # Two runs started in the same second.
        n += 1
        path = f"{base}-{n}"
    return path


@dataclasses.dataclass(frozen=True)
class RunDir:
    """What a run does with its directory.

    Attributes:
      path: the directory.
      resuming: it holds a run that this one continues.
      saved_config: what `config.json` holds (`config`, `versions`,
        `started`, `ends`) for the run being continued.
      finished_steps: the steps a finished run (one with `metrics.json`)
        trained, when this one continues it to another end; else None.
    """

    path: str
    resuming: bool = False
    saved_config: Mapping[str, Any] | None = None
    finished_steps: int | None = None

    def ends(self, config: Mapping[str, Any], total_steps: int,
             when: str) -> list[dict[str, Any]]:
        """What `config.json` records as `ends`: the saved list, plus this
        run's end when it moved (each `{"steps", "epochs", "total_steps",
        "set"}`, `set` the time it was asked for)."""
        saved = self.saved_config or {}
        ends = list(saved.get("ends") or [])
        if saved and not ends:
            # A config.json from before ends were recorded.
            ends = [{**{k: saved.get("config", {}).get(k) for k in END_KEYS},
                     "total_steps": None, "set": saved.get("started")}]
        end = {k: config.get(k) for k in END_KEYS}
        if not ends or {k: ends[-1].get(k) for k in END_KEYS} != end:
            ends.append({**end, "total_steps": total_steps, "set": when})
        return ends


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RunDirError(f"Cannot read {path!r} ({e}). Fix or remove it, or "
                          "choose another `--model_dir`.") from e


def _check_not_shadowing(path: str) -> None:
    absolute = os.path.abspath(path)
    parent = os.path.dirname(absolute)
    search = {os.path.abspath(p or os.curdir) for p in sys.path}
    if os.path.basename(absolute) == _PACKAGE and parent in search:
        raise RunDirError(
            f"`--model_dir` is {path!r}: a directory named {_PACKAGE!r} in "
            f"{parent!r}, which is on Python's import path, makes `import "
            f"{_PACKAGE}` find that directory instead of the package. Give "
            "it another name (the default is a new ./runs/<recipe>-<time>).")


def differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                keys: tuple[str, ...]) -> list[str]:
    """`key: saved -> current` for each of `keys` whose value changed."""
    return [f"`{k}`: saved {saved.get(k)!r}, now {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]


def open_run_dir(path: str, *, config: Mapping[str, Any], resume: bool,
                 compared: tuple[str, ...]) -> RunDir:
    """Decides whether a run may use `path`, before anything is written.

    Args:
      path: the run's `model_dir`.
      config: the run's configuration (what `config.json` will hold).
      resume: continue the run `path` holds, if any.
      compared: keys of `config` that must equal the saved ones to resume
        (what is trained; not where or on how many devices).

    Returns:
      A `RunDir`.

    Raises:
      RunDirError: `path` holds a run and `resume` is False, the saved
        configuration differs, or `path` is not a usable directory.
      NothingToTrain: `resume` is True and the run there has finished.
    """
    _check_not_shadowing(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"`--model_dir` is {path!r}, which is a file. Give "
                          "a directory.")
    entries = os.listdir(path) if os.path.isdir(path) else []
    if not entries:
        return RunDir(path)
    saved = _read_json(os.path.join(path, CONFIG_FILE))
    metrics = _read_json(os.path.join(path, METRICS_FILE))
    if saved is None:
        raise RunDirError(
            f"`--model_dir` {path!r} is not empty and holds no {CONFIG_FILE}, "
            "so it is not a run this program can continue. Choose an empty "
            "or new directory (the default is a new ./runs/<recipe>-<time>).")
    finished = metrics is not None
    if not resume:
        what = (f"a finished run ({METRICS_FILE} is there, "
                f"{metrics.get('steps', '?')} steps): nothing to train"
                if finished else "an unfinished run")
        raise RunDirError(
            f"`--model_dir` {path!r} holds {what}. Pass --resume to continue "
            "it (with a larger --steps or --epochs to train longer), or "
            "leave out --model_dir for a new directory under ./runs/.")
    saved_config = saved.get("config", {})
    changed = differences(saved_config, config,
                          tuple(k for k in compared if k not in END_KEYS))
    if changed:
        raise RunDirError(
            f"--resume: the run in {path!r} was started with another "
            f"configuration ({'; '.join(changed)}). Resume with the saved "
            "values (only --steps and --epochs may change), or start a new "
            "run without --resume.")
    same_end = not differences(saved_config, config, END_KEYS) and not (
        differences(metrics.get("config", saved_config), config, END_KEYS)
        if finished else [])
    if finished and same_end:
        raise NothingToTrain(
            f"nothing to train: the run in {path!r} has finished at step "
            f"{metrics.get('steps', '?')} (metrics in "
            f"{os.path.join(path, METRICS_FILE)}); pass a larger --steps or "
            "--epochs to train longer.")
    return RunDir(path, resuming=True, saved_config=saved,
                  finished_steps=metrics.get("steps") if finished else None)


def worker_temp_dir(model_dir, *, cluster=None, temp_root=None) -> str:
    """The temporary directory a non-chief worker writes instead of
    `model_dir`. It depends only on `model_dir` and the worker's rank, so a
    run restarted after a crash finds and removes what the killed one left.
    """
    cluster = cluster or cluster_lib.cluster_config()
    digest = hashlib.sha256(os.path.abspath(
        os.fspath(model_dir)).encode()).hexdigest()[:12]
    return os.path.join(temp_root or tempfile.gettempdir(),
                        f"tfmulti-{digest}-worker{cluster.worker_rank}")


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Writes `payload` to `path` so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                               suffix=".json")
    # mkstemp makes the file 0600; on shared storage the others who read
    # results need what the umask allows (0644 usually).
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def check_output_dir(model_dir: str) -> None:
    """Fails at start, naming the path, where the end would fail to write.

    Raises:
      ValueError: `model_dir` cannot be created or written, or its
        `metrics.json` is a directory.
    """
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"`model_dir` {model_dir!r} cannot be created ({e.strerror}: "
            f"{e.filename!r}). Pass a directory this process can create and "
            "write.") from None
    if not os.access(model_dir, os.W_OK | os.X_OK):
        raise ValueError(f"`model_dir` {model_dir!r} is not writable by this "
                         "process. Pass a directory it can write.")
    metrics = os.path.join(model_dir, "metrics.json")
    if os.path.isdir(metrics):
        raise ValueError(
            f"{metrics!r} is a directory, so the run's results could not be "
            "written there at the end. Remove it or use another "
            "`model_dir`.")
