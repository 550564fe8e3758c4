"""Load balancing: the share policy alone, and balanced training against an
even split and one device (issue 32).

The golden runs: one subprocess with 4 simulated CPU devices trains each
case (Adam, clipping by the reduced norm, 4-step accumulation, mixed
float16) for 20 steps on one device, on 2 replicas with balance=[1, 1],
[3, 1] and "auto", and on 4 with [3, 1, 1, 1]; two worker processes train
[1, 1], [3, 1] and "auto" with one replica each. Each also evaluates after
training.
"""

import json

import numpy as np
import pytest

from tests.subproc import run_python, worker_json
from tfmulti import balance

# Float32 sums in another order: measured at most 2.4e-7 (losses) and
# 9e-8 (weights) between any two layouts over 20 steps.
TOLERANCE = 1e-5
# Mixed float16: each replica's gradient is rounded to float16 from its own
# rows, so a different split rounds differently. Measured between the even
# split and [3, 1] / [3, 1, 1, 1]: at most 7.4e-5 (losses), 1.3e-4
# (weights); the even split itself is 9.3e-5 from one device.
FLOAT16_TOLERANCE = 1e-3
CASES = ("adam", "clip", "accum", "mixed_float16")


# -- the policy ------------------------------------------------------------

def test_counts_follow_weights_and_sum_to_the_batch():
    assert balance.counts_from_weights([3, 1], 32) == [24, 8]
    assert balance.counts_from_weights([3, 1, 1, 1], 32) == [16, 6, 5, 5]
    assert balance.counts_from_weights([1, 1, 1], 32) == [11, 11, 10]
    # Nobody is left with nothing.
    assert balance.counts_from_weights([1000, 1, 1], 10) == [8, 1, 1]
    with pytest.raises(ValueError, match="`global_batch_size`=2"):
        balance.counts_from_weights([1, 1, 1], 2)


def test_parse_balance_per_replica_per_worker_and_errors():
    assert balance.parse_balance(None, num_replicas=2) is None
    assert balance.parse_balance("auto", num_replicas=2) == "auto"
    assert balance.parse_balance([3, 1], num_replicas=2) == [3.0, 1.0]
    assert balance.parse_balance([3, 1], num_replicas=4, num_workers=2) == [
        1.5, 1.5, 0.5, 0.5]
    for bad, match in (("fast", "`balance`"), ([1, 0], "positive"),
                       ([1, float("nan")], "positive"),
                       ([1, 1, 1], "3 weight"), (True, "`balance`")):
        with pytest.raises(ValueError, match=match):
            balance.parse_balance(bad, num_replicas=2)


def test_policy_moves_to_speed_in_bounded_steps():
    policy = balance.SharePolicy(2, 100, options=balance.PolicyOptions(
        max_change=0.1, hysteresis=0.02, smoothing=1.0))
    # Replica 1 takes 3x as long per example: the target is 75/25.
    seen = []
    for _ in range(5):
        c = policy.counts
        policy.update([c[0] * 1.0, c[1] * 3.0], c)
        seen.append(list(policy.counts))
    assert seen[:3] == [[60, 40], [70, 30], [75, 25]]
    assert seen[-1] == [75, 25]


def test_policy_hysteresis_ignores_noise():
    policy = balance.SharePolicy(2, 100, options=balance.PolicyOptions(
        hysteresis=0.05, smoothing=1.0))
    # 4% faster: a target of 51/49, inside the 5-example band.
    assert not policy.update([50 * 1.0, 50 * 1.04], [50, 50])
    assert policy.counts == [50, 50]


def test_policy_hysteresis_is_judged_by_the_step_time():
    # The bench's slowed worker (stop 43): speeds 1550 and 427 examples/s,
    # split 770/230 of 1000. The target, 784/216, is 1.4% of the batch
    # away, but the slow replica's 230 take 6% longer than the balanced
    # step: past a 2% band, the split moves.
    policy = balance.SharePolicy(2, 1000, initial=[0.77, 0.23],
                                 options=balance.PolicyOptions(
                                     hysteresis=0.02, smoothing=1.0))
    assert policy.counts == [770, 230]
    assert policy.update([770 / 1550, 230 / 427], [770, 230])
    assert policy.counts == [784, 216]


def test_policy_is_deterministic_and_keeps_a_floor():
    def run():
        policy = balance.SharePolicy(4, 64, options=balance.PolicyOptions(
            max_change=1.0, smoothing=1.0, min_share=0.25))
        policy.update([1.0, 1.0, 1.0, 100.0], [16, 16, 16, 16])
        return policy.counts
    assert run() == run()
    counts = run()
    assert sum(counts) == 64
    # 0.25 of an even share of 16 = 4 examples at least.
    assert counts[3] >= 4


def test_idle_fraction():
    assert balance.idle_fraction([1.0, 1.0]) == 0.0
    assert balance.idle_fraction([1.0, 3.0]) == pytest.approx(1 - 2 / 3)


def test_policy_options_are_checked():
    with pytest.raises(ValueError, match="`max_change`"):
        balance.PolicyOptions(max_change=0)
    with pytest.raises(ValueError, match="`hysteresis`"):
        balance.PolicyOptions(hysteresis=2)


# -- balanced training ----------------------------------------------------

def assert_same(run, golden, case):
    tolerance = FLOAT16_TOLERANCE if case == "mixed_float16" else TOLERANCE
    np.testing.assert_allclose(run["loss"], golden["loss"], atol=tolerance)
    for a, b in zip(run["weights"], golden["weights"]):
        np.testing.assert_allclose(a, b, atol=tolerance)
    np.testing.assert_allclose(run["accuracy"], golden["accuracy"],
                               atol=tolerance)
    for key, value in golden["eval"].items():
        assert run["eval"][key] == pytest.approx(value, abs=tolerance)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("balance") / "local.json"
    run_python(["tests/workers/balance_golden.py", "local", str(out)],
               timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mirrored2:[1, 1]", "mirrored2:[3, 1]",
                                    "mirrored2:auto",
                                    "mirrored4:[3, 1, 1, 1]"])
def test_mirrored_balanced_equals_even_and_one_device(local, layout):
    for case in CASES:
        run = local[layout][case]
        assert run["replicas_equal"]
        # A share change is a variable assignment: one trace per loop fn.
        assert run["retraces"] == 1
        assert_same(run, local["one_device:None"][case], case)
        assert_same(run, local["mirrored2:[1, 1]"][case], case)


@pytest.mark.slow
def test_fixed_shares_are_the_given_ones_and_reported(local):
    run = local["mirrored4:[3, 1, 1, 1]"]["adam"]
    assert all(s == [0.5, 6 / 32, 5 / 32, 5 / 32] for s in run["shares"])
    assert len(run["idle_fraction"]) == 4
    assert all(0 <= f < 1 for f in run["idle_fraction"])
    # The timer measured every replica in every loop.
    assert all(min(s) > 0 for s in run["seconds"])


@pytest.mark.slow
def test_multi_worker_balanced_equals_even_split(tmp_path):
    # Against the workers' own even split, not the local one-device run:
    # both in one test would cost two subprocess sets (past 10 minutes at
    # load 25). The even split of the balanced path equals one device in
    # test_mirrored_balanced_equals_even_and_one_device; the standard
    # 2-worker path equals one device in test_trainer_golden.
    workers = worker_json(["tests/workers/balance_golden.py",
                           "multi_worker"], 2, tmp_path, timeout=540)
    for worker in workers:
        even = worker["multi_worker:[1, 1]"]
        for layout in ("multi_worker:[3, 1]", "multi_worker:auto"):
            for case in CASES:
                assert_same(worker[layout][case], even[case], case)
                assert worker[layout][case]["retraces"] == 1
    for case in CASES:
        assert_same(workers[1]["multi_worker:[3, 1]"][case],
                    workers[0]["multi_worker:[3, 1]"][case], case)
    # Both workers saw the same shares (auto: computed from the same
    # all-reduced timings).
    for layout in ("multi_worker:[3, 1]", "multi_worker:auto"):
        assert workers[0][layout]["adam"]["shares"] == (
            workers[1][layout]["adam"]["shares"])
    assert workers[0]["multi_worker:[3, 1]"]["adam"]["shares"][0] == [
        0.75, 0.25]


def test_recipe_balance_flag_reaches_metrics_json(tmp_path, shapes_data_dir):
    run_python(["-m", "recipes.custom_loop", "--strategy=mirrored",
                "--cpu_replicas=2", "--balance=3,1",
                f"--model_dir={tmp_path / 'run'}",
                f"--data_dir={shapes_data_dir}", "--global_batch_size=32",
                "--steps=4", "--steps_per_loop=2"], timeout=300)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [loop["counts"] for loop in metrics["balance"]] == [[24, 8]] * 2
    assert all(0 <= loop["idle_fraction"] < 1 for loop in metrics["balance"])
    assert metrics["config"]["balance"] == "3,1"


def test_recipe_balance_flag_with_keras_fit(tmp_path, shapes_data_dir):
    run_python(["-m", "recipes.keras_fit", "--strategy=mirrored",
                "--cpu_replicas=2", "--balance=3,1",
                f"--model_dir={tmp_path / 'run'}",
                f"--data_dir={shapes_data_dir}", "--global_batch_size=32",
                "--steps=4", "--steps_per_loop=2"], timeout=300)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["loop"] == "fit"
    assert [call["counts"] for call in metrics["balance"]] == [[24, 8]] * 2
    assert all(0 <= call["idle_fraction"] < 1 for call in metrics["balance"])


def test_recipe_balance_flag_errors(tmp_path):
    code, out = run_python(["-m", "recipes.custom_loop", "--balance=3,x",
                            f"--model_dir={tmp_path / 'run'}"],
                           timeout=120, check=False)
    assert code != 0
    assert "`--balance` should be 'none', 'auto' or comma-separated" in out
    assert "'3,x'" in out


def test_balance_with_a_data_service_is_refused_before_anything_runs(
        tmp_path, monkeypatch):
    """The balanced Trainer reads its own global batches, so a tf.data
    service (flag or environment) would be left unused: refused, naming
    both, before a run directory exists; under Keras fit too."""
    from tests.test_recipes import _parse
    from tfmulti import experiment
    run = tmp_path / "run"
    config = _parse("--balance=auto", "--data_service=localhost:5050",
                    f"--model_dir={run}")
    with pytest.raises(experiment.ConfigError, match=(
            r"`balance`='auto' cuts .* tf.data service at "
            r"grpc://localhost:5050 .* Drop --balance")) as e:
        experiment.train_and_evaluate(config, loop="trainer")
    assert e.value.flag == "balance"
    monkeypatch.setenv("TFMULTI_DATA_SERVICE", "localhost:5051")
    with pytest.raises(experiment.ConfigError, match="TFMULTI_DATA_SERVICE"):
        experiment.train_and_evaluate(_parse(
            "--balance=3,1", f"--model_dir={run}"), loop="trainer")
    with pytest.raises(experiment.ConfigError, match="TFMULTI_DATA_SERVICE"):
        experiment.train_and_evaluate(_parse(
            "--balance=3,1", f"--model_dir={run}"), loop="fit")
    assert not run.exists()


def test_balanced_data_and_options_errors():
    import tensorflow as tf
    from tfmulti.training import balancing
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    balancer = balancing.Balancer(strategy, [1.0])
    rows = tf.data.Dataset.from_tensor_slices((tf.zeros([8, 2]),
                                               tf.zeros([8])))
    with pytest.raises(ValueError, match="one static size"):
        balancer.iterator(rows.batch(3))
    with pytest.raises(ValueError, match="`global_batch_size` is 8 but"):
        balancer.iterator(rows.batch(4, drop_remainder=True),
                          global_batch_size=8)
    with pytest.raises(ValueError, match="pass `global_batch_size` too"):
        balancer.iterator(lambda context: rows)
    with pytest.raises(ValueError, match="got list.*cannot be re-split"):
        balancer.iterator([rows])
    with pytest.raises(ValueError, match="`balance`='auto' is not supported"
                       ".*jit_compile"):
        balancing.for_trainer(strategy, "auto", pipelined=False,
                              asynchronous=False, jit_compile=True)
    # One replica takes the whole global batch.
    iterator = balancer.iterator(rows.batch(4, drop_remainder=True))
    x, y = next(iterator)
    assert x.shape == (4, 2) and iterator.global_batch_size == 4


def test_progress_line_groups_the_balance_logs():
    import io

    from tfmulti import progress
    stream = io.StringIO()
    logger = progress.ProgressLogger(total_steps=4, steps_per_epoch=4,
                                     examples_per_step=32, stream=stream)
    logger.on_train_batch_begin(0)
    logger.on_train_batch_end(3, {
        "loss": 0.5, "share_0": 0.75, "share_1": 0.25,
        "replica_seconds_0": 0.0612, "replica_seconds_1": 0.0608,
        "idle_fraction": 0.0065})
    line = stream.getvalue()
    assert line.startswith("step 4/4 (epoch 1/1) - loss 0.5000 - ")
    assert ("examples/s - shares 0.75/0.25 - replica ms/step 61.2/60.8 - "
            "idle 0.01 - ETA") in line
    assert "share_0" not in line and logger.train_logs == {"loss": 0.5}
