"""The processes one `tfmulti-launch` starts, and how each is stopped.

A `WorkerGroup` is one attempt: the workers (and, with parameter servers,
the chief and the servers), each in its own session so that it and what it
starts can be signalled as a whole, each line of its output relayed with
its prefix. `DataService` is a tf.data service kept for the whole launch.
`Reaper` is the orphan guard that stops them all if the launcher dies
without doing so. No TensorFlow here (see `tfmulti.launch`).
"""

from __future__ import annotations

import collections
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
from tfmulti import startup

# After a worker died its peers cannot save (saving is collective), so they
# are only given time to exit cleanly.
FAILURE_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.1
# The launcher's workers start together on one machine: a peer that has not
# joined within this long is not coming (`create_strategy`'s own default,
# 600 s, is for clusters whose hosts start minutes apart).
STARTUP_TIMEOUT_SECONDS = 120
# Lines of each worker's output kept to quote its error when it fails.
_TAIL_LINES = 50
# The last line of a Python traceback: "ValueError: ...", "tfmulti.X: ...".
_ERROR_LINE = re.compile(rb"^[A-Za-z_][\w.]*(Error|Exception|Exit|"
                         rb"Interrupt)\b")
_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "reaper.py")


class WorkerGroup:
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
                       PYTHONUNBUFFERED="1",
                       **{exit_codes.ATTEMPT_ENV: str(attempt)},
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
            thread = threading.Thread(
                target=relay, args=(proc, index, quiet, self.tails[-1],
                                    lambda i=len(self.procs) - 1:
                                    self.joined.add(i)), daemon=True)
            thread.start()
            self._relays.append(thread)

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
            time.sleep(POLL_SECONDS)
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            self._reaper.forget(proc.pid)
        for relay in self._relays:
            relay.join(timeout=5)


class Reaper:
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


class DataService:
    """A tf.data service dispatcher and data workers (`python -m
    tfmulti.data.service_server`), one process each, for the whole launch: a
    restarted training group finds them, and their jobs, where they were.

    Each server has its own port, and `supervise` starts one that exited
    again on it: TensorFlow's readers wait for a lost data worker to come
    back at its address (they do not drop it, however long it is gone), and
    the dispatcher resumes from its journal. Under DYNAMIC sharding the
    elements the dead worker had in flight are lost (at most once), which
    the readers report (`tfmulti.data.service.losses`).
    """

    SERVICE_ENV = "TFMULTI_DATA_SERVICE"  # tfmulti.data.service.ENV_VAR
    # A server that keeps dying is started again at most this often.
    RESTART_INTERVAL_SECONDS = 5.0

    def __init__(self, options, reaper, say):
        self._reaper = reaper
        self._say = say
        self.work_dir = tempfile.mkdtemp(prefix="tfmulti-data-service-")
        self._ports = {name: _free_port(options.host) for name in (
            "dispatcher", *(f"d{i}" for i in range(options.data_workers)))}
        self.address = f"{options.host}:{self._ports['dispatcher']}"
        module = [sys.executable, "-u", "-m", "tfmulti.data.service_server"]
        self._argv = {name: module + (
            ["dispatcher", f"--work_dir={self.work_dir}"]
            if name == "dispatcher" else
            ["worker", f"--dispatcher={self.address}"]) + [f"--port={port}"]
            for name, port in self._ports.items()}
        self.procs = {}
        self._started = {}
        self.restarts = 0
        for name in self._argv:
            self._start(name)
        say(f"tf.data service: dispatcher at {self.address} (journal "
            f"{self.work_dir}), {options.data_workers} data worker(s); "
            f"{self.SERVICE_ENV}={self.address}")

    def _start(self, name):
        proc = subprocess.Popen(
            self._argv[name], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL=(
                os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._reaper.watch(proc.pid)
        self.procs[name] = proc
        self._started[name] = time.monotonic()
        threading.Thread(target=relay, args=(
            proc, name, True, collections.deque(maxlen=_TAIL_LINES),
            lambda: None), daemon=True).start()

    def supervise(self):
        """Starts every server that exited again, on its port (at most once
        per `RESTART_INTERVAL_SECONDS` each)."""
        now = time.monotonic()
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or (
                    now - self._started[name] < self.RESTART_INTERVAL_SECONDS):
                continue
            self._reaper.forget(proc.pid)
            self._say(f"tf.data service: {name} {describe(code)}; starting "
                      f"it again on port {self._ports[name]}")
            self._start(name)
            self.restarts += 1

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + FAILURE_GRACE_SECONDS
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.work_dir, ignore_errors=True)


def kill_group(proc) -> None:
    """SIGKILLs `proc`'s process group (it was started in its own session)
    unless it has exited, and reaps it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _free_port(host) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def describe(code) -> str:
    """How a process ended, from its return code, in words."""
    meaning = exit_codes.describe(code)
    if meaning:
        return meaning
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def relay(proc, index, quiet, tail, on_joined):
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
