"""tfmulti-launch: one command -> N local workers of a multi-worker job.

    tfmulti-launch --workers 2 [--max_restarts R] [--timeout S] -- python -m recipes.keras_fit ...
    tfmulti-launch --workers 2 --ps 1 -- python -m recipes.custom_loop --strategy=parameter_server

Each worker gets its own TF_CONFIG on free ports (loopback unless `--host`
says otherwise), and every line it prints is prefixed with `[wI]`. A worker
that fails takes the group down: MultiWorkerMirroredStrategy cannot continue
with a peer missing, so the whole group is restarted (the job resumes from its
checkpoints) while restarts remain. Workers wait at most 120 s for their peers
at start-up (`TFMULTI_STARTUP_TIMEOUT`, unless set); a worker that fails
before every worker has printed `tfmulti: ... joined the cluster` has its
peers killed at once (they wait in TensorFlow's join, which ignores SIGTERM)
and its last error line quoted. SIGINT or SIGTERM to the launcher sends
SIGTERM (the preemption signal) to every worker, which gets the grace period
to save; a second SIGINT/SIGTERM kills them at once. If the launcher itself
dies without cleaning up (SIGKILL, OOM kill), `tfmulti/reaper.py` stops the
workers (see there). At the end it prints a summary: each worker's exit, the
restarts and the wall time.

No TensorFlow here (nor in what it imports): help and the launcher start in
a fraction of a second, and the workers are the only TensorFlow processes.

With `--ps N` the job is a parameter-server job: the command also runs as a
`chief` (`[chief]`, the one that trains) and N parameter servers (`[psI]`);
workers and parameter servers only serve and never exit by themselves. The
job succeeds when the chief does. A dead worker does not fail the group (the
chief's coordinator moves its work to the others); a dead chief or
parameter server does, and the group is restarted.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tfmulti import cluster as cluster_lib
from tfmulti import exit_codes
from tfmulti import quiet_logging
from tfmulti import rundir
from tfmulti import startup

# How long a worker gets to exit after SIGTERM before it is killed; long
# enough for a preemption checkpoint of a small model.
_GRACE_SECONDS = 30.0
# After a worker died its peers cannot save (saving is collective), so they
# are only given time to exit cleanly.
_FAILURE_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.1
# The launcher's workers start together on one machine: a peer that has not
# joined within this long is not coming (`create_strategy`'s own default,
# 600 s, is for clusters whose hosts start minutes apart).
STARTUP_TIMEOUT_SECONDS = 120
# Lines of each worker's output kept to quote its error when it fails.
_TAIL_LINES = 50
# The last line of a Python traceback: "ValueError: ...", "tfmulti.X: ...".
_ERROR_LINE = re.compile(rb"^[A-Za-z_][\w.]*(Error|Exception|Exit|"
                         rb"Interrupt)\b")
ATTEMPT_ENV = exit_codes.ATTEMPT_ENV
_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "reaper.py")


class LaunchError(ValueError):
    """The launcher cannot start the workers (bad host, missing command).

    Attributes:
      exit_code: the launcher's exit code for it (127: no such command, as
        a shell says).
    """

    def __init__(self, message, *, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How to run the group.

    Attributes:
      workers: number of worker processes.
      max_restarts: how many times a failed group is started again.
      timeout: seconds the whole job may take (all attempts); None = no limit.
      host: the address the workers listen on.
      grace_seconds: how long a worker has to exit after SIGTERM.
      ps: parameter servers; with any, a chief is started too.
      data_workers: tf.data service data workers; with any, a dispatcher
        (fault tolerant, its journal in a temporary work directory) and
        these workers run on `host` for the whole launch, and every worker
        gets its address in `TFMULTI_DATA_SERVICE`.
    """

    workers: int
    max_restarts: int = 0
    timeout: float | None = None
    host: str = "127.0.0.1"
    grace_seconds: float = _GRACE_SECONDS
    ps: int = 0
    data_workers: int = 0

    def __post_init__(self):
        if isinstance(self.data_workers, bool) or not isinstance(
                self.data_workers, int) or self.data_workers < 0:
            raise ValueError(f"`--data_workers` should be an integer >= 0, "
                             f"got {self.data_workers!r}.")
        if isinstance(self.ps, bool) or not isinstance(
                self.ps, int) or self.ps < 0:
            raise ValueError(f"`--ps` should be an integer >= 0, got "
                             f"{self.ps!r}.")
        if isinstance(self.workers, bool) or not isinstance(
                self.workers, int) or self.workers < 1:
            raise ValueError(f"`--workers` should be a positive integer, got "
                             f"{self.workers!r}.")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"`--max_restarts` should be >= 0, got "
                             f"{self.max_restarts!r}.")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"`--timeout` should be positive seconds, got "
                             f"{self.timeout!r}.")


class _Group:
    """One attempt: N worker processes and the threads that relay output."""

    def __init__(self, command, options, attempt, reaper):
        self.procs = []
        self._reaper = reaper
        self.roles = []
        self._relays = []
        self.tails = []
        # Indices of the workers that said they joined the cluster.
        self.joined = set()
        # TensorFlow's start-up lines are dropped from the workers' output
        # (tfmulti.quiet_logging), unless the command asks for them.
        quiet = not quiet_logging.wants_tensorflow_logs(command[1:])
        logging_env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get(
            "TF_CPP_MIN_LOG_LEVEL", "1")} if quiet else {}
        for tf_config in cluster_lib.local_cluster(
                options.workers, host=options.host, num_ps=options.ps):
            task = tf_config["task"]
            index = task["index"] if task["type"] == "worker" else (
                "chief" if task["type"] == "chief" else f"ps{task['index']}")
            self.roles.append(task["type"])
            env = dict(os.environ, TF_CONFIG=json.dumps(tf_config),
                       PYTHONUNBUFFERED="1", **{ATTEMPT_ENV: str(attempt)},
                       **logging_env)
            env.setdefault(startup.STARTUP_TIMEOUT_ENV,
                           str(STARTUP_TIMEOUT_SECONDS))
            # Own session: the worker and anything it starts are one process
            # group that can be signalled and killed as a whole.
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs.append(proc)
            reaper.watch(proc.pid)
            self.tails.append(collections.deque(maxlen=_TAIL_LINES))
            relay = threading.Thread(
                target=_relay, args=(proc, index, quiet, self.tails[-1],
                                     lambda i=len(self.procs) - 1:
                                     self.joined.add(i)), daemon=True)
            relay.start()
            self._relays.append(relay)

    def first_failure(self):
        """(name, returncode) of a task that failed, e.g. ("worker 1",
        -9), else None.

        In a parameter-server job only the chief and the parameter servers
        count: the coordinator carries on without a dead worker.
        """
        for i, proc in enumerate(self.procs):
            if self.roles[i] == "worker" and "chief" in self.roles:
                continue
            code = proc.poll()
            if code is not None and code != 0:
                index = i - self.roles.index(self.roles[i])
                return f"{self.roles[i]} {index}", code
        return None

    def in_startup(self):
        """True while some worker of a multi-worker job has not joined.

        Its peers then wait inside TensorFlow's join, where SIGTERM is
        ignored and there is nothing to save, so they are killed at once.
        """
        return "chief" not in self.roles and len(self.joined) < len(
            self.procs)

    def error_of(self, name):
        """The last error line `name` ("worker 1") printed, or None."""
        role, _, index = name.partition(" ")
        i = [j for j, r in enumerate(self.roles) if r == role][
            int(index) if index.isdigit() else 0]
        self._relays[i].join(timeout=5)  # its last lines, up to EOF
        lines = list(self.tails[i])
        errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
        if not (errors or lines):
            return None
        return (errors or lines)[-1].decode(errors="replace").strip()

    def all_succeeded(self):
        if "chief" in self.roles:
            # Workers and parameter servers serve until they are stopped.
            return self.procs[self.roles.index("chief")].poll() == 0
        return all(p.poll() == 0 for p in self.procs)

    def signal(self, signum):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def running(self):
        """Indices of the workers that have not exited."""
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def stop(self, grace_seconds, hurry=lambda: False):
        """SIGTERM every worker, then SIGKILL what is left after the grace
        (or as soon as `hurry()` is true)."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and self.running() and not hurry():
            time.sleep(_POLL_SECONDS)
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            self._reaper.forget(proc.pid)
        for relay in self._relays:
            relay.join(timeout=5)


class _Reaper:
    """The orphan guard (`tfmulti/reaper.py`): kills the workers if the
    launcher dies without stopping them."""

    def __init__(self, grace_seconds):
        # Own session: a signal to the launcher's process group (a terminal's
        # Ctrl-C, a test harness's killpg) must not take the guard down too.
        self._proc = subprocess.Popen(
            [sys.executable, _REAPER, str(grace_seconds)],
            stdin=subprocess.PIPE, text=True, start_new_session=True)

    def _send(self, line):
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def watch(self, pgid):
        self._send(f"+{pgid}")

    def forget(self, pgid):
        self._send(f"-{pgid}")

    def close(self):
        self._send("done")
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        self._proc.wait()


class _DataService:
    """A tf.data service dispatcher and data workers (`python -m
    tfmulti.data.service`), one process each, for the whole launch: a
    restarted training group finds them, and their jobs, where they were."""

    _SERVICE_ENV = "TFMULTI_DATA_SERVICE"  # tfmulti.data.service.ENV_VAR

    def __init__(self, options, reaper):
        self.work_dir = tempfile.mkdtemp(prefix="tfmulti-data-service-")
        with socket.socket() as probe:
            probe.bind((options.host, 0))
            port = probe.getsockname()[1]
        self.address = f"{options.host}:{port}"
        module = [sys.executable, "-u", "-m", "tfmulti.data.service"]
        commands = [(module + ["dispatcher", f"--port={port}",
                               f"--work_dir={self.work_dir}"], "dispatcher")]
        commands += [(module + ["worker", f"--dispatcher={self.address}"],
                      f"d{i}") for i in range(options.data_workers)]
        self.procs = []
        for argv, name in commands:
            proc = subprocess.Popen(
                argv, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get(
                    "TF_CPP_MIN_LOG_LEVEL", "2")),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
            reaper.watch(proc.pid)
            self.procs.append(proc)
            threading.Thread(target=_relay, args=(
                proc, name, True, collections.deque(maxlen=_TAIL_LINES),
                lambda: None), daemon=True).start()
        _say(f"tf.data service: dispatcher at {self.address} (journal "
             f"{self.work_dir}), {options.data_workers} data worker(s); "
             f"{self._SERVICE_ENV}={self.address}")

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + _FAILURE_GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.work_dir, ignore_errors=True)


def _relay(proc, index, quiet, tail, on_joined):
    prefix = (f"[w{index}] " if isinstance(index, int) else
              f"[{index}] ").encode()
    marker = startup.JOINED_MARKER.encode()
    for line in iter(proc.stdout.readline, b""):
        if quiet and quiet_logging.is_noise(line):
            continue
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()
        tail.append(line)
        if marker in line and line.startswith(b"tfmulti: "):
            on_joined()
    proc.stdout.close()


def _describe(code):
    meaning = exit_codes.describe(code)
    if meaning:
        return meaning
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _check_command(command):
    program = command[0]
    if shutil.which(program) is None:
        where = ("is not an executable file" if os.sep in program
                 else "was not found on PATH")
        raise LaunchError(
            f"the command {program!r} {where}. Check its spelling, or give "
            f"its full path, e.g. -- {sys.executable} train.py",
            exit_code=127)


def _check_host(host):
    # The workers' servers would fail (or hang resolving) much later.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except socket.gaierror as e:
        raise LaunchError(
            f"`--host` {host!r} does not resolve ({e.strerror}). Give a name "
            "or address of this machine, e.g. --host 127.0.0.1") from None
    except OSError as e:
        raise LaunchError(
            f"`--host` {host!r} is not an address of this machine "
            f"({e.strerror}). The launcher starts every worker here; give "
            "one of this machine's addresses, e.g. --host 127.0.0.1"
        ) from None


def launch(command: list[str], options: LaunchOptions, *,
           summary: dict | None = None) -> int:
    """Runs `command` as a group of workers until it succeeds or gives up.

    Args:
      command: the program and its arguments, run once per worker.
      options: a `LaunchOptions`.
      summary: if given, filled with `attempts` (groups started) and
        `codes` (the last group's exit codes, in worker order).

    Returns:
      The exit code for the launcher: 0 when every worker of one attempt
      exited 0; non-zero otherwise, after printing a one-line reason.

    Raises:
      LaunchError: no command, a command that does not exist, or a `host`
        that is not an address of this machine.
    """
    if not command:
        raise LaunchError("No command given: put it after `--`, e.g. "
                          "tfmulti-launch --workers 2 -- python train.py")
    _check_command(command)
    _check_host(options.host)
    deadline = None if options.timeout is None else (
        time.monotonic() + options.timeout)
    received = []

    def forward(signum, frame):
        del frame
        received.append(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM)}
    reaper = _Reaper(options.grace_seconds)
    service = None
    try:
        if options.data_workers:
            service = _DataService(options, reaper)
            os.environ[_DataService._SERVICE_ENV] = service.address
        for attempt in range(options.max_restarts + 1):
            group = _Group(command, options, attempt, reaper)
            grace = min(options.grace_seconds, _FAILURE_GRACE_SECONDS)
            try:
                while True:
                    if received:
                        # SIGTERM whatever the launcher got: it is the signal
                        # workers save on (SIGINT would raise
                        # KeyboardInterrupt in them, and nothing is saved).
                        # A second signal cuts the grace short.
                        name = signal.Signals(received[0]).name
                        _say(f"got {name}: sending SIGTERM to every worker, "
                             f"{options.grace_seconds:g} s to save and exit "
                             f"(send {name} again to kill them now)")
                        group.stop(options.grace_seconds,
                                   hurry=lambda: len(received) > 1)
                        _say(f"stopped by {name}")
                        return 128 + received[0]
                    failure = group.first_failure()
                    if failure and group.in_startup():
                        grace = 0.0
                        _say(f"{failure[0]} {_describe(failure[1])} during "
                             "start-up, before the cluster formed: "
                             f"{group.error_of(failure[0]) or 'no output'}; "
                             f"stopping the other {len(group.running())} "
                             "process(es) at once (SIGKILL: they wait for it "
                             "inside TensorFlow, with nothing to save)")
                    if failure or group.all_succeeded():
                        break
                    if deadline is not None and time.monotonic() > deadline:
                        running = group.running()
                        done = [i for i in range(options.workers)
                                if i not in running]
                        group.stop(options.grace_seconds)
                        _say(f"timed out after {options.timeout:g} s "
                             f"(--timeout): worker(s) {running} still "
                             f"running" + (f", worker(s) {done} had "
                                           f"finished" if done else "") +
                             "; stopped all workers")
                        return 124
                    time.sleep(_POLL_SECONDS)
            finally:
                group.stop(grace)
                if summary is not None:
                    summary.update(attempts=attempt + 1, codes=[
                        p.returncode for p in group.procs])
            if failure is None:
                return 0
            index, code = failure
            left = options.max_restarts - attempt
            if left:
                _say(f"{index} {_describe(code)}; restarting all "
                     f"{options.workers} workers ({left} restart(s) left)")
            else:
                _say(f"{index} {_describe(code)}; giving up after "
                     f"{options.max_restarts} restart(s)")
                return code if code > 0 else 128 - code
        raise AssertionError("unreachable")
    finally:
        if service is not None:
            service.stop()
        reaper.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _say(message):
    print(f"tfmulti-launch: {message}", file=sys.stderr, flush=True)


def _exit_name(code):
    if code is None:
        return "not started"
    if code < 0:
        return signal.Signals(-code).name
    return f"{code} (preempted)" if code == exit_codes.PREEMPTED else str(code)


def _summary_line(summary, seconds):
    codes = summary.get("codes", [])
    attempts = summary.get("attempts", 0)
    workers = ", ".join(f"w{i} {_exit_name(c)}" for i, c in enumerate(codes))
    return (f"{len(codes)} worker(s) exited: {workers or 'none'}; "
            f"{max(0, attempts - 1)} restart(s); wall time "
            f"{time.strftime('%H:%M:%S', time.gmtime(seconds))}")


def _parser():
    parser = argparse.ArgumentParser(
        prog="tfmulti-launch",
        description="Run COMMAND as N local workers of one multi-worker job "
        "(MultiWorkerMirroredStrategy). Each worker gets its own TF_CONFIG "
        "on free ports, and each line it prints is prefixed with [wI]. If a "
        "worker fails, all are stopped and, while restarts remain, the "
        "whole group starts again (the job resumes from its checkpoints).",
        usage="tfmulti-launch --workers N [--ps P] [--max_restarts R] "
              "[--timeout S] [--host H] -- COMMAND ...",
        epilog="Workers see TF_CONFIG, TFMULTI_LAUNCH_ATTEMPT (0 for the "
        "first group, then 1, 2, ... after restarts), TFMULTI_RUN_ID "
        "(the same for all workers and restarts; the recipes name their "
        "default run directory with it) and TFMULTI_STARTUP_TIMEOUT=120 "
        "(unless set: how long a worker waits for its peers to join). A "
        "worker that fails before every worker joined stops the others at "
        "once, and its error is quoted. SIGINT/SIGTERM send SIGTERM to "
        "every worker, which gets 30 s to save and exit (a second one kills "
        "them now); workers die with the launcher, however it dies. Exit status: 0 "
        "when every worker of one group exited 0; 124 on --timeout; "
        "128+N when stopped by signal N; else the failing worker's code. "
        "Example: tfmulti-launch --workers 2 -- python -m recipes.keras_fit")
    parser.add_argument("--workers", type=int, required=True,
                        help="number of worker processes (required)")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="times the whole group is started again after "
                        "a worker fails (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may take, all attempts "
                        "included; then every worker is stopped (exit 124); "
                        "default: no limit")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the workers listen on (default: "
                        "%(default)s)")
    parser.add_argument("--ps", type=int, default=0,
                        help="parameter servers: run a ParameterServer"
                        "Strategy job (a chief, N workers, P ps; default: "
                        "%(default)s)")
    parser.add_argument("--data_workers", type=int, default=0,
                        help="tf.data service data workers: also start a "
                        "dispatcher (journal in a temporary directory) and "
                        "N data workers, pass TFMULTI_DATA_SERVICE to the "
                        "workers, stop them at the end (default: "
                        "%(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tfmulti-launch` and `python -m tfmulti.launch`."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    else:
        command = []
    parser = _parser()
    args = parser.parse_args(argv)
    if not command:
        parser.error("no COMMAND: put it after `--`")
    try:
        options = LaunchOptions(workers=args.workers,
                                max_restarts=args.max_restarts,
                                timeout=args.timeout, host=args.host,
                                ps=args.ps, data_workers=args.data_workers)
    except ValueError as e:
        parser.error(str(e))
    # One id for every worker and restart: a recipe's default run directory
    # is then the same on all workers, and a restarted group resumes it.
    os.environ.setdefault(rundir.RUN_ID_ENV, rundir.timestamp())
    began, summary = time.monotonic(), {}
    try:
        return launch(command, options, summary=summary)
    except LaunchError as e:
        _say(str(e))
        return e.exit_code
    finally:
        if summary:  # a group was started
            _say(_summary_line(summary, time.monotonic() - began))


if __name__ == "__main__":
    sys.exit(main())
