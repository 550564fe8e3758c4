"""Keras model.fit under create_strategy('multi_worker') equals one device.

Two real worker processes on loopback against a single-process golden run
over the same global batches: identical weights on both workers, and weights
and per-epoch losses equal to the golden run within 1e-5. The cluster comes
from TF_CONFIG, or from SLURM's variables alone.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python, run_workers
from tfmulti import cluster as cl

TOLERANCE = 1e-5
WORKER = "tests/workers/keras_fit_worker.py"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "golden.json"
    run_python([WORKER, str(out), "one_device"], timeout=240)
    result = json.loads(out.read_text())
    # Training moved the weights: equal weights are not equal by accident.
    assert result["loss"][-1] < result["loss"][0]
    return result


def _assert_workers_match(tmp_path, golden):
    workers = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
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


@pytest.mark.slow
def test_two_worker_fit_matches_one_device(tmp_path, golden):
    # '{index}' in the output path becomes each worker's TF_CONFIG index.
    run_workers([WORKER, str(tmp_path / "worker{index}.json"),
                 "multi_worker"], 2, timeout=240)
    _assert_workers_match(tmp_path, golden)


@pytest.mark.slow
def test_two_slurm_tasks_match_one_device(tmp_path, golden):
    port = cl.free_port()

    def slurm_env(index):
        # Two tasks on one node (this machine): ports base and base + 1.
        return {"SLURM_PROCID": str(index), "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "127.0.0.1",
                "SLURM_TASKS_PER_NODE": "2", "TFMULTI_PORT": str(port),
                "TF_CONFIG": ""}

    run_workers([WORKER, str(tmp_path / "worker{index}.json"),
                 "multi_worker"], 2, timeout=240, worker_env=slurm_env)
    _assert_workers_match(tmp_path, golden)
