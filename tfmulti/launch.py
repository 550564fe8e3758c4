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
import dataclasses
import os
import shutil
import signal
import socket
import sys
import time

from tfmulti import exit_codes
from tfmulti import launch_processes as processes
from tfmulti import rundir

# How long a worker gets to exit after SIGTERM before it is killed; long
# enough for a preemption checkpoint of a small model.
_GRACE_SECONDS = 30.0


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
    reaper = processes.Reaper(options.grace_seconds)
    service = None
    try:
        if options.data_workers:
            service = processes.DataService(options, reaper, _say)
            os.environ[processes.DataService.SERVICE_ENV] = service.address
        for attempt in range(options.max_restarts + 1):
            group = processes.WorkerGroup(command, options, attempt, reaper)
            grace = min(options.grace_seconds,
                        processes.FAILURE_GRACE_SECONDS)
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
                        _say(f"{failure[0]} "
                             f"{processes.describe(failure[1])} during "
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
                    if service is not None:
                        service.supervise()
                    time.sleep(processes.POLL_SECONDS)
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
                _say(f"{index} {processes.describe(code)}; restarting all "
                     f"{options.workers} workers ({left} restart(s) left)")
            else:
                _say(f"{index} {processes.describe(code)}; giving up after "
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
