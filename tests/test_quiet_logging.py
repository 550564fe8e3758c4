"""tfmulti.quiet_logging: TensorFlow's start-up lines off, real ones kept.

The filter is checked on the lines TensorFlow 2.21 really writes (copied
from a run on this CPU-only machine), then in real processes: TensorFlow's
own warning and a fatal error that aborts the process still reach the user
through it, and `--verbosity` turns it off.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.subproc import run_python
from tfmulti import quiet_logging

# Written by TensorFlow 2.21.0 on import and at the first distributed
# iterator, on a machine without a GPU (BUILD_NOTES, "Quiet start").
NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "I0000 00:00:1796404059.488359   22213 port.cc:153] oneDNN custom "
    "operations are on. You may see slightly different numerical results.",
    "I0000 00:00:1796404059.509377   22213 cudart_stub.cc:31] Could not find "
    "cuda drivers on your machine, GPU will not be used.",
    "E0000 00:00:1796404071.124330   22213 cuda_platform.cc:52] failed call "
    "to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR "
    "(303)",
    "W0000 00:00:1796404098.759143   22213 dataset.cc:997] Input of "
    "GeneratorDatasetOp::Dataset will not be optimized because the dataset "
    "does not implement the AsGraphDefInternal() method needed to apply "
    "optimizations.",
    "E0000 00:00:1796407199.601101   30572 function_handle_cache.cc:31] "
    "Failed to clear function handle cache: UNIMPLEMENTED: Releasing a "
    "multi-device component handle on a remote device is not yet "
    "implemented.",
]
KEPT = [
    # A real warning and a real error: a user's cache().take().repeat(),
    # a GPU machine whose driver fails.
    "W0000 00:00:1796404115.511066   22213 cache_dataset_ops.cc:912] The "
    "calling iterator did not fully read the dataset being cached.",
    "E0000 00:00:1796404071.124330   22213 cuda_platform.cc:52] failed call "
    "to cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected "
    "(100)",
    "F0000 00:00:1796404071.124330   22213 abort_op.cc:41] Abort_op "
    "intentional failure; boom",
    "Traceback (most recent call last):",
    "I0 is not a log line",
]


@pytest.mark.parametrize("line", NOISE)
def test_noise_is_dropped(line):
    assert quiet_logging.is_noise(line)
    assert quiet_logging.is_noise(line.encode() + b"\n")


@pytest.mark.parametrize("line", KEPT)
def test_real_lines_are_kept(line):
    assert not quiet_logging.is_noise(line)


def test_the_filter_process_forwards_all_but_the_noise():
    text = "\n".join([NOISE[0], KEPT[0], NOISE[1], KEPT[3], NOISE[4],
                      KEPT[1]]) + "\nno newline at the end"
    done = subprocess.run(
        [sys.executable, "-I", "-S", quiet_logging.__file__],
        input=text.encode(), capture_output=True, timeout=60)
    assert done.stdout.decode() == "\n".join(
        [KEPT[0], KEPT[3], KEPT[1]]) + "\nno newline at the end"


@pytest.mark.parametrize("argv, environ, wanted", [
    (["--steps=3"], {}, False),
    (["--verbosity=0"], {}, True),
    (["-v", "1"], {}, True),
    (["--v=1"], {}, True),
    (["--vmodule=x"], {}, False),
    ([], {"TF_CPP_MIN_LOG_LEVEL": "0"}, True),
    ([], {"TF_CPP_MIN_LOG_LEVEL": "2"}, False),
])
def test_verbosity_turns_the_filter_off(argv, environ, wanted):
    assert quiet_logging.wants_tensorflow_logs(argv, environ) == wanted


def test_verbosity_in_a_flagfile(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--steps=3\n--verbosity=0\n")
    assert quiet_logging.wants_tensorflow_logs([f"--flagfile={flagfile}"],
                                               {})


# Imports TensorFlow behind the filter and starts its devices (cuInit), then
# writes a real TensorFlow warning (a user's cache().take(k).repeat(), the
# case TensorFlow warns about) and fails with a real TensorFlow error (an op's
# InvalidArgumentError), or aborts (SIGABRT) right after writing: the filter,
# a process of its own, still forwards a dying process's last lines.
_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    from tfmulti import quiet_logging
    print("filtered:", quiet_logging.quiet(sys.argv[1:]), flush=True)
    import tensorflow as tf
    tf.config.list_logical_devices()
    iterator = iter(tf.data.Dataset.range(10).cache().take(2).repeat(2))
    print("read", [int(x) for x in iterator], flush=True)
    del iterator
    if "--abort" in sys.argv:
        sys.stderr.write("last words before SIGABRT\\n")
        sys.stderr.flush()
        os.abort()
    if "--error" in sys.argv:
        tf.reshape(tf.range(6), [4])
""")


def test_real_tensorflow_warnings_and_errors_reach_the_user(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    code, out = run_python([str(script), "--error"], timeout=180,
                           check=False)
    assert code == 1, out
    assert "filtered: True" in out, out
    assert "did not fully read the dataset being cached" in out, out
    assert "InvalidArgumentError" in out and (
        "Input to reshape is a tensor with 6 values" in out), out
    # TensorFlow's own C++ lines that come with the error stay too
    # (local_rendezvous.cc names it); the start-up ones are gone.
    assert "W0000" in out and "cuInit" not in out, out
    for line in out.splitlines():
        assert not line.startswith(("I0000", "WARNING: All log messages")), (
            out)

    code, out = run_python([str(script), "--abort"], timeout=180,
                           check=False)
    assert code == -6, out   # SIGABRT
    assert "last words before SIGABRT" in out, out
    # faulthandler's stack (tests/subproc.py turns it on), written by the
    # dying process after the signal.
    assert "Fatal Python error: Aborted" in out, out

    # --verbosity: every line, TensorFlow's start-up ones included.
    code, out = run_python([str(script), "--verbosity=0"], timeout=180)
    assert "filtered: False" in out, out
    assert "WARNING: All log messages before absl::InitializeLog()" in out
    assert "failed call to cuInit" in out, out


def test_the_launcher_drops_the_noise_from_any_worker_command():
    """A worker that is not a recipe (no filter of its own) writes the
    start-up lines and a real one; tfmulti-launch relays only the real one,
    and gives the worker TF_CPP_MIN_LOG_LEVEL=1 unless it is set."""
    worker = ("import os, sys; sys.stderr.write(sys.argv[1]); "
              "print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))")
    lines = "".join(line + "\n" for line in [*NOISE, KEPT[0]])
    env = {k: v for k, v in os.environ.items()
           if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "tfmulti.launch", "--workers", "1",
         "--timeout", "60", "--", sys.executable, "-c", worker, lines],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    relayed = [line for line in done.stdout.splitlines()
               if line.startswith("[w0] ")]
    assert relayed == ["[w0] " + KEPT[0], "[w0] level 1"] or relayed == [
        "[w0] level 1", "[w0] " + KEPT[0]], done.stdout
