"""`model.fit` through tfmulti.keras.distributed equals one device.

One process with 4 simulated CPU devices runs every case with plain Keras
`fit` on one device (steps_per_execution=1, the golden run) and through
`distributed` on 4 mirrored replicas with steps_per_execution=8 and 12
steps an epoch (so each epoch ends with a short call); two real worker
processes run the multi-worker cases against the same golden run.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python, run_workers

TOLERANCE = 1e-5
WORKER = "tests/workers/keras_fit_distributed.py"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "local.json"
    run_python([WORKER, "local", str(out)], timeout=300)
    results = json.loads(out.read_text())["results"]
    for case in results["one_device"].values():
        # Training moved the weights: equal weights are not equal by accident.
        assert case["loss"][-1] < case["loss"][0]
    return results


def _assert_matches(run, golden):
    # Exactly the updates asked for: 2 epochs of `steps_per_epoch` each, not
    # whole calls of 8 past the end of an epoch.
    assert run["iterations"] == golden["iterations"]
    for key in ("loss", "accuracy", "val_loss"):
        np.testing.assert_allclose(run[key], golden[key], atol=TOLERANCE,
                                   err_msg=key)
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sgd_momentum", "adam_clipnorm",
                                  "clip_accum"])
def test_mirrored_fit_matches_one_device(local, case):
    _assert_matches(local["mirrored4"][case], local["one_device"][case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sharded_clip_accum",
                                  "sharded2_clip_accum"])
def test_sharded_fit_matches_unsharded_and_one_device(local, case):
    # shard_optimizer_state=1 or 2: the same updates as the unsharded
    # `distributed` fit and one device, with 1/4 of the state per replica.
    run = local["mirrored4"][case]
    _assert_matches(run, local["mirrored4"]["clip_accum"])
    _assert_matches(run, local["one_device"]["clip_accum"])
    # The end of fit gathered the momentum into model.optimizer: the
    # unsharded run's.
    unsharded = local["mirrored4"]["clip_accum"]["optimizer"]
    assert len(run["optimizer"]) == len(unsharded)
    for a, b in zip(run["optimizer"], unsharded):
        np.testing.assert_allclose(a, b, atol=TOLERANCE)
    # SGD's momentum for 195 parameters in shards of 49, its step and rate.
    assert list(run["bytes_per_device"].values()) == [49 * 4 + 8 + 4] * 4


@pytest.mark.slow
def test_mirrored_evaluate_and_predict_match_one_device(local):
    run, golden = local["mirrored4"]["sgd_momentum"], local["one_device"][
        "sgd_momentum"]
    for evaluation in ("eval", "eval_stream"):
        assert run[evaluation].keys() == golden[evaluation].keys()
        for key in golden[evaluation]:
            np.testing.assert_allclose(run[evaluation][key],
                                       golden[evaluation][key],
                                       atol=TOLERANCE, err_msg=evaluation)
    np.testing.assert_allclose(run["predict"], golden["predict"],
                               atol=TOLERANCE)


@pytest.mark.slow
def test_two_worker_fit_matches_one_device(tmp_path, local):
    run_workers([WORKER, "multi_worker", str(tmp_path / "worker{index}.json")],
                2, timeout=300)
    workers = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
    assert [w["is_chief"] for w in workers] == [True, False]
    golden = local["one_device"]
    for worker in workers:
        results = worker["results"]["multi_worker"]
        assert set(results) == {"sgd_momentum", "clip_accum",
                                "sharded_clip_accum", "sharded2_clip_accum"}
        for case, run in results.items():
            _assert_matches(run, golden[case.replace(
                "sharded2_", "").replace("sharded_", "")])
        np.testing.assert_allclose(results["sgd_momentum"]["predict"],
                                   golden["sgd_momentum"]["predict"],
                                   atol=TOLERANCE)
        for evaluation in ("eval", "eval_stream"):
            for key, value in golden["sgd_momentum"][evaluation].items():
                np.testing.assert_allclose(
                    results["sgd_momentum"][evaluation][key], value,
                    atol=TOLERANCE, err_msg=evaluation)
