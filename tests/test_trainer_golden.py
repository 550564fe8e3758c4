"""Trainer on N replicas equals one device (golden runs).

One subprocess with 4 simulated CPU devices trains every case on one device,
2 and 4 mirrored replicas; two real worker processes train every case under
multi_worker. Per-step losses, per-loop accuracy, final weights and the
padded exact-once evaluation must equal the one-device run.
"""

import json
import os

import numpy as np
import pytest

from tests.subproc import run_python, run_workers

# Float32 sums in a different order: measured differences are at most 6e-8
# (weights) and 2.4e-7 (losses).
TOLERANCE = 1e-5
# Gradients rounded to bfloat16 (8 bits of mantissa) for the reduction,
# compared with the exact float32 run: measured at most 6.3e-4 (weights) and
# 2.9e-4 (losses) after 8 steps.
BFLOAT16_TOLERANCE = 5e-3
CASES = ("sgd_momentum", "adam", "clip", "keras_global_clipnorm", "accum",
         "regularized")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "local.json"
    run_python(["tests/workers/trainer_golden.py", "local", str(out)],
               timeout=420)
    return json.loads(out.read_text())


def assert_matches(run, golden, tolerance):
    np.testing.assert_allclose(run["loss"], golden["loss"], atol=tolerance)
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=tolerance)


def assert_same_run(run, golden):
    assert run["replicas_equal"]
    assert_matches(run, golden, TOLERANCE)
    np.testing.assert_allclose(run["accuracy"], golden["accuracy"],
                               atol=TOLERANCE)
    for key, value in golden["eval"].items():
        assert run["eval"][key] == pytest.approx(value, abs=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mirrored2", "mirrored4"])
@pytest.mark.parametrize("case", CASES)
def test_mirrored_matches_one_device(local, layout, case):
    assert_same_run(local[layout][case], local["one_device"][case])


def test_golden_runs_are_not_trivial(local):
    golden = local["one_device"]
    # Clipping was active: the clipped runs differ from the unclipped one.
    for case in ("clip", "keras_global_clipnorm"):
        assert max(np.abs(np.array(a) - np.array(b)).max() for a, b in zip(
            golden[case]["weights"], golden["sgd_momentum"]["weights"])) > 1e-2
    # Regularisation changed the loss, and training lowered it.
    assert golden["regularized"]["loss"][0] > golden["sgd_momentum"]["loss"][
        0] + 1e-3
    for run in golden.values():
        assert all(np.isfinite(run["loss"]))
        assert 0.0 <= min(run["accuracy"]) and max(run["accuracy"]) <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mirrored2", "mirrored4"])
def test_bfloat16_allreduce_close_to_float32(local, layout):
    assert_matches(local[layout]["bfloat16_allreduce"],
                   local["one_device"]["sgd_momentum"], BFLOAT16_TOLERANCE)


def test_one_gradient_all_reduce_per_update(local):
    # One CollectiveReduceV2 per replica per update, for K=1 and for K=4
    # micro-batches: accumulation adds no communication.
    assert local["all_reduces_per_update"] == {
        "1": local["local_replicas"], "4": local["local_replicas"]}
    assert local["local_replicas"] == 4


@pytest.mark.slow
def test_two_workers_match_one_device(local, tmp_path):
    model_dir, temp = tmp_path / "model", tmp_path / "tmp"
    temp.mkdir()
    run_workers(["tests/workers/trainer_golden.py", "multi_worker",
                 str(tmp_path / "worker{index}.json"), str(model_dir)], 2,
                timeout=300, env={"TMPDIR": str(temp)})
    workers = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
    assert [w["is_chief"] for w in workers] == [True, False]
    golden = local["one_device"]
    for worker in workers:
        for case in CASES:
            assert_same_run(worker["multi_worker"][case], golden[case])
        assert_matches(worker["multi_worker"]["bfloat16_allreduce"],
                       golden["sgd_momentum"], BFLOAT16_TOLERANCE)
        assert worker["all_reduces_per_update"] == {"1": 1, "4": 1}
    assert workers[0]["checkpoint_step"] == 4
    # Only the chief wrote to model_dir (checkpoints, TensorBoard "train");
    # worker 1 saved to temporary dirs and removed them.
    assert sorted(os.listdir(model_dir)) == [
        "checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
        "ckpt-4.data-00000-of-00001", "ckpt-4.index", "train"]
    assert not [p for p in os.listdir(temp) if p.startswith("tfmulti_")]
