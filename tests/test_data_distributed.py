"""Exact-once evaluation under real strategies equals one device.

1001 examples (not a multiple of any global batch used) evaluated through
`tfmulti.distribute_dataset(training=False)` on 3 mirrored replicas, and on
2 real worker processes, give the single-device accuracy and cross-entropy
(Keras `evaluate` with weighted metrics, and a custom loop) within 1e-6.
"""

import json

import pytest

from tests.subproc import run_python, run_workers

TOLERANCE = 1e-6
WORKER = "tests/workers/data_eval_worker.py"


def _check_against_golden(result, golden):
    # Every example counted once; the padding rows are there but weigh 0.
    assert result["examples"] == 1001
    assert result["rows"] > 1001
    assert result["rows"] % result["replicas"] == 0
    for key in ("accuracy", "xent"):
        assert result[key] == pytest.approx(golden[key], abs=TOLERANCE)
        assert result["evaluate"][key] == pytest.approx(
            golden["evaluate"][key], abs=TOLERANCE)
    # The golden run is not degenerate: a wrong count would move these.
    assert 0.05 < golden["accuracy"] < 0.95


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "golden.json"
    run_python([WORKER, str(out), "one_device"], timeout=240)
    result = json.loads(out.read_text())
    assert result["examples"] == 1001
    return result


@pytest.mark.slow
def test_mirrored_three_replicas_eval_equals_one_device(golden, tmp_path):
    out = tmp_path / "mirrored.json"
    run_python([WORKER, str(out), "mirrored3"], timeout=240)
    result = json.loads(out.read_text())
    assert result["replicas"] == 3
    # 1001 / (3 x 16) -> 21 steps, the last one partly padding.
    assert result["steps"] == 21
    _check_against_golden(result, golden)
    # The strategy's replica count reaches the batch check.
    assert "`global_batch_size`=50 is not divisible by the 3 replicas" in (
        result["batch_error"])
    assert "e.g. 48 or 51" in result["batch_error"]


@pytest.mark.slow
def test_two_workers_eval_equals_one_device(golden, tmp_path):
    run_workers([WORKER, str(tmp_path / "worker{index}.json"),
                 "multi_worker"], 2, timeout=240)
    results = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
    for result in results:
        assert result["replicas"] == 2
        # 501 and 500 examples per worker, 24 per replica -> 21 steps each.
        assert result["steps"] == 21
        _check_against_golden(result, golden)
