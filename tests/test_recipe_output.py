"""What a user sees, from real recipe runs on this CPU-only machine.

- Quiet start: no TensorFlow start-up line (`I0000`, `W0000`, `E0000`,
  absl's "WARNING: All log messages ..."), tfmulti's device line instead.
- Nothing after the summary: a run stopped mid-epoch by `--steps` leaves no
  half-written cache (TensorFlow's "did not fully read the dataset being
  cached" used to be the last line).
- Extending: `--steps=3`, then `--steps=5 --resume` continues from step 3
  and records both ends; `--steps=4 --resume` is refused naming step 5.
- A whole summary when preempted and when resumed with nothing left; and
  after an error (a real NonFiniteLossError, in process).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import subproc
from tfmulti import exit_codes

START_UP = ("I0000", "W0000", "E0000", "WARNING: All log messages")
SUMMARY_ROWS = ("  train - ", "  eval  - ", "  metrics:     ",
                "  checkpoints: ", "  TensorBoard: ")


def _env():
    # As a user runs it: the test process may have set TensorFlow's level.
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFMULTI_STDERR_FILTER")}
    return dict(env, PYTHONUNBUFFERED="1")


def _run(args, timeout=300):
    proc = subproc._start([sys.executable, *args], _env())
    try:
        out, _ = subproc._wait(proc, timeout, None)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{args} ran past {timeout}s:\n"
                             f"{subproc._stacks(proc)}")
    finally:
        subproc._kill(proc)
    return proc.returncode, out


def _assert_quiet(out):
    for line in out.splitlines():
        assert not line.startswith(START_UP), out
    assert "2 CPU replicas, no GPU found" in out, out


def _summary(out):
    """The summary's rows, which must be the last lines of the output."""
    lines = out.rstrip("\n").splitlines()
    head = max(i for i, l in enumerate(lines)
               if l.startswith(("done: ", "stopped at step ")))
    rows = lines[head + 1:]
    assert len(rows) == len(SUMMARY_ROWS), out
    for row, start in zip(rows, SUMMARY_ROWS):
        assert row.startswith(start.rstrip("- ")), out
    return lines[head], rows


def _recipe(name, run, data_dir):
    """A recipe on 2 CPU replicas with small steps, as a command line."""
    return ["-m", f"recipes.{name}", "--cpu_replicas=2",
            f"--data_dir={data_dir}", f"--model_dir={run}",
            "--global_batch_size=32", "--steps_per_loop=1"]


def test_keras_fit_is_quiet_and_a_finished_run_trains_longer(
        tmp_path, shapes_data_dir):
    run = tmp_path / "run"
    flags = _recipe("keras_fit", run, shapes_data_dir)
    code, out = _run([*flags, "--steps=3"])
    assert code == 0, out
    _assert_quiet(out)
    # 3 of an epoch's 625 steps; the summary is the last thing printed.
    head, rows = _summary(out)
    assert head.startswith("done: 3 steps on 2 replica(s)"), out
    assert "did not fully read the dataset" not in out, out

    code, out = _run([*flags, "--steps=5", "--resume"])
    assert code == 0, out
    _assert_quiet(out)
    assert f"resuming {run} at step 3 (to step 5)" in out, out
    assert re.search(r"^step 5/5 \(epoch 1/1\) - accuracy", out, re.M), out
    head, rows = _summary(out)
    assert head.startswith("done: 5 steps (resumed at step 3) on 2 "
                           "replica(s)"), out
    assert json.loads((run / "metrics.json").read_text())["steps"] == 5
    ends = json.loads((run / "config.json").read_text())["ends"]
    assert [(e["steps"], e["total_steps"]) for e in ends] == [(3, 3), (5, 5)]
    assert json.loads((run / "config.json").read_text())["config"][
        "steps"] == 5

    code, out = _run([*flags, "--steps=4", "--resume"], timeout=200)
    assert code == 1, out
    assert "`--steps`=4 ends before step 5, which the run in" in out, out
    assert "Traceback" not in out, out


def _stop_when_training(proc, timeout):
    """SIGTERM (a preemption) once the first progress line is out; returns
    what was read until then."""
    seen, deadline = [], time.monotonic() + timeout
    for line in iter(proc.stdout.readline, ""):
        seen.append(line)
        if line.startswith("step "):
            proc.send_signal(signal.SIGTERM)
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError("ended before training:\n" + "".join(seen))


def test_preempted_and_nothing_left_summaries_are_whole(
        tmp_path, shapes_data_dir):
    run = tmp_path / "run"
    flags = _recipe("custom_loop", run, shapes_data_dir)
    proc = subproc._start([sys.executable, *flags, "--steps=400"], _env())
    try:
        out = _stop_when_training(proc, 240)
        rest, _ = proc.communicate(timeout=240)
        out += rest
    finally:
        subproc._kill(proc)
    assert proc.returncode == exit_codes.PREEMPTED, out
    _assert_quiet(out)
    head, rows = _summary(out)
    stopped = re.match(r"stopped at step (\d+) of 400 \(preempted: ", head)
    assert stopped, out
    reached = int(stopped.group(1))
    assert rows[0].startswith("  train - ") and " loss " in rows[0], out
    assert rows[1] == "  eval  (not run)" or " loss " in rows[1], out
    assert rows[2] == "  metrics:     not written (the run did not end)", out

    # Resumed with --steps at the step it reached: nothing left to train,
    # and the run still ends (evaluation, metrics.json) with every row.
    code, out = _run([*flags, f"--steps={reached}", "--resume"])
    assert code == 0, out
    _assert_quiet(out)
    head, rows = _summary(out)
    assert head.startswith(f"done: {reached} steps (resumed at step "
                           f"{reached}: nothing left to train)"), out
    assert rows[0] == "  train (no step trained in this run)", out
    assert rows[1].startswith("  eval  - ") and " loss " in rows[1], out
    assert json.loads((run / "metrics.json").read_text())["steps"] == reached


def test_a_run_stopped_by_an_error_ends_with_a_whole_summary(tmp_path):
    """A real Trainer run that diverges (NonFiniteLossError) with the
    recipe's progress logger: the summary says where and why it stopped."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf
    import tfmulti
    from tfmulti import progress, run_end

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(1e30)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices(
        (x * 1e10, (x[:, 0] > 0).astype("int32"))).repeat().batch(
        8, drop_remainder=True)
    logger = progress.ProgressLogger(total_steps=20, steps_per_epoch=8,
                                     examples_per_step=8, interval=0)
    trainer = tfmulti.Trainer(model, optimizer, loss=keras.losses.
                              SparseCategoricalCrossentropy(
                                  from_logits=True, reduction=None),
                              strategy=strategy, steps_per_loop=1)
    with pytest.raises(tfmulti.NonFiniteLossError) as error:
        trainer.fit(data, steps=20, callbacks=[logger], verbose=0)
    text = progress.stopped_summary(
        logger, reason=run_end.stop_reason(error.value), num_replicas=1,
        model_dir=str(tmp_path), wall_seconds=1.0,
        checkpoints=str(tmp_path))
    head, rows = _summary(text)
    assert re.match(r"stopped at step \d+ of 20 \(NonFiniteLossError: .*; "
                    r"traceback below\) on 1 replica", head), text
    assert rows[2] == "  metrics:     not written (the run did not end)"
