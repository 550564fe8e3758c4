"""Elastic resume: a Trainer job checkpointed on N replicas or workers
resumes on M at the same global batch (per-replica batch recomputed) and
ends with the weights and optimizer slots of an uninterrupted run (1e-5);
a per-example counter saved with the model proves that no example of the
interrupted epoch was trained on twice or skipped. Cases: mirrored 4 -> 2
replicas, 2 workers -> 1, 1 worker -> 2.

Interrupted runs stop at step 12 of 16 (epoch 2, batch 4 of 8)."""

import json

import numpy as np
import pytest

from tests.subproc import run_python, run_workers

WORKER = "tests/workers/elastic_resume.py"
TOLERANCE = 1e-5
STOP, STEPS = 12, 16


def _jobs(*jobs):
    return json.dumps([[layout, str(d), s, str(o)]
                       for layout, d, s, o in jobs])


def _read(path, index=0):
    return json.loads(open(str(path).format(index=index)).read())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t = tmp_path_factory.mktemp("elastic")
    # Three processes in turn: one with 4 simulated devices, two workers,
    # then one device.
    run_python([WORKER, "4", _jobs(
        ("one_device", t / "golden", STEPS, t / "golden.json"),
        ("mirrored4", t / "m", STOP, t / "m-first.json"),
        ("mirrored2", t / "m", STEPS, t / "m.json"),
        ("one_device", t / "w12", STOP, t / "w12-first.json"))],
        timeout=300)
    run_workers([WORKER, "1", _jobs(
        ("multi_worker", t / "w12", STEPS, t / "w12-{index}.json"),
        ("multi_worker", t / "w21", STOP, t / "w21-first-{index}.json"))],
        2, timeout=300)
    run_python([WORKER, "1", _jobs(
        ("one_device", t / "w21", STEPS, t / "w21.json"))], timeout=300)
    return {"golden": _read(t / "golden.json"),
            "4->2": [_read(t / "m.json")],
            "2->1": [_read(t / "w21.json")],
            "1->2": [_read(t / "w12-{index}.json", i) for i in range(2)]}


@pytest.mark.slow
@pytest.mark.parametrize("case, change", [
    ("4->2", "replicas 4 -> 2; global batch 16 kept, per-replica batch "
             "4 -> 8"),
    ("2->1", "workers 2 -> 1; replicas 2 -> 1; global batch 16 kept, "
             "per-replica batch 8 -> 16"),
    ("1->2", "workers 1 -> 2; replicas 1 -> 2; global batch 16 kept, "
             "per-replica batch 16 -> 8")])
def test_resume_on_another_layout_equals_the_uninterrupted_run(
        runs, case, change):
    golden = runs["golden"]
    # Every example trained on exactly twice in 2 epochs: none of the
    # interrupted epoch repeated or skipped.
    assert golden["seen"] == [2.0] * len(golden["seen"])
    chief = runs[case][0]
    assert f"at step {STOP} (elastic resume: {change}; the learning-rate " \
        f"schedule continues at step {STOP})" in chief["said"]
    for result in runs[case]:
        assert result["step"] == result["iterations"] == STEPS
        np.testing.assert_array_equal(result["seen"], golden["seen"])
        for key in ("weights", "slots"):
            for a, b in zip(result[key], golden[key]):
                np.testing.assert_allclose(a, b, atol=TOLERANCE)
