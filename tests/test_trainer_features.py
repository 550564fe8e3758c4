"""Trainer mixed precision, overflow skipping, resume and TensorBoard output
(2 simulated CPU replicas, one subprocess, real checkpoint and event files).
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("features")
    out = work / "results.json"
    run_python(["tests/workers/trainer_features.py", str(out), str(work)],
               timeout=300)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_mixed_precision_trains_without_nan(results):
    float16, bfloat16 = results["mixed_float16"], results["mixed_bfloat16"]
    assert float16["optimizer"] == "LossScaleOptimizer"
    assert float16["compute_dtype"] == "float16"
    assert bfloat16["optimizer"] == "Adam"
    assert bfloat16["compute_dtype"] == "bfloat16"
    # The same model, data and optimizer in float32 (the resume test's
    # uninterrupted run): half-precision losses stay within 1e-2 of it
    # (measured: 1e-3).
    float32 = results["resume"]["full_loss"]
    for run in (float16, bfloat16):
        assert len(run["loss"]) == 16 and all(np.isfinite(run["loss"]))
        np.testing.assert_allclose(run["loss"][:8], float32, atol=1e-2)


@pytest.mark.slow
def test_overflow_on_one_replica_skips_the_update_on_both(results):
    overflow = results["overflow"]
    assert not overflow["overflow_loss_finite"]   # the overflow happened
    assert overflow["unchanged"]                  # no replica applied it
    assert overflow["replicas_equal_after"]
    assert overflow["scale_after"] == overflow["scale_before"] / 2
    assert overflow["next_step_trains"]
    assert overflow["finite_after_next"]


@pytest.mark.slow
def test_resume_continues_to_the_uninterrupted_weights(results):
    resume = results["resume"]
    assert resume["resumed_step"] == 8
    assert "ckpt-4.index" in resume["checkpoints"]
    # The restored run trained steps 5..8 on the same batches.
    np.testing.assert_allclose(resume["resumed_loss"],
                               resume["full_loss"][4:], atol=1e-6)
    for a, b in zip(resume["resumed_weights"], resume["full_weights"]):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_tensorboard_scalars_per_loop(results):
    tags = results["summaries"]
    for tag in ("loss", "sparse_categorical_accuracy", "learning_rate",
                "steps_per_sec", "examples_per_sec"):
        assert tags[tag] == [2, 4, 6, 8], tag
