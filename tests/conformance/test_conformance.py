"""Outside code under tfmulti's strategies equals one device, or stops with
(or warns) the exact text that names the fix.

One subprocess with 4 simulated CPU devices runs every local case
(`cases_local.py`) on one device and on 4 mirrored replicas (3 where the
case is an uneven split), and the one-device golden run of the
multi-worker reports; two worker processes run those reports
(`cases_multi_worker.py`). Each row of docs/conformance.md is one test here.
Every golden run must have moved its weights (`moved`), so a comparison of
untrained models cannot pass.
"""

import json

import numpy as np
import pytest

from tests.conformance.conftest import error_of, ok

TOLERANCE = 1e-5
# The one local subprocess runs every case: minutes on 2 shared cores (the
# fixture's own bound, plus the tests).
pytestmark = pytest.mark.timeout(1900)


def assert_close(run, golden, *, tol=TOLERANCE, keys=("weights", "history",
                                                      "eval", "logs"),
                 check_trained=True):
    if check_trained and "weights" in keys and "weights" in golden:
        # Ten times the tolerance at least, so a match is not two untrained
        # models.
        assert golden["moved"] is not None and golden["moved"] > 10 * tol, (
            "the golden run did not train", golden["moved"])
    for key in keys:
        if key not in golden:
            continue
        assert key in run, key
        if key == "weights":
            assert len(run[key]) == len(golden[key])
            for a, b in zip(run[key], golden[key]):
                np.testing.assert_allclose(a, b, atol=tol, err_msg=key)
        elif isinstance(golden[key], dict):
            assert set(run[key]) == set(golden[key]), key
            for name in golden[key]:
                np.testing.assert_allclose(run[key][name], golden[key][name],
                                           atol=tol, err_msg=f"{key}/{name}")
        else:
            np.testing.assert_allclose(run[key], golden[key], atol=tol,
                                       err_msg=key)


def max_weight_diff(run, golden):
    return max(float(np.max(np.abs(np.array(a) - np.array(b))))
               for a, b in zip(run["weights"], golden["weights"]))


UNEVEN_WARNING = ("tfmulti: Keras `fit` weights each of the {n} replicas' "
                  "mean loss by 1/{n} whatever its share of the global "
                  "batch")


# -- user code: the Keras guides and the TensorFlow tutorial ---------------

@pytest.mark.slow
def test_tf_custom_training_tutorial(local):
    cases = local["tf_custom_training_tutorial"]
    golden = ok(cases["one"])
    # It trained (the tutorial's model builds in its first step, so its
    # initial weights are not kept: the loss fell instead).
    assert golden["logs"][-1][0] < golden["logs"][0][0]
    assert_close(ok(cases["m4"]), golden, check_trained=False)


@pytest.mark.slow
def test_keras_guide_multi_gpu(local):
    cases = local["keras_guide_multi_gpu"]
    assert_close(ok(cases["m4"]), ok(cases["one"]))


@pytest.mark.slow
@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_keras_guide_customizing_fit(local, number):
    cases = local["keras_guide_custom_fit"]
    golden = ok(cases["one"][f"model{number}"])
    node = cases["m4"][f"model{number}"]
    run = ok(node)
    assert_close(run, golden, keys=("weights",))
    key = "history" if number < 4 else "eval"
    if number == 4:
        # "Providing your own evaluation step": its `test_step` logs
        # `self.compute_loss(...)`, which tfmulti's strategies and
        # `distributed` leave unscaled in a test step, so `evaluate` equals
        # one device, plain and through `distributed`, without a warning.
        for run in (node, cases["m4"]["model4_distributed"]):
            assert_close(ok(run), golden, keys=("eval",))
            assert not run["warnings"], run["warnings"]
        return
    for name in golden[key]:
        if name == "loss":
            # The guide logs `self.compute_loss(...)` / `self.loss_fn(...)`,
            # which Keras scales by 1/replicas under a strategy: the logged
            # loss is golden / 4, and tfmulti says so once with the fix.
            np.testing.assert_allclose(np.array(run[key][name]) * 4,
                                       golden[key][name], rtol=1e-5)
        else:
            np.testing.assert_allclose(run[key][name], golden[key][name],
                                       atol=TOLERANCE, err_msg=name)
    assert any(w.startswith(f"tfmulti: GuideModel{number} overrides `")
               and "Log `loss * self.distribute_strategy."
               "num_replicas_in_sync`." in w for w in node["warnings"])


@pytest.mark.slow
def test_tf_save_and_load_with_a_strategy(local):
    # Trained on 4 replicas, saved (`.keras`, tf.saved_model.save, export),
    # loaded without a strategy, under one_device and under 4 replicas
    # (2 more epochs each), and served on one device and with
    # `strategy.run` over 4: each = the same pipeline trained on one device.
    cases = local["tf_save_and_load"]
    golden, run = ok(cases["one"]), ok(cases["m4"])
    assert_close(run, golden, keys=("weights",))
    # 4 more Adam epochs after a reload carry the 6e-7 difference of the
    # weights to 5.5e-6 (measured): 3e-5.
    for key in ("restored_none", "restored_one", "restored_m4"):
        for a, b in zip(run[key], golden[key]):
            np.testing.assert_allclose(a, b, atol=3e-5, err_msg=key)
    for key in ("predict", "saved_model_served", "saved_model_served_m4",
                "export_served", "export_served_m4"):
        np.testing.assert_allclose(run[key], golden["predict"],
                                   atol=TOLERANCE, err_msg=key)


# -- silent differences -----------------------------------------------------

@pytest.mark.slow
def test_uneven_last_batch_distributed_fit_equals_one_device(local):
    cases = local["uneven_fit"]
    golden = ok(cases["one"]["plain"])
    assert_close(ok(cases["m4"]["distributed"]), golden)
    assert not cases["m4"]["distributed"]["warnings"]


@pytest.mark.slow
def test_uneven_last_batch_plain_fit_warns_once(local):
    cases = local["uneven_fit"]
    plain = cases["m4"]["plain"]
    # Keras's own step still weights replicas 1/N (the guard: fails once
    # Keras weights by share, then drop the warning).
    assert max_weight_diff(ok(plain), ok(cases["one"]["plain"])) > 1e-3
    assert len(plain["warnings"]) == 1
    assert plain["warnings"][0].startswith(UNEVEN_WARNING.format(n=4))
    assert "tfmulti.keras.distributed(model)" in plain["warnings"][0]


@pytest.mark.slow
def test_uneven_last_batch_trainer_equals_one_device(local):
    cases = local["trainer_uneven"]
    assert_close(ok(cases["m4"]), ok(cases["one"]))


@pytest.mark.slow
def test_indivisible_global_batch(local):
    cases = local["indivisible_batch"]
    golden = ok(cases["one"]["plain"])
    assert_close(ok(cases["m3"]["distributed"]), golden)
    plain = cases["m3"]["plain"]
    ok(plain)
    # tf.data's rebatching leaves the per-replica size unknown statically.
    assert plain["warnings"][0].startswith(UNEVEN_WARNING.format(n=3))
    assert "a global batch divisible by 3" in plain["warnings"][0]


@pytest.mark.slow
@pytest.mark.parametrize("model, key, names", [
    # A custom test_step's own logs are what evaluate returns.
    ("OwnTestStep", "eval", {"own_loss", "scaled"}),
    # Extra keys of a compute_metrics override reach the history.
    ("ExtraMetrics", "history", {"accuracy", "loss", "mean_logit"}),
])
def test_custom_logs_are_honoured(local, model, key, names):
    # On 3 replicas (batch 32 split 11/11/10): each replica's logs count by
    # its share.
    cases = local["keras_overrides"]
    golden = ok(cases["one"][model])
    assert set(golden[key]) == names
    assert_close(ok(cases["m3"][model]), golden)


@pytest.mark.slow
def test_pre_keras_3_3_compute_loss_signature(local):
    cases = local["keras_overrides"]
    assert_close(ok(cases["m4"]["OldComputeLoss"]),
                 ok(cases["one"]["OldComputeLoss"]))
    # On 3 replicas the batch of 32 splits 11/11/10: a compute_loss
    # override cannot be weighted by share, which distributed says once.
    uneven = cases["m3"]["OldComputeLoss"]
    assert any("it overrides `compute_loss`" in w for w in uneven["warnings"])


@pytest.mark.slow
def test_instance_train_step_is_refused(local):
    text = error_of(local["keras_overrides"]["instance_train_step"])
    assert text.startswith("ValueError: `model.train_step` of '")
    assert text.endswith(
        "' was replaced on the instance, which tfmulti.keras.distributed "
        "would silently bypass with tfmulti's step. Override `compute_loss` "
        "/ `compute_metrics` instead, or use tfmulti.Trainer.")


@pytest.mark.slow
def test_batchnorm_moving_statistics_agree_across_replicas(local):
    # Keras alone keeps one copy per replica (0.037 apart after this epoch;
    # guard: test_compat.py batchnorm_statistics_per_replica). Plain fit
    # under a tfmulti strategy averages them every step, `distributed` once
    # per loop: either way the copies agree, and what evaluation during
    # training reports is what the saved weights give on one device.
    cases = local["batchnorm_statistics"]
    for how in ("plain", "distributed"):
        run = ok(cases[how])
        assert run["moved"] > 1e-3, how
        assert run["replica_spread"] < 1e-6, how
        for name in run["eval"]:
            np.testing.assert_allclose(run["eval"][name],
                                       run["eval_saved"][name],
                                       atol=TOLERANCE, err_msg=f"{how} {name}")


# -- crashes -----------------------------------------------------------------

@pytest.mark.slow
def test_plain_fit_steps_per_execution(local):
    cases = local["steps_per_execution"]
    assert_close(ok(cases["m4"]), ok(cases["one"]))


# -- upstream reports ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain", "distributed"])
def test_k21069_embedding_sparse_gradients(local, how):
    cases = local["k21069_embedding"]
    assert_close(ok(cases["m4"][how]), ok(cases["one"]["plain"]))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain", "distributed"])
def test_k19891_results_do_not_change_with_replica_count(local, how):
    cases = local["k19891_replica_count"]
    golden, run = ok(cases["one"]["plain"]), ok(cases["m4"][how])
    for key in ("ground_truth", "evaluate", "post_fit"):
        np.testing.assert_allclose(run[key], golden[key], atol=TOLERANCE,
                                   err_msg=key)
    assert_close(run, golden)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain", "distributed"])
def test_k20611_dropout_model_under_mirrored(local, how):
    cases = local["k20611_dropout"]
    golden, run = ok(cases["one"]["plain"]), ok(cases["m4"][how])
    # Inference (no dropout) equals one device exactly as computed.
    np.testing.assert_allclose(run["predict"], golden["predict"],
                               atol=TOLERANCE)
    np.testing.assert_allclose(run["evaluate"], golden["evaluate"],
                               atol=TOLERANCE)
    # Training draws dropout masks per replica: it must learn as one device
    # does (the loss falls by a like amount), not bitwise.
    for losses in (golden["fit_loss"], run["fit_loss"]):
        assert losses[-1] < 0.97 * losses[0], losses
    assert abs(run["fit_loss"][-1] - golden["fit_loss"][-1]) < 0.05 * (
        golden["fit_loss"][-1]), (run["fit_loss"], golden["fit_loss"])


@pytest.mark.slow
def test_k21366_mixed_precision_jit_compile(local):
    cases = local["k21366_mixed_precision_jit"]
    # float16 activations: sums in another order round differently (1e-5
    # measured), hence 1e-4.
    assert_close(ok(cases["m4"]["distributed"]), ok(cases["one"]["plain"]),
                 tol=1e-4)
    assert error_of(cases["m4"]["plain"]).startswith(
        "ValueError: `jit_compile`=True on ")
    assert "Compile with jit_compile=False, or call tfmulti.keras." \
        "distributed(model) after compile." in error_of(cases["m4"]["plain"])


@pytest.mark.slow
def test_distributed_evaluate_on_exact_once_data(local):
    # Padded exact-once data (1000 rows + 8 of weight 0) against the user's
    # one-device `evaluate` on the 1000 rows: `distributed` on 1 and 4
    # replicas gives its loss, accuracy and count, every run. Plain Keras
    # `evaluate` on 4 replicas counts the 8 weight-0 rows in the loss's
    # denominator (its loss is 1000/1008 of the true one) and gets the
    # weighted accuracy right; it counted 1029-1092 rows, a different loss
    # each run, before `compat.set_global_steps`.
    cases = local["evaluate_exact_once"]
    golden = ok(cases["one"]["plain"])[0]
    assert golden["count"] == 1000
    for layout in ("one", "m4"):
        for run in ok(cases[layout]["distributed"]):
            for key in golden:
                np.testing.assert_allclose(run[key], golden[key],
                                           atol=TOLERANCE, err_msg=key)
    for run in ok(cases["m4"]["plain"]):
        assert run["count"] == 1008
        np.testing.assert_allclose(run["accuracy"], golden["accuracy"],
                                   atol=TOLERANCE)
        np.testing.assert_allclose(run["loss"], golden["loss"] * 1000 / 1008,
                                   atol=TOLERANCE)


@pytest.mark.slow
def test_tf72686_optimizer_built_by_first_apply_gradients(local):
    cases = local["tf72686_lazy_optimizer"]
    golden = ok(cases["one"])
    run = ok(cases["m4"])
    np.testing.assert_allclose(run["losses"], golden["losses"],
                               atol=TOLERANCE)
    assert_close(run, golden)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain", "distributed"])
def test_multi_worker_dict_inputs(local, multi_worker, how):
    """k#20329, tf#72388, k#20585 on two real workers."""
    golden = ok(local["dict_inputs"][how])
    for worker in multi_worker:
        assert_close(ok(worker[how]), golden)


def test_keras_guide_gan(local):
    """The guide's GAN: under tfmulti's one_device as without a strategy;
    on 4 replicas equal in distribution (each replica draws its own latents
    and label noise, so not bitwise): the logged losses, which the guide
    takes from a Keras loss and so read 1/4 (warned once, with the fix),
    times 4 within 2% of one device's."""
    none = ok(local["keras_guide_gan"]["none"])
    one = ok(local["keras_guide_gan"]["one"])
    four = local["keras_guide_gan"]["m4"]
    for key, values in none["history"].items():
        # one_device places and fuses ops differently from no strategy:
        # measured 5e-5 apart.
        np.testing.assert_allclose(one["history"][key], values, rtol=5e-4)
        np.testing.assert_allclose(np.array(ok(four)["history"][key]) * 4,
                                   values, rtol=0.02, err_msg=key)
    latents = np.array(ok(four)["latents"])
    assert len({row.tobytes() for row in latents}) == 4, (
        "replicas drew the same latents")
    assert any("Log `loss * self.distribute_strategy.num_replicas_in_sync`"
               in w for w in four["warnings"]), four["warnings"]


CTL_RESTART_ERROR = "ZeroDivisionError: float division by zero"


def _assert_ctl_tutorial(run, golden, files):
    # As written, the restart fails on one device and on N alike.
    assert golden["restart_error"] == run["restart_error"] == CTL_RESTART_ERROR
    assert run["restored"] and golden["restored"], "the restart did not restore"
    assert len(run["printed"]) == 3, run["printed"]
    # RMSprop divides by the root of its running mean square, which magnifies
    # the last-bit differences of a gradient summed over replicas where it
    # is near 0: measured 4.2e-5 on 4 replicas, 7.3e-5 on 2 workers, and
    # 1.9e-4 on 2 workers in a suite run at load 4 (2 of 288 values of one
    # conv output channel; the CPU kernels' sums are not bitwise the same
    # from run to run). The weights moved 0.024, 48x the weights' bound; the
    # printed losses agree to 1e-6 and are held to 1e-5.
    assert_close(run, golden, keys=("losses",), tol=1e-5)
    assert_close(run, golden, keys=("weights",), tol=5e-4)
    # One checkpoint (max_to_keep=1), the chief's; every `workertemp_<id>`
    # the tutorial's non-chief wrote is gone.
    assert not [f for f in files if "workertemp" in f], files
    assert len([f for f in files if f.endswith(".index")]) == 1, files


def test_tf_ctl_tutorial_on_four_replicas(local):
    """TF "Custom training loop with Keras and MultiWorkerMirroredStrategy"
    (tutorial_ctl.py), two epochs, a restart from the checkpoint, a third."""
    golden = ok(local["ctl_tutorial"]["one"])
    run = ok(local["ctl_tutorial"]["m4"])
    _assert_ctl_tutorial(run, golden, run["files"])


@pytest.mark.slow
def test_tf_ctl_tutorial_on_two_workers(local, multi_worker):
    golden = ok(local["ctl_tutorial"]["one"])
    for worker in multi_worker:
        _assert_ctl_tutorial(ok(worker["ctl_tutorial"]), golden,
                             worker["ctl_files"])


def _joined(steps):
    """Each step's replicas' values, concatenated (what one device sees)."""
    return [[v for replica in step for v in replica] for step in steps]


def test_tf_distributed_input_tutorial(local):
    """TF "Distributed input" (tutorial_input.py): every cell on 2 replicas
    shows what the tutorial says, and carries one device's data."""
    one = ok(local["input_tutorial"]["one"])
    two = ok(local["input_tutorial"]["m2"])
    three = ok(local["input_tutorial"]["m3"])
    # "Batching", the tutorial's examples, word for word.
    assert two["range6_batch4"] == [[[0, 1], [2, 3]], [[4], [5]]]
    assert three["range8_batch4"] == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]
    assert _joined(two["range6_batch4"]) == _joined(one["range6_batch4"])
    assert two["first_batch"] == [8, 8] and one["first_batch"] == [16]
    # The tutorial's dataset_fn batches twice (16, then the per-replica
    # 8): 4 rows of 16 go to the first replica, an empty batch to the other.
    assert two["from_function_shapes"] == [[[4, 16, 1], [0, 0, 1]]]
    assert one["from_function_shapes"] == [[[4, 16, 1]]]
    for cell in ("for_loop", "explicit_iterator"):
        assert _joined(two[cell]) == _joined(one[cell]), cell
        assert len(two[cell]) == len(one[cell]) == {"for_loop": 7}.get(cell, 50)
    # The host loop with get_next_as_optional stops at the end of data.
    assert two["get_next_as_optional"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]],
                                           [[8], []]]
    assert _joined(two["get_next_as_optional"]) == _joined(
        one["get_next_as_optional"])
    # input_signature from element_spec: one trace for 25 steps.
    assert two["element_spec"]["traces"] == 1
    assert _joined(two["element_spec"]["outputs"]) == _joined(
        one["element_spec"]["outputs"])
    # A StringLookup made under the scope, applied in the dataset function.
    assert _joined(two["preprocessing"]) == _joined(one["preprocessing"]) == [
        [1, 3, 0, 1], [3, 0, 1, 3], [0, 1, 3, 0]]
    assert two["values_from_function"] == [0.0, 2.0]


@pytest.mark.slow
def test_tf_distributed_input_sharding_on_two_workers(multi_worker):
    """The tutorial's AutoShardPolicy examples, on two real workers."""
    expected = {
        # The tutorial's prose has [0, 1], [2, 3], [4], [5] (4 steps) for
        # worker 0; TF 2.21 rebatches each worker's [4, 5] whole, in 3 steps,
        # with stock MultiWorkerMirroredStrategy too (measured, BUILD_NOTES).
        "FILE": [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]],
        "DATA": [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]],
        "OFF": [[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]] * 2,
    }
    for index, worker in enumerate(multi_worker):
        got = ok(worker["input_sharding"])
        for policy, per_worker in expected.items():
            assert got[policy] == per_worker[index], (policy, index, got)


# -- guards of the conformance workarounds in tfmulti.compat ------------------
# Each asserts the stock TensorFlow / Keras behaviour still fails, so it
# fails once an upstream release fixes it (then delete the workaround and
# its guard). In this file so the one `local` run serves every test of a
# pytest-xdist worker (files are its unit).

@pytest.mark.slow
def test_stock_mirrored_tutorial_still_fails(local):
    # compat.bind_collective_keys_at_trace_time
    text = error_of(local["guards"]["lazy_optimizer"])
    assert "You must feed a value for placeholder tensor" in text


@pytest.mark.slow
def test_stock_guide_test_step_loss_still_scaled(local):
    # compat.unscaled_keras_losses: the guide's `test_step` on a stock
    # MirroredStrategy of 4 reports 1/4 of one device's loss.
    stock = ok(local["guards"]["guide_test_step"])
    # One device's run of the same guide model (its own conformance row).
    golden = ok(local["keras_guide_custom_fit"]["one"]["model4"])["eval"]
    np.testing.assert_allclose(stock["loss"] * 4, golden["loss"], rtol=1e-5)
    np.testing.assert_allclose(stock["mae"], golden["mae"], atol=TOLERANCE)


@pytest.mark.slow
def test_keras_still_reduces_the_first_batch(local):
    # compat.KerasMirroredStrategy.reduce
    text = error_of(local["guards"]["first_batch_build"])
    assert "must have the same size and shape" in text
