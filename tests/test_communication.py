"""Local SGD / DiLoCo and PowerSGD: golden equalities and traffic counts.

One pair of worker processes with 2 simulated CPU replicas each (2 workers
x 2 replicas) trains every case under multi_worker, then is SIGKILLed
between synchronisations, right after a checkpoint; a second pair resumes
from it. A third process (4 replicas under MirroredStrategy) runs beside the
pair. H=1 local SGD equals the synchronous Trainer; PowerSGD at full rank
equals uncompressed training; the bytes counted where the reductions are
issued follow 1/H and (m+n)r/(mn); a resumed run equals an uninterrupted one.
"""

import json
import signal
import threading

import numpy as np
import pytest

import tfmulti
from tests.subproc import run_python, run_workers
from tests.test_recipes import _parse
from tfmulti.training import powersgd

# Float32 sums in another order: measured at most 1.2e-7 (weights, losses).
LOCAL_SGD_TOLERANCE = 1e-6
POWERSGD_TOLERANCE = 1e-5
STEPS = 8


WORKER = "tests/workers/communication_golden.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("communication")


@pytest.fixture(scope="module")
def runs(out):
    # The mirrored-4 process runs beside the worker pair (it is small).
    mirrored = {}
    thread = threading.Thread(target=lambda: mirrored.update(result=run_python(
        [WORKER, "mirrored", str(out / "mirrored{index}.json"), "-"],
        timeout=600, check=False)))
    thread.start()
    try:
        # The same worker processes also train the first 5 updates of the
        # resume test, saving checkpoints to model/, then kill themselves.
        for rc, output in run_workers(
                [WORKER, "multi_worker", str(out / "worker{index}.json"),
                 str(out / "model")], 2, timeout=600, check=False):
            assert rc == -signal.SIGKILL, output[-4000:]
    finally:
        thread.join()
    rc, output = mirrored["result"]
    assert rc == 0, output[-4000:]
    return [json.loads((out / f"worker{i}.json").read_text())
            for i in (0, 1)]


@pytest.fixture(scope="module")
def mirrored(runs, out):
    return json.loads((out / "mirrored0.json").read_text())


def max_diff(a, b):
    return max(max(np.abs(np.array(x) - np.array(y)).max()
                   for x, y in zip(a["weights"], b["weights"])),
               np.abs(np.array(a["loss"]) - np.array(b["loss"])).max())


@pytest.mark.slow
def test_layout(runs):
    for run in runs:
        assert (run["workers"], run["replicas"]) == (2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("case,golden,tolerance", [
    ("local_h1", "sync", LOCAL_SGD_TOLERANCE),
    ("local_path_h1", "sync_sgd", LOCAL_SGD_TOLERANCE),
    ("powersgd_full_clip_accum", "sync_clip_accum", POWERSGD_TOLERANCE),
    ("keras_powersgd_full", "keras_sync", POWERSGD_TOLERANCE),
    ("keras_powersgd_full_start3", "keras_sync", POWERSGD_TOLERANCE),
    ("local_path_h1_bn", "sync_sgd_bn", LOCAL_SGD_TOLERANCE),
])
def test_equals_synchronous(runs, case, golden, tolerance):
    for run in runs:
        assert run[case].get("replicas_equal", True)
        assert max_diff(run[case], run[golden]) <= tolerance


@pytest.mark.slow
@pytest.mark.parametrize("case,golden,tolerance", [
    ("local_path_h1", "sync_sgd", LOCAL_SGD_TOLERANCE),
    # Full rank after 3 dense updates.
    ("powersgd_full", "sync", POWERSGD_TOLERANCE),
    # A dense warm-up as long as the run: the synchronous update.
    ("powersgd_r1_dense", "sync", LOCAL_SGD_TOLERANCE),
])
def test_equals_synchronous_mirrored_4(mirrored, case, golden, tolerance):
    assert mirrored["replicas"] == 4
    assert mirrored[case]["replicas_equal"]
    assert max_diff(mirrored[case], mirrored[golden]) <= tolerance


@pytest.mark.slow
def test_powersgd_dense_warmup_switch(mirrored):
    # PowerSGD(start_iter=3) is, by definition (PyTorch's
    # start_powerSGD_iter), 3 synchronous updates and then PowerSGD from its
    # first update: zero error feedback, the initial Q.
    warm = mirrored["powersgd_r1_start3"]
    reference = mirrored["powersgd_r1_after_3_sync"]
    assert max_diff(dict(warm, loss=warm["loss"][3:]),
                    reference) <= LOCAL_SGD_TOLERANCE
    assert max_diff(dict(warm, loss=warm["loss"][:4]), dict(
        mirrored["sync"], loss=mirrored["sync"]["loss"][:4],
        weights=warm["weights"])) <= LOCAL_SGD_TOLERANCE


@pytest.mark.slow
def test_powersgd_dense_warmup_under_multi_worker(runs):
    for run in runs:
        warm, sync = run["powersgd_r1_start3"], run["sync"]
        # The loss of update k is computed before it: the first 4 are the
        # synchronous run's, the 5th (after the first compressed update)
        # is not.
        np.testing.assert_allclose(warm["loss"][:4], sync["loss"][:4],
                                   atol=LOCAL_SGD_TOLERANCE)
        assert abs(warm["loss"][4] - sync["loss"][4]) > 1e-4


@pytest.mark.slow
def test_batchnorm_statistics_averaged(runs):
    # Moving statistics are linear in each replica's batch statistics, so
    # their mean over all 4 replicas is what one copy updated with the global
    # batch statistics holds, whenever the mean is taken. The train loop
    # takes it at its end, the one place (local SGD sends none at its
    # synchronisations): every replica of both workers then holds the
    # synchronous run's values. Without that average each replica keeps
    # its own (checked by removing it: this test then fails).
    def every_replica(case):
        # [variable] -> array [replica 0, 1 of worker 0, then of worker 1]
        return [np.array(runs[0][case]["state"][v] + runs[1][case]["state"][v])
                for v in range(len(runs[0][case]["state"]))]

    averaged, golden = every_replica("local_path_h1_bn"), every_replica(
        "sync_sgd_bn")
    assert len(averaged) == 2  # moving mean and variance
    for a, g in zip(averaged, golden):
        assert np.abs(g - g[0]).max() == 0.0
        np.testing.assert_allclose(a, g, atol=LOCAL_SGD_TOLERANCE)


@pytest.mark.slow
def test_local_sgd_is_not_synchronous_and_workers_agree_at_sync(runs):
    first, second = runs
    for run in (first, second):
        # Replicas on one worker stay identical (all-reduced every step)...
        assert run["local_h4"]["replicas_equal"]
        # ...while workers took 4 local steps: not the synchronous result.
        assert max_diff(run["local_h4"], run["sync_sgd"]) > 1e-3
    # Step 8 is a synchronisation point of H=4: the workers agree.
    assert max_diff(dict(first["local_h4"], loss=[0]),
                    dict(second["local_h4"], loss=[0])) == 0.0
    # DiLoCo (warm-up 2, H=4) last synchronised at step 6: they differ.
    assert max_diff(dict(first["diloco_h4"], loss=[0]),
                    dict(second["diloco_h4"], loss=[0])) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case", ["diloco_h4", "keras_diloco_h4"])
def test_evaluation_between_syncs_reads_mean_weights(runs, case):
    # DiLoCo (warm-up 2, H=4) last synchronised at update 6 of 8: the
    # workers' weights differ, and evaluation (the Trainer's, or Keras's
    # through `tfmulti.keras.distributed`) reads their mean, computed here
    # from both workers' weights, on the 100 evaluation examples.
    first, second = (run[case] for run in runs)
    assert max_diff(dict(first, loss=[0]), dict(second, loss=[0])) > 1e-4
    mean = [(np.array(a) + np.array(b)) / 2
            for a, b in zip(first["weights"], second["weights"])]
    # The worker's data (tests/workers/communication_golden.py).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = rng.integers(0, 3, size=(512,))
    logits = np.maximum(x[:100] @ mean[0] + mean[1], 0) @ mean[2] + mean[3]
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    expected = -log_p[np.arange(100), y[:100]].mean()
    for run in (first, second):
        assert run["evaluation"]["loss"] == pytest.approx(expected, abs=1e-5)
        # The training trajectory is untouched: each worker's own weights
        # are back.
        assert run["weights_after_evaluation"] == run["weights"]
        # One all-reduce of the parameters, counted.
        before, after = run["communication"], run[
            "communication_after_evaluation"]
        assert after["inter_worker_calls"] == before["inter_worker_calls"] + 1
        assert after["inter_worker_bytes"] == before[
            "inter_worker_bytes"] + parameter_bytes(run)


def parameter_bytes(run):
    return 4 * sum(int(np.prod(s)) for s in run["shapes"])


@pytest.mark.slow
def test_local_sgd_bytes_between_workers(runs):
    for run in runs:
        sync = run["sync_sgd"]["communication"]["inter_worker_bytes"]
        assert sync == STEPS * parameter_bytes(run["sync_sgd"])
        local = run["local_h4"]["communication"]
        assert local["inter_worker_bytes"] == pytest.approx(sync / 4,
                                                            rel=0.05)
        assert local["inter_worker_calls"] == STEPS // 4
        # The worker-local gradient all-reduce runs every step.
        assert local["all_reduce_calls"] - local["inter_worker_calls"] == STEPS
        # DiLoCo: 2 synchronous warm-up steps, then one sync at step 6.
        diloco = run["diloco_h4"]["communication"]
        assert diloco["inter_worker_bytes"] == 3 * parameter_bytes(
            run["sync_sgd"])
        # Keras fit through tfmulti.keras.distributed counts the same.
        assert run["keras_local_h4"]["communication"] == local


@pytest.mark.slow
def test_powersgd_bytes(runs):
    options = tfmulti.PowerSGD(rank=1)
    for run in runs:
        # 3 dense updates (the warm-up), then 5 compressed ones.
        warm = run["powersgd_r1_start3"]
        expected = 0
        for shape in warm["shapes"]:
            if powersgd.compresses(shape, options):
                m, n = powersgd.matrix_shape(shape)
                expected += 4 * (m + n) * 1
            else:
                expected += 4 * int(np.prod(shape))
        dense = parameter_bytes(warm)
        traffic = warm["communication"]
        assert traffic["all_reduce_bytes"] == 3 * dense + 5 * expected
        # Packed: one dense all-reduce per warm-up update; then the dense
        # tensors with the P factors, and the Q factors.
        assert traffic["all_reduce_calls"] == 3 * 1 + 5 * 2
        assert traffic["inter_worker_bytes"] == traffic["all_reduce_bytes"]
        # Both matrices compress at rank 1: 62 floats instead of 195.
        assert expected < dense / 3
        # Keras fit's warm-up switches at the same update: 3 dense, then 5
        # full-rank compressed updates (every matrix, at rank min(m, n)).
        full = tfmulti.PowerSGD(rank=16, min_compression_rate=0.01)
        compressed = 0
        for shape in warm["shapes"]:
            if powersgd.compresses(shape, full):
                m, n = powersgd.matrix_shape(shape)
                compressed += 4 * (m + n) * min(16, m, n)
            else:
                compressed += 4 * int(np.prod(shape))
        traffic = run["keras_powersgd_full_start3"]["communication"]
        assert traffic["all_reduce_calls"] == 3 * 1 + 5 * 2
        assert traffic["all_reduce_bytes"] == 3 * dense + 5 * compressed


def test_options_validated():
    with pytest.raises(ValueError, match="`every`"):
        tfmulti.LocalSGD(every=0)
    with pytest.raises(ValueError, match="`warmup_steps`"):
        tfmulti.LocalSGD(warmup_steps=-1)
    with pytest.raises(ValueError, match="`outer_optimizer`"):
        tfmulti.LocalSGD(outer_optimizer="nesterov")
    with pytest.raises(ValueError, match="`momentum`"):
        tfmulti.OuterSGD(momentum=1.0)
    with pytest.raises(ValueError, match="`rank`"):
        tfmulti.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="`min_compression_rate`"):
        tfmulti.PowerSGD(min_compression_rate=0)
    with pytest.raises(ValueError, match="`start_iter`.*-1"):
        tfmulti.PowerSGD(start_iter=-1)
    with pytest.raises(ValueError, match="`start_iter`"):
        tfmulti.PowerSGD(start_iter=2.0)
    assert tfmulti.LocalSGD(every=1).synchronous
    assert not tfmulti.LocalSGD(every=1,
                                outer_optimizer=tfmulti.OuterSGD()).synchronous


def test_combinations_rejected():
    from tfmulti.training import reducers
    with pytest.raises(ValueError, match="`sync`"):
        reducers.check_options(tfmulti.LocalSGD(every=4),
                                tfmulti.PowerSGD())
    with pytest.raises(ValueError, match="`allreduce_dtype`"):
        reducers.check_options(None, tfmulti.PowerSGD(),
                                allreduce_dtype="bfloat16")
    with pytest.raises(ValueError, match="`compression`"):
        reducers.check_options(None, "powersgd")


def assert_same_state(resumed, whole):
    """Losses, weights and every replica's value of every model and
    optimizer variable, within 1e-6."""
    np.testing.assert_allclose(resumed["loss"], whole["loss"][-len(
        resumed["loss"]):], atol=LOCAL_SGD_TOLERANCE)
    for a, b in zip(resumed["weights"], whole["weights"]):
        np.testing.assert_allclose(a, b, atol=LOCAL_SGD_TOLERANCE)
    assert len(resumed["all_replicas"]) == len(whole["all_replicas"])
    for a, b in zip(resumed["all_replicas"], whole["all_replicas"]):
        np.testing.assert_allclose(np.array(a), np.array(b),
                                   atol=LOCAL_SGD_TOLERANCE)


@pytest.fixture(scope="module")
def resumed(runs, out):
    # `runs` trained the first 5 updates and was killed; new processes resume.
    run_workers([WORKER, "resume", str(out / "resume{index}.json"),
                 str(out / "model")], 2, timeout=400)
    return [json.loads((out / f"resume{i}.json").read_text())
            for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["resume_local", "resume_powersgd"])
def test_resume_between_syncs_equals_uninterrupted(runs, resumed, case):
    first, second = runs
    # Killed where the workers differ: local SGD last synchronised at 4.
    if case == "resume_local":
        assert max_diff(dict(first["first_" + case], loss=[0]),
                        dict(second["first_" + case], loss=[0])) > 1e-4
    for i in (0, 1):
        assert len(runs[i]["first_" + case]["loss"]) == 5
        assert resumed[i][case]["start_step"] == 5
        assert_same_state(resumed[i][case], runs[i]["uninterrupted_" + case])
    names = " ".join(runs[0]["checkpointed"])
    for part in ("anchors", "outer_momentum", "updates"):
        assert part in names


@pytest.mark.slow
def test_keras_fit_resume_between_syncs_equals_uninterrupted(runs, resumed):
    for i in (0, 1):
        assert_same_state(resumed[i]["resume_keras"],
                          runs[i]["uninterrupted_keras"])


def test_recipe_flags():
    sync, compression = _parse("--sync_every=32", "--outer_learning_rate=0.7",
                               "--outer_momentum=0.9").communication_options()
    assert sync == tfmulti.LocalSGD(every=32, outer_optimizer=tfmulti.OuterSGD(
        learning_rate=0.7, momentum=0.9))
    assert compression is None
    sync, compression = _parse("--compression=powersgd",
                               "--powersgd_rank=2").communication_options()
    assert (sync, compression) == (None, tfmulti.PowerSGD(rank=2))
    # Issue 27: by default a dense warm-up, the library's and the flag's.
    assert compression.start_iter == powersgd.DEFAULT_START_ITER > 0
    assert _parse("--compression=powersgd", "--powersgd_start_iter=0"
                  ).communication_options()[1].start_iter == 0
    # The line the recipe prints before training, naming the flag.
    from tfmulti import experiment_config
    config = _parse("--compression=powersgd", "--steps=300")
    compression = config.communication_options()[1]
    notes = experiment_config.length_notes(config, compression, 300, False)
    assert notes == [
        "PowerSGD: the first 100 of 300 updates are dense "
        "(--powersgd_start_iter=100); right for a few hundred updates, a run "
        "of thousands can start compressing sooner and send fewer bytes."]
    assert "nothing is compressed" in experiment_config.length_notes(
        config, compression, 80, False)[0]
    assert experiment_config.length_notes(_parse(), None, 300, False) == []
    # The defaults are the synchronous update.
    assert _parse().communication_options() == (None, None)
    with pytest.raises(ValueError, match="`sync`"):
        _parse("--sync_every=4", "--compression=powersgd")
