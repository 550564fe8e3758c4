"""tfmulti-launch: output prefixes, failure handling, restarts, no leftovers."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tfmulti import launch

CHILD = [sys.executable, "tests/workers/launch_child.py"]


def _run(args, mode, tmp_path, timeout=60):
    cmd = [sys.executable, "-m", "tfmulti.launch", *args, "--", *CHILD,
           mode, str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout)


def _pids(tmp_path):
    return [int((tmp_path / name).read_text())
            for name in os.listdir(tmp_path) if name.startswith("pid-")]


def _assert_none_running(pids):
    alive = [p for p in pids if psutil.pid_exists(p) and
             psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"worker processes left running: {alive}"


def test_each_worker_gets_its_own_prefixed_output(tmp_path):
    result = _run(["--workers", "3"], "ok", tmp_path)
    assert result.returncode == 0, result.stderr
    for i in range(3):
        assert f"[w{i}] hello from worker {i} attempt 0" in result.stdout
    assert len(_pids(tmp_path)) == 3


def test_a_failing_worker_stops_the_group(tmp_path):
    start = time.monotonic()
    result = _run(["--workers", "2"], "fail1", tmp_path)
    # Worker 0 would sleep 600 s: it was stopped, not waited for.
    assert time.monotonic() - start < 40
    assert result.returncode == 3
    assert "worker 1 exited with code 3; giving up" in result.stderr
    # The end summary: each worker's exit (w0 stopped by the launcher).
    assert re.search(r"2 worker\(s\) exited: w0 SIG\w+, w1 3; 0 restart\(s\);"
                     r" wall time \d\d:\d\d:\d\d", result.stderr), result.stderr
    _assert_none_running(_pids(tmp_path))


def test_restart_after_a_failure_finishes_the_job(tmp_path):
    result = _run(["--workers", "2", "--max_restarts", "1"], "flaky",
                  tmp_path)
    assert result.returncode == 0, result.stderr
    assert "restarting all 2 workers (1 restart(s) left)" in result.stderr
    assert "[w1] hello from worker 1 attempt 1" in result.stdout
    assert "exited: w0 0, w1 0; 1 restart(s)" in result.stderr
    assert len(_pids(tmp_path)) == 4
    _assert_none_running(_pids(tmp_path))


def test_timeout_stops_everything(tmp_path):
    result = _run(["--workers", "2", "--timeout", "2"], "hang", tmp_path)
    assert result.returncode == 124
    assert "timed out after 2 s" in result.stderr
    _assert_none_running(_pids(tmp_path))


def test_sigterm_is_forwarded_and_nothing_is_left(tmp_path):
    cmd = [sys.executable, "-m", "tfmulti.launch", "--workers", "2", "--",
           *CHILD, "hang", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err
    _assert_none_running(_pids(tmp_path))


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "`--workers` should be a positive integer, got 0"),
    (["--workers", "2", "--max_restarts", "-1"], "`--max_restarts`"),
    (["--workers", "2", "--timeout", "0"], "`--timeout`"),
])
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main([*args, "--", "true"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_command(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--workers", "2"])
    assert "no COMMAND" in capsys.readouterr().err


def test_help_has_descriptions_and_defaults_without_tensorflow():
    code = ("import sys; from tfmulti import launch\n"
            "try:\n    launch.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.strip().endswith("False"), result.stdout
    for text in ("number of worker processes", "(default: 0)",
                 "(default: 127.0.0.1)", "TFMULTI_LAUNCH_ATTEMPT",
                 "Exit status"):
        assert text in result.stdout, result.stdout
