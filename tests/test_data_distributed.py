"""Exact-once evaluation under real strategies equals one device.

1001 synthetic examples (not a multiple of any global batch used) evaluated
through `tfmulti.distribute_dataset(training=False)` on 3 mirrored replicas,
and on 2 real worker processes, which also evaluate the `tfmulti_shapes` test
split read from its TFDS files (sharded by file), give the single-device
accuracy and cross-entropy (Keras `evaluate` with weighted metrics, and a
custom loop) within 1e-6.
"""

import json

import pytest

from tests.subproc import run_python, run_workers
from tfmulti.data import shapes

TOLERANCE = 1e-6
WORKER = "tests/workers/data_eval_worker.py"


def _check_against_golden(result, golden, num_examples):
    # Every example counted once; the padding rows are there but weigh 0.
    assert result["examples"] == num_examples
    assert result["rows"] > num_examples
    assert result["rows"] % result["replicas"] == 0
    # Relative as well: a float32 mean of 4000 cross-entropies of ~2.9
    # carries ~5e-7 of rounding (measured 4.8e-7 in Keras's metric).
    for key in ("accuracy", "xent"):
        assert result[key] == pytest.approx(golden[key], abs=TOLERANCE,
                                            rel=TOLERANCE)
        assert result["evaluate"][key] == pytest.approx(
            golden["evaluate"][key], abs=TOLERANCE, rel=TOLERANCE)
    # The golden run is not degenerate: a wrong count would move these.
    assert 0.02 < golden["accuracy"] < 0.95


@pytest.fixture(scope="module")
def data_dir(shapes_data_dir):
    return shapes_data_dir


@pytest.fixture(scope="module")
def golden(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("golden") / "golden.json"
    run_python([WORKER, str(out), "one_device", data_dir], timeout=240)
    result = json.loads(out.read_text())
    assert result["synthetic"]["examples"] == 1001
    assert result["shapes"]["examples"] == 4000
    return result


@pytest.mark.slow
def test_mirrored_three_replicas_eval_equals_one_device(golden, tmp_path):
    out = tmp_path / "mirrored.json"
    run_python([WORKER, str(out), "mirrored3"], timeout=240)
    result = json.loads(out.read_text())
    synthetic = result["synthetic"]
    assert synthetic["replicas"] == 3
    # 1001 / (3 x 16) -> 21 steps, the last one partly padding.
    assert synthetic["steps"] == 21
    _check_against_golden(synthetic, golden["synthetic"], 1001)
    # The strategy's replica count reaches the batch check.
    assert "`global_batch_size`=50 is not divisible by the 3 replicas" in (
        result["batch_error"])
    assert "e.g. 48 or 51" in result["batch_error"]


@pytest.mark.slow
def test_two_workers_eval_equals_one_device(golden, data_dir, tmp_path):
    run_workers([WORKER, str(tmp_path / "worker{index}.json"),
                 "multi_worker", data_dir], 2, timeout=300)
    results = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
    for result in results:
        assert result["synthetic"]["replicas"] == 2
        # 501 and 500 examples per worker, 24 per replica -> 21 steps each.
        assert result["synthetic"]["steps"] == 21
        _check_against_golden(result["synthetic"], golden["synthetic"], 1001)
        # 8 files, 4 per worker, 2000 examples each -> ceil(2000 / 24) = 84.
        assert result["shapes"]["steps"] == 84
        _check_against_golden(result["shapes"], golden["shapes"], 4000)
