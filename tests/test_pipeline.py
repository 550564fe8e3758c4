"""tfmulti.pipeline: a model split into stages over devices trains as one
device does.

The golden cases run in one subprocess with 8 simulated CPU devices (S=2 and
S=4 stages, M=1 and M=4 micro-batches, D=1 and D=2 data-parallel groups,
GPipe and 1F1B, a Sequential and a carried skip connection; and
`tfmulti.Trainer` and Keras fit through `tfmulti.keras.distributed` each
driving S=2, M=2, D=1 and 2, resumed too); a second, one-device process
restores the pipelined checkpoints (the weights file, and the Trainer's and
Keras fit's checkpoints with their optimizer state). Errors and schedules
are checked here, in process.
"""

import json

import keras
import numpy as np
import pytest

from tests.subproc import run_python
from tfmulti import pipeline
from tfmulti.pipeline import schedule

TOLERANCE = 1e-5
CASES = ["2:1:1", "2:4:1", "4:1:1", "4:4:1", "2:1:2", "2:4:2",
         "2:2:1:gpipe:residual", "4:4:1:1f1b:seq", "4:4:2"]


@pytest.mark.slow
def test_stages_match_one_device_and_checkpoint_interchanges(tmp_path):
    out = tmp_path / "golden.json"
    run_python(["tests/workers/pipeline_golden.py", str(out),
                ",".join(CASES), str(tmp_path)], timeout=420)
    results = json.loads(out.read_text())
    interchange = results.pop()
    assert [r["case"] for r in results] == CASES
    for r in results:
        print(r["case"], "cuts", r["cuts"], "loss diff", r["loss_diff"],
              "weight diff", r["weight_diff"], "bytes/device",
              r["bytes_per_device"])
        assert r["weight_diff"] < TOLERANCE, r
        assert r["loss_diff"] < TOLERANCE, r
        assert r["group_diff"] == 0.0, r
        assert r["placement_ok"], r
        S, _, D = (int(p) for p in r["case"].split(":")[:3])
        # Each device holds one stage: its bytes are that stage's, in every
        # group, and the stages add up to the model.
        by_device = r["bytes_per_device"]
        assert len(by_device) == S * D, r
        assert sorted(by_device.values()) == sorted(r["stage_bytes"] * D)
        assert sum(r["stage_bytes"]) == r["total_bytes"]
        assert r["optimizer_bytes_per_device"] == by_device
        if len(r["case"].split(":")) < 5:  # balanced by parameter count
            assert max(r["stage_bytes"]) <= (r["total_bytes"] / S +
                                             r["largest_layer_bytes"]), r
    assert interchange["single_to_pipelined_diff"] < TOLERANCE
    assert interchange["loaded_group_diff"] == 0.0
    # tfmulti.Trainer over a PipelinedModel (S=2, M=2, D=1 and 2): one
    # device's losses and weights, with metrics and evaluation; a run
    # resumed from its checkpoint by a new Trainer equals the uninterrupted
    # one.
    trainer = interchange["trainer"]
    assert sorted(trainer) == ["2:2:1", "2:2:2"]
    for case, r in trainer.items():
        print("Trainer", case, r)
        assert r["weight_diff"] < TOLERANCE, r
        assert r["loss_diff"] < TOLERANCE, r
        assert r["steps"] == 3 and r["optimizer_layout"] == "unsplit", r
        assert r["val_loss_diff"] < TOLERANCE, r  # evaluated stage by stage
        assert 0 <= r["train_accuracy"] <= 1, r
    assert trainer["2:2:2"]["resume_weight_diff"] < 1e-6
    assert trainer["2:2:2"]["resume_loss_diff"] < 1e-6
    # Keras fit through tfmulti.keras.distributed(pipe) (S=2, M=2, D=1 and
    # 2, steps_per_execution=2 over 3-step epochs, metrics, validation
    # data, a backup):
    # plain one-device Keras fit's per-epoch losses, accuracy, weights,
    # evaluation and predictions.
    keras_fit = interchange["keras"]
    print(f"Keras fit part of the worker: {keras_fit['seconds']:.1f} s")
    for case in ("2:2:1", "2:2:2"):
        r = keras_fit[case]
        print("Keras fit", case, {k: v for k, v in r.items()
                                  if "diff" in k})
        assert r["steps"] == 6 and len(r["losses"]) == 2, r
        assert r["weight_diff"] < TOLERANCE, r
        assert r["loss_diff"] < TOLERANCE, r
        assert r["accuracy_diff"] < TOLERANCE, r
        assert r["val_loss_diff"] < TOLERANCE, r  # validation_data
        assert r["evaluate_diff"] < TOLERANCE, r  # stage by stage
        assert r["predict_diff"] < TOLERANCE, r
        assert r["group_diff"] == 0.0, r
    # Its backup, resumed by the Trainer over a new pipeline: nothing left
    # to train at step 6, same predictions and optimizer state; 3 more
    # steps equal plain Keras's third epoch.
    r = keras_fit["2:2:2"]
    assert r["trainer_steps_run"] == 0, r
    assert r["trainer_predict_diff"] < 1e-6, r
    assert r["trainer_optimizer_diff"] == 0.0, r
    assert r["trainer_next_epoch_weight_diff"] < TOLERANCE, r
    # The reverse: the Trainer's step-9 checkpoint resumed by Keras fit of
    # a new pipeline at epoch 3 of 3.
    assert r["from_trainer_epochs_run"] == 0, r
    assert r["from_trainer_step"] == 9, r
    assert r["from_trainer_weight_diff"] < TOLERANCE, r
    said = keras_fit["refusals"]
    assert sorted(said) == sorted([
        "class_weight", "jit_compile", "optimizer", "x", "drop_remainder",
        "micro_batches", "distributed_jit_compile", "inner_model"]), said
    assert said["class_weight"].startswith(
        "`class_weight`={0: 2.0} is not supported for a PipelinedModel "
        "trained with Keras `fit`"), said
    assert "Leave `class_weight` at None" in said["class_weight"]
    assert said["jit_compile"].startswith("`jit_compile`=True is not "
                                          "supported"), said
    assert "leave `optimizer` out of compile" in said["optimizer"], said
    assert said["x"].startswith("`x` is a ndarray") and (
        "drop_remainder=True" in said["x"]), said
    assert "no static size" in said["drop_remainder"] and (
        "drop_remainder=True" in said["drop_remainder"]), said
    assert said["micro_batches"].startswith(
        "`micro_batches`=2 does not divide the per-group batch of 3"), said
    assert "`jit_compile`=True" in said["distributed_jit_compile"], said
    assert "tfmulti.keras.distributed(pipe)" in said["inner_model"], said
    restored = tmp_path / "restored.json"
    run_python(["tests/workers/pipeline_restore.py", str(tmp_path),
                str(restored), keras_fit["backup_dir"]], timeout=180)
    restored = json.loads(restored.read_text())
    print(f"one-device Keras resume: {restored['keras_seconds']:.1f} s")
    assert restored["devices"] == ["CPU:0"]
    assert restored["pipelined_to_single_diff"] < TOLERANCE
    # A one-device Trainer resumes the pipelined Trainer's step-2 checkpoint
    # (model and SGD momentum slots in the unsplit format): it predicts as
    # the pipeline did, then step 3 reaches one device's 3-step weights.
    assert restored["trainer_final_step"] == 3
    assert restored["trainer_steps_run_after_restore"] == 0
    assert restored["trainer_checkpoint_prediction_diff"] < TOLERANCE
    assert restored["trainer_resumed_weight_diff"] < TOLERANCE
    # One-device Keras fit resumes the pipelined Keras backup (epoch 2):
    # same predictions, and epoch 3 reaches plain Keras's weights.
    assert restored["keras_epochs_run_after_restore"] == 0
    assert restored["keras_checkpoint_prediction_diff"] < 1e-6
    assert restored["keras_resumed_weight_diff"] < TOLERANCE
    assert restored["keras_final_step"] == 9


def _chain(name="chain", batch_norm=False):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="a")(inputs)
    if batch_norm:
        x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dense(8, name="b")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="c")(x), name=name)


def _residual():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="a")(inputs)
    y = keras.layers.Dense(8, name="b")(x)
    y = keras.layers.Dense(8, name="c")(y)
    return keras.Model(inputs, keras.layers.Add(name="add")([x, y]))


def _pipe(model, **kwargs):
    return pipeline.PipelinedModel(
        model, optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.MeanSquaredError(reduction=None), verbose=False,
        devices=kwargs.pop("devices", ["/device:CPU:0"] * 4), **kwargs)


def test_unknown_cut_names_the_layer_and_lists_the_layers():
    with pytest.raises(ValueError, match=r"`cuts` names layer 'nope'.*"
                       r"\['a', 'b', 'c'\]"):
        _pipe(_chain(), num_stages=2, cuts=["nope"])


def test_cut_count_must_match_stages():
    with pytest.raises(ValueError, match=r"`cuts`=\['a'\] gives 2 stages but "
                       r"`num_stages`=3"):
        _pipe(_chain(), num_stages=3, cuts=["a"])


def test_skip_across_cut_names_the_layers_and_carry_allows_it():
    with pytest.raises(ValueError, match=r"not a chain: layer 'add' .*cut at "
                       r"'b'.* reads the output of 'a'.*carry_skips=True"):
        _pipe(_residual(), num_stages=2, cuts=["b"])
    pipe = _pipe(_residual(), num_stages=2, cuts=["b"], carry_skips=True)
    assert pipe.stages[0].carried == ("a",)
    # Balancing cuts only where no skip crosses: after `a` or `add`-less.
    assert pipeline.balanced_cuts(_residual(), 2) == ["a"]


def test_more_stages_than_devices_says_how_many():
    with pytest.raises(ValueError, match=r"`num_stages`=2 x `data_parallel`=2 "
                       r"needs 4 devices, but 2 are available.*"
                       r"simulate_devices\(4\)"):
        _pipe(_chain(), num_stages=2, data_parallel=2,
              devices=["/device:CPU:0"] * 2)


def test_micro_batches_must_divide_the_group_batch():
    pipe = _pipe(_chain(), num_stages=2, micro_batches=3, data_parallel=2)
    x, y = np.zeros((8, 6), "float32"), np.zeros((8, 2), "float32")
    with pytest.raises(ValueError, match=r"`micro_batches`=3 does not divide "
                       r"the per-group batch of 4 \(global batch 8 over "
                       r"`data_parallel`=2\).*divisible by 6"):
        pipe.train_step(x, y)


def test_batch_norm_with_micro_batches_says_the_fix():
    with pytest.raises(ValueError, match=r"'bn' is a BatchNormalization.*"
                       r"`micro_batches`=2.*LayerNormalization"):
        _pipe(_chain(batch_norm=True), num_stages=2, micro_batches=2)
    # One micro-batch in one group sees the whole batch: allowed.
    _pipe(_chain(batch_norm=True), num_stages=2, micro_batches=1)


def test_reducing_loss_is_refused():
    with pytest.raises(ValueError, match=r"reduction='sum_over_batch_size'"):
        pipeline.PipelinedModel(
            _chain(), optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.MeanSquaredError(), num_stages=2,
            devices=["/device:CPU:0"] * 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_run_every_action_once_in_dependency_order(name):
    S, M = 4, 8
    order = schedule.emission_order(name, S, M)
    assert sorted(order) == sorted(
        schedule.Action(k, s, m) for k in "FB" for s in range(S)
        for m in range(M))
    seen = set()
    for a in order:
        if a.kind == "F" and a.stage:
            assert ("F", a.stage - 1, a.micro_batch) in seen
        if a.kind == "B":
            assert ("F", a.stage, a.micro_batch) in seen
            if a.stage < S - 1:
                assert ("B", a.stage + 1, a.micro_batch) in seen
        seen.add(tuple(a))


def test_1f1b_bounds_live_micro_batches():
    S, M = 4, 8
    assert [schedule.peak_live_micro_batches("gpipe", S, M, s)
            for s in range(S)] == [8, 8, 8, 8]
    assert [schedule.peak_live_micro_batches("1f1b", S, M, s)
            for s in range(S)] == [4, 3, 2, 1]
    assert pipeline.theoretical_bubble(4, 8) == pytest.approx(3 / 11)


def test_recipe_flags_reach_the_config():
    from absl import flags as absl_flags

    from tfmulti import flags as tfmulti_flags
    flag_values = absl_flags.FlagValues()
    tfmulti_flags.define_flags(flag_values)
    flag_values(["recipe", "--pipeline_stages=4", "--micro_batches=8"])
    config = tfmulti_flags.experiment_config(flag_values)
    assert (config.pipeline_stages, config.micro_batches) == (4, 8)
    assert config.batchnorm
    flag_values(["recipe", "--nobatchnorm"])
    assert not tfmulti_flags.experiment_config(flag_values).batchnorm
    flag_values(["recipe", "--batchnorm=true", "--pipeline_stages=1",
                 "--sync_every=2", "--pipeline_stages=2"])
    with pytest.raises(ValueError, match=r"`sync_every`=2 is not supported "
                       r"with `pipeline_stages`=2"):
        tfmulti_flags.experiment_config(flag_values)
    flag_values(["recipe", "--sync_every=1", "--pipeline_stages=1"])
    flag_values(["recipe", "--pipeline_stages=1", "--micro_batches=8"])
    with pytest.raises(ValueError, match=r"`micro_batches`=8 needs "
                       r"`pipeline_stages` > 1"):
        tfmulti_flags.experiment_config(flag_values)
    flag_values(["recipe", "--pipeline_stages=2", "--micro_batches=1",
                 "--grad_accum_steps=2"])
    with pytest.raises(ValueError, match=r"`grad_accum_steps`=2 is not "
                       r"supported with `pipeline_stages`=2"):
        tfmulti_flags.experiment_config(flag_values)


def test_global_clipnorm_is_refused_with_the_alternative():
    with pytest.raises(ValueError, match=r"global_clipnorm=1.0.*clipnorm"):
        pipeline.PipelinedModel(
            _chain(), optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0),
            loss=keras.losses.MeanSquaredError(reduction=None),
            num_stages=2, devices=["/device:CPU:0"] * 2)


def test_trainer_refuses_options_the_pipeline_does_not_implement():
    import tfmulti
    pipe = _pipe(_chain(), num_stages=2)
    with pytest.raises(ValueError, match=r"`grad_accum_steps`=2 is not "
                       r"supported for a PipelinedModel.*micro_batches"):
        tfmulti.Trainer(pipe, grad_accum_steps=2)
    with pytest.raises(ValueError, match=r"`optimizer` was given to the "
                       r"Trainer.*PipelinedModel\(\.\.\.\)"):
        tfmulti.Trainer(pipe, keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"`clip_global_norm`=1.0 .*clipnorm"):
        tfmulti.Trainer(pipe, clip_global_norm=1.0)
    with pytest.raises(ValueError, match=r"`jit_compile`=True is not "
                       r"supported for a PipelinedModel"):
        tfmulti.Trainer(pipe, jit_compile=True)
    trainer = tfmulti.Trainer(pipe, optimizer=pipe.optimizers[0][0],
                              loss=pipe.loss)
    assert trainer.model is pipe.model


def test_keras_fit_takes_the_pipeline_not_the_model_inside():
    import tfmulti
    pipe = _pipe(_chain(), num_stages=2)
    with pytest.raises(ValueError, match=r"is the model inside a .*"
                       r"PipelinedModel.*tfmulti.keras.distributed\(pipe\)"):
        tfmulti.keras.distributed(pipe.model)
    with pytest.raises(ValueError, match=r"`sync`=.* is not supported for a "
                       r"PipelinedModel \(the pipeline sums"):
        tfmulti.keras.distributed(pipe, sync=tfmulti.LocalSGD(every=2))
    km = tfmulti.keras.distributed(pipe)
    assert km is pipe.model and km.optimizer is pipe.optimizers[0][0]


def test_keras_fit_recipe_refuses_pipeline_stages_and_names_custom_loop():
    from tfmulti import experiment
    config = experiment.ExperimentConfig(pipeline_stages=2, micro_batches=2)
    with pytest.raises(experiment.ConfigError, match=r"`pipeline_stages`=2 "
                       r"needs the Trainer loop.*recipes.custom_loop"):
        experiment.train_and_evaluate(config, loop="fit")


def test_recipe_refuses_a_pipeline_in_a_cluster_before_anything_runs(
        tmp_path, monkeypatch):
    """Under tfmulti-launch --workers 2 (TF_CONFIG) a pipeline would train
    one model per worker: refused with the fix, and no run directory."""
    import json
    from tfmulti import experiment
    config = experiment.ExperimentConfig(
        pipeline_stages=2, micro_batches=4,
        model_dir=str(tmp_path / "run"))
    for cluster, shape in (
            ({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker: 2"),
            ({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
              "ps": ["127.0.0.1:3"]}, "chief: 1, ps: 1, worker: 1")):
        monkeypatch.setenv("TF_CONFIG", json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": 0}}))
        with pytest.raises(experiment.ConfigError) as e:
            experiment.train_and_evaluate(config, loop="trainer")
        assert e.value.flag == "pipeline_stages"
        assert ("`pipeline_stages`=2 runs in one process" in str(e.value)
                and f"({shape};" in str(e.value) and "without "
                "tfmulti-launch" in str(e.value) and "--cpu_replicas=2 "
                "--pipeline_stages=2" in str(e.value))
        assert not (tmp_path / "run").exists()


def _trained_pipe(optimizer):
    pipe = pipeline.PipelinedModel(
        _chain(), optimizer=optimizer,
        loss=keras.losses.MeanSquaredError(reduction=None), verbose=False,
        num_stages=2, devices=["/device:CPU:0"] * 2)
    rng = np.random.default_rng(1)
    for _ in range(2):
        pipe.train_step(rng.normal(size=(4, 6)).astype("float32"),
                        rng.normal(size=(4, 2)).astype("float32"))
    return pipe


def test_stage_optimizers_restore_into_the_unsplit_optimizer(tmp_path):
    import tensorflow as tf
    pipe = _trained_pipe(keras.optimizers.Adam(0.01))
    view, layout = pipe.checkpoint_optimizer()
    assert layout == "unsplit"
    path = tf.train.Checkpoint(model=pipe.model, optimizer=view).write(
        str(tmp_path / "ckpt"))
    model = _chain()
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        path).assert_existing_objects_matched()
    assert int(optimizer.iterations) == 2
    for v, restored in zip(pipe.model.trainable_variables,
                           model.trainable_variables):
        stage = next(s for s, vs in enumerate(pipe._trainable[0])
                     if any(v is w for w in vs))
        opt = pipe.optimizers[0][stage]
        i, j = opt._get_variable_index(v), optimizer._get_variable_index(
            restored)
        for a, b in ((opt._momentums[i], optimizer._momentums[j]),
                     (opt._velocities[i], optimizer._velocities[j])):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert float(np.max(np.abs(opt._velocities[i].numpy()))) > 0


class ExtraStateSGD(keras.optimizers.SGD):
    """Keeps one more variable than its slots: no unsplit layout."""

    def build(self, variables):
        super().build(variables)
        self.extra = self.add_variable((), name="extra")


def test_unmappable_optimizer_state_is_saved_per_stage(tmp_path):
    import tensorflow as tf
    pipe = _trained_pipe(ExtraStateSGD(0.1, momentum=0.9))
    view, layout = pipe.checkpoint_optimizer()
    assert layout == "per_stage"
    path = tf.train.Checkpoint(optimizer=view).write(str(tmp_path / "c"))
    saved = [v.numpy() for v in view.variables]
    for v in view.variables:
        v.assign(v.value * 0 + 5)
    tf.train.Checkpoint(optimizer=view).read(
        path).assert_existing_objects_matched()
    for a, b in zip(saved, view.variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_pipeline_recipe_is_the_same_run_as_one_device(tmp_path,
                                                       shapes_data_dir):
    """`pipeline_stages=2, micro_batches=4` through `train_and_evaluate`
    prints the same progress lines and summary as a one-device run, says
    and records that BatchNorm is left out, and with `batchnorm=False` the
    one-device run of the same steps ends with equal weights, Adam slots,
    losses and evaluation."""
    out = tmp_path / "out.json"
    _, log = run_python(["tests/workers/pipeline_recipe.py", str(out),
                         shapes_data_dir, str(tmp_path)], timeout=420)
    r = json.loads(out.read_text())
    print(log[-3000:])
    assert r["same_keys"] and r["num_tensors"] > 20, r
    assert r["tensor_diff"] < TOLERANCE, r
    single, piped = r["single"], r["pipeline"]
    for part in ("train", "eval"):
        for name, value in single[part].items():
            assert abs(piped[part][name] - value) < TOLERANCE, (part, name)
    assert piped["pipeline"]["stages"] == 2
    assert piped["pipeline"]["micro_batches"] == 4
    assert piped["num_replicas"] == 1 and piped["steps"] == 4
    config = json.loads((tmp_path / "pipeline" / "config.json").read_text())
    assert config["pipeline"]["batchnorm"] is False
    assert "without BatchNormalization" in config["pipeline"]["model_changed"]
    # The same run: progress lines with epoch and ETA, and the summary.
    single_log, piped_log = log.split("=== pipeline ===")
    assert "model: the example CNN without BatchNormalization" in piped_log
    assert "without BatchNormalization" not in single_log
    for text in (single_log, piped_log):
        assert "step 4/4 (epoch 1/1)" in text and "ETA" in text
        assert "done: 4 steps" in text and "metrics:" in text
