"""Keras model.fit under create_strategy('multi_worker') equals one device.

Two real worker processes on loopback against a single-process golden run
over the same global batches: identical weights on both workers, and weights
and per-epoch losses equal to the golden run within 1e-5.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python, run_workers

TOLERANCE = 1e-5


@pytest.mark.slow
def test_two_worker_fit_matches_one_device(tmp_path):
    golden_out = tmp_path / "golden.json"
    run_python(["tests/workers/keras_fit_worker.py", str(golden_out),
                "one_device"], timeout=240)
    worker_outs = [tmp_path / f"worker{i}.json" for i in range(2)]
    # Each worker gets its own output path through an argument that only it
    # reads: the worker index is in TF_CONFIG, so a shared template suffices.
    run_workers(["tests/workers/keras_fit_worker.py",
                 str(tmp_path / "worker{index}.json"), "multi_worker"], 2,
                timeout=240)
    golden = json.loads(golden_out.read_text())
    workers = [json.loads(p.read_text()) for p in worker_outs]
    assert [w["is_chief"] for w in workers] == [True, False]
    for a, b in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(a, b)
    for w in workers:
        np.testing.assert_allclose(w["loss"], golden["loss"], atol=TOLERANCE)
        np.testing.assert_allclose(w["accuracy"], golden["accuracy"],
                                   atol=TOLERANCE)
        np.testing.assert_allclose(w["eval"]["loss"], golden["eval"]["loss"],
                                   atol=TOLERANCE)
        for a, b in zip(w["weights"], golden["weights"]):
            np.testing.assert_allclose(a, b, atol=TOLERANCE)
    # Training moved the weights: equal weights are not equal by accident.
    assert golden["loss"][-1] < golden["loss"][0]
