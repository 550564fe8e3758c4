"""tfmulti-launch under faults: its own death, SIGINT, --timeout, bad input.

Real processes and real signals; the workers are a TensorFlow-free stand-in
(tests/workers/robustness_launch_child.py), each with a grandchild process.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tfmulti import launch

CHILD = [sys.executable, "tests/workers/robustness_launch_child.py"]
WORKERS = 2


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(tmp_path, prefix):
    return [int((tmp_path / f"{prefix}-{i}").read_text())
            for i in range(WORKERS) if (tmp_path / f"{prefix}-{i}").exists()]


def _start(mode, tmp_path, *args):
    cmd = [sys.executable, "-m", "tfmulti.launch", "--workers", str(WORKERS),
           *args, "--", *CHILD, mode, str(tmp_path)]
    # Its own session, so that signalling it reaches nothing else here.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path, "pid")) < WORKERS:
        assert time.monotonic() < deadline, "workers did not start"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    return proc


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _cleanup(tmp_path, proc):
    if proc.poll() is None:
        proc.kill()
    for pid in _pids(tmp_path, "pid") + _pids(tmp_path, "grandchild"):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_of_the_launcher_stops_its_workers(tmp_path):
    proc = _start("save", tmp_path)
    try:
        proc.kill()  # SIGKILL: the launcher runs no handler
        proc.wait()
        workers = _pids(tmp_path, "pid") + _pids(tmp_path, "grandchild")
        assert not _wait_gone(workers, 20), "orphaned workers kept running"
        # They got SIGTERM first, the signal they save on.
        assert sorted(os.listdir(tmp_path)).count("saved-0") == 1
        assert (tmp_path / "saved-1").exists()
        assert "the launcher died; stopping 2 worker(s)" in proc.stderr.read()
    finally:
        _cleanup(tmp_path, proc)


@pytest.mark.slow
def test_sigint_gives_workers_the_grace_to_save_and_a_second_kills(tmp_path):
    # Worker 0 saves on SIGTERM; worker 1 ignores it.
    proc = _start("stubborn", tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        worker0, worker1 = _pids(tmp_path, "pid")
        assert not _wait_gone([worker0], 20)
        assert (tmp_path / "saved-0").exists()
        assert _alive(worker1)  # still inside its 30 s grace
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        # Well inside the grace: the second SIGINT cut it short.
        assert time.monotonic() - began < 15
        assert proc.returncode == 128 + signal.SIGINT
        assert "got SIGINT: sending SIGTERM to every worker, 30 s" in err
        assert not _wait_gone(_pids(tmp_path, "pid") +
                              _pids(tmp_path, "grandchild"), 5)
    finally:
        _cleanup(tmp_path, proc)


@pytest.mark.slow
def test_timeout_names_the_worker_still_running(tmp_path):
    cmd = [sys.executable, "-m", "tfmulti.launch", "--workers", "2",
           "--timeout", "4", "--", *CHILD, "one_hangs", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert result.returncode == 124
    assert ("timed out after 4 s (--timeout): worker(s) [1] still running, "
            "worker(s) [0] had finished") in result.stderr
    assert not _wait_gone(_pids(tmp_path, "pid") +
                          _pids(tmp_path, "grandchild"), 5)


@pytest.mark.parametrize("args, command, code, message", [
    (["--host", "no-such-host.invalid"], ["true"], 2,
     "`--host` 'no-such-host.invalid' does not resolve"),
    (["--host", "192.0.2.1"], ["true"], 2,
     "`--host` '192.0.2.1' is not an address of this machine"),
    ([], ["no-such-program-xyz", "train.py"], 127,
     "the command 'no-such-program-xyz' was not found on PATH"),
    ([], ["./no/such/file.py"], 127,
     "the command './no/such/file.py' is not an executable file"),
])
def test_bad_host_or_command_is_one_line(args, command, code, message,
                                         capsys):
    assert launch.main(["--workers", "2", *args, "--", *command]) == code
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
