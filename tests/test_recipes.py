"""The recipes end to end: one_device, 2 simulated replicas, 2 workers.

Each run trains a few steps on the offline dataset and must leave
checkpoints, TensorBoard events and a complete metrics.json in --model_dir,
print no warning that tfmulti's own use of Keras/TensorFlow causes, and end
with a summary naming its outputs. Run directories: a default under ./runs,
a used one refused without --resume, a finished one "nothing to train".
"""

import glob
import json
import os
import pathlib
import re
import subprocess
import sys

from absl import flags as absl_flags
import pytest

from tests.subproc import run_python
from tfmulti import experiment
from tfmulti import flags as tfmulti_flags
from tfmulti import rundir

# Warnings Keras/TensorFlow printed because of how tfmulti used them
# (issue 18); none may appear in a run's output.
CAUSED_WARNINGS = (
    "Your input ran out of data",
    "did not fully read the dataset being cached",
    "`shuffle=True` was passed",
    "eagerly has significant overhead",
    "Local rendezvous is aborting",
)

RECIPES = {"recipes.custom_loop": "trainer", "recipes.keras_fit": "fit"}
METRICS_FIELDS = {"loop", "train", "eval", "steps", "examples_per_sec",
                  "num_replicas", "config", "versions"}


def _flags(model_dir, data_dir, *extra):
    return [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            "--global_batch_size=32", "--steps=4", "--steps_per_loop=2",
            *extra]


def _check_run(model_dir, recipe, num_replicas, *, local_replicas=None):
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert METRICS_FIELDS <= set(metrics)
    assert metrics["loop"] == RECIPES[recipe]
    assert metrics["num_replicas"] == num_replicas
    assert metrics["steps"] == 4
    assert metrics["examples_per_sec"] > 0
    assert 0.0 <= metrics["eval"]["accuracy"] <= 1.0
    assert {"tensorflow", "keras", "tfmulti"} <= set(metrics["versions"])
    assert metrics["config"]["global_batch_size"] == 32
    # One entry per device of the chief's replicas (one device: the CPU).
    assert len(metrics["optimizer_state_bytes_per_device"]) == (
        local_replicas or num_replicas)
    files = [os.path.join(d, f) for d, _, fs in os.walk(model_dir)
             for f in fs]
    assert any("tfevents" in f for f in files), files
    assert any(f.endswith(".index") or f.endswith(".keras") for f in files)
    return metrics


# keras_fit on one_device runs in test_default_run_dir_and_used_dirs.
@pytest.mark.parametrize("recipe, strategy, extra, replicas", [
    ("recipes.custom_loop", "one_device", [], 1),
    ("recipes.custom_loop", "mirrored", ["--cpu_replicas=2"], 2),
    ("recipes.keras_fit", "mirrored", ["--cpu_replicas=2"], 2),
])
def test_recipe_runs_end_to_end(recipe, strategy, extra, replicas, tmp_path,
                                shapes_data_dir):
    _, out = run_python(["-m", recipe, f"--strategy={strategy}",
                         *_flags(tmp_path / "run", shapes_data_dir, *extra)],
                        timeout=300)
    _check_run(tmp_path / "run", recipe, replicas)
    _check_output(out, tmp_path / "run")


@pytest.mark.parametrize("recipe", RECIPES)
def test_shard_optimizer_state_flag(recipe, tmp_path, shapes_data_dir):
    # 2 simulated replicas, Adam's state sharded: each device holds half of
    # the slots (plus the step and rate scalars), the host the unsharded
    # checkpoint form; both read from where the variables live.
    _, out = run_python(["-m", recipe, "--strategy=mirrored",
                         "--shard_optimizer_state",
                         *_flags(tmp_path / "run", shapes_data_dir,
                                 "--cpu_replicas=2")], timeout=300)
    metrics = _check_run(tmp_path / "run", recipe, 2)
    assert metrics["config"]["shard_optimizer_state"] == 1
    per_device = metrics["optimizer_state_bytes_per_device"]
    host = metrics["optimizer_state_bytes_host"]
    assert len(per_device) == 2 and host > 10_000
    for used in per_device.values():
        # Half of the slots, padded by at most one element per slot kind,
        # and two copies (the shard's and the model optimizer's) of the
        # int64 step and float32 rate.
        assert host / 2 < used <= host / 2 + 2 * 4 + 2 * 12
    _check_output(out, tmp_path / "run")


def test_shard_optimizer_state_conflicts_are_usage_errors():
    with pytest.raises(experiment.ConfigError, match=re.escape(
            "`shard_optimizer_state`=1 cannot run with "
            "--compression=powersgd")) as caught:
        _parse("--shard_optimizer_state", "--compression=powersgd")
    assert caught.value.flag == "compression"
    with pytest.raises(experiment.ConfigError, match="--strategy=one_device"):
        _parse("--shard_optimizer_state", "--strategy=one_device")


def _check_output(out, model_dir, chief=""):
    for warning in CAUSED_WARNINGS:
        assert warning not in out, out
    # tfmulti's and TensorFlow's info logs only with --verbosity=0.
    assert "tfmulti: global batch" not in out, out
    chief = re.escape(chief)
    # None of TensorFlow's start-up lines (tfmulti.quiet_logging; under
    # tfmulti-launch, its relay too), whatever TF_CPP_MIN_LOG_LEVEL says.
    assert not re.search(r"^(\[w\d\] )?(I0000 |WARNING: All log messages)",
                         out, re.M), out
    assert "cuInit" not in out and "GeneratorDatasetOp" not in out, out
    assert re.search(rf"^{chief}step 4/4 .* - loss \d.* examples/s - ETA ",
                     out, re.M), out
    assert re.search(rf"^{chief}done: 4 steps on \d replica", out, re.M), out
    assert f"metrics:     {model_dir / 'metrics.json'}" in out, out
    assert f"tensorboard --logdir {model_dir}" in out, out


def test_default_run_dir_and_used_dirs(tmp_path, shapes_data_dir):
    """A new ./runs/<recipe>-<time> by default; a used one needs --resume;
    a finished one is "nothing to train"; `import tfmulti` works there."""
    recipe = ["-m", "recipes.keras_fit", "--strategy=one_device",
              f"--data_dir={shapes_data_dir}", "--global_batch_size=32",
              "--steps=4", "--steps_per_loop=2"]
    _, out = run_python(recipe, cwd=tmp_path, timeout=300)
    (run,) = glob.glob(str(tmp_path / "runs" / "keras_fit-*"))
    assert f"run directory: {os.path.relpath(run, tmp_path)}" in out, out
    assert os.path.exists(os.path.join(run, "config.json"))
    _check_output(out, pathlib.Path(os.path.relpath(run, tmp_path)))

    again = [*recipe, f"--model_dir={run}"]
    code, out = run_python(again, cwd=tmp_path, check=False, timeout=120)
    assert code == 1, out
    assert "holds a finished run" in out and "nothing to train" in out, out
    assert "--resume" in out and "Traceback" not in out, out
    # With --resume: "nothing to train", decided before TensorFlow starts
    # (the recipe prints it and exits 0).
    with pytest.raises(rundir.NothingToTrain, match="nothing to train"):
        experiment.train_and_evaluate(experiment.ExperimentConfig(
            model_dir=run, resume=True, global_batch_size=32, steps=4,
            steps_per_loop=2, strategy="one_device", data_dir=shapes_data_dir),
            loop="fit")

    # The run directory does not shadow the package: `python -c` puts the
    # working directory first on sys.path, before PYTHONPATH (this checkout,
    # set by conftest, so the check does not depend on which checkout pip
    # installed last).
    done = subprocess.run(
        [sys.executable, "-c",
         "import tfmulti; print(tfmulti.simulate_devices.__name__, "
         "tfmulti.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    name, _, where = done.stdout.strip().partition(" ")
    assert name == "simulate_devices", done.stderr[-2000:]
    root = pathlib.Path(__file__).resolve().parents[1]
    assert pathlib.Path(where).resolve().is_relative_to(root), where



@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_on_two_workers(recipe, tmp_path, shapes_data_dir):
    _, out = run_python(
        ["-m", "tfmulti.launch", "--workers", "2", "--timeout", "300", "--",
         sys.executable, "-m", recipe, "--strategy=multi_worker",
         *_flags(tmp_path / "run", shapes_data_dir)], timeout=360)
    assert "[w0]" in out and "[w1]" in out
    metrics = _check_run(tmp_path / "run", recipe, 2, local_replicas=1)
    assert metrics["config"]["strategy"] == "multi_worker"
    # Progress and the summary come from the chief only.
    _check_output(out, tmp_path / "run", chief="[w0] ")
    assert not re.search(r"^\[w1\] (step|done)", out, re.M), out


def _parse(*argv):
    flag_values = absl_flags.FlagValues()
    tfmulti_flags.define_flags(flag_values)
    flag_values(["recipe", *argv])
    return tfmulti_flags.experiment_config(flag_values)


def test_flagfile_sets_the_flags(tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("--strategy=mirrored\n--learning_rate=0.01\n"
                        "--allreduce_dtype=bfloat16\n--lr_scaling=none\n")
    config = _parse(f"--flagfile={flagfile}", "--steps=7")
    assert (config.strategy, config.learning_rate, config.steps) == (
        "mirrored", 0.01, 7)
    # "float32" and "none" are spelled out on the command line, None inside.
    assert (config.allreduce_dtype, config.lr_scaling) == ("bfloat16", None)


@pytest.mark.parametrize("args, message", [
    (["--strategy=horovod"],
     "value should be one of <auto|one_device|mirrored|multi_worker|parameter_server>"),
    (["--all_reduce=mpi"], "value should be one of"),
    (["--global_batch_size=0"], "0 is not a positive integer"),
    (["--pack_bytes=0"], "0 is not a positive integer"),
])
def test_bad_flag_values_say_what_is_allowed(args, message):
    with pytest.raises(absl_flags.Error, match=re.escape(message)):
        _parse(*args)


def test_startup_timeout_flag_reaches_the_config():
    assert _parse("--startup_timeout=30").startup_timeout == 30
    assert _parse().startup_timeout is None  # $TFMULTI_STARTUP_TIMEOUT, 600
    with pytest.raises(ValueError, match=re.escape(
            "`startup_timeout` should be positive seconds, got 0.0.")):
        _parse("--startup_timeout=0")


def test_shard_optimizer_state_takes_the_zero_stage():
    # Bare (as before stage 2) is stage 1; `=2` is stage 2.
    for argv, stage in ((), 0), (("--shard_optimizer_state",), 1), (
            ("--shard_optimizer_state=2",), 2), (
            ("--shard_optimizer_state=false",), 0), (
            ("--noshard_optimizer_state",), 0):
        assert _parse("--strategy=mirrored", *argv).shard_optimizer_state \
            == stage, argv
    with pytest.raises(absl_flags.IllegalFlagValueError, match=re.escape(
            "--shard_optimizer_state should be 0, 1, 2, true or false "
            "(the ZeRO stage")) as caught:
        _parse("--shard_optimizer_state=3")
    assert "got '3'" in str(caught.value)
    with pytest.raises(experiment.ConfigError,
                       match="`shard_optimizer_state`=2 cannot run with"):
        _parse("--shard_optimizer_state=2", "--strategy=one_device")


def test_stage_after_a_bare_shard_flag_is_a_usage_error(capsys):
    # absl would read it as stage 1 and a stray argument "2".
    with pytest.raises(SystemExit) as caught:
        tfmulti_flags._parse_flags(["recipe", "--shard_optimizer_state",
                                    "2"])
    assert caught.value.code == 1
    assert "write --shard_optimizer_state=2" in capsys.readouterr().err


def test_inconsistent_flags_are_a_usage_error():
    with pytest.raises(ValueError, match="`cpu_replicas`=2 and `num_gpus`=1"):
        _parse("--cpu_replicas=2", "--num_gpus=1")


def test_recipe_exits_with_a_usage_error_naming_the_numbers(tmp_path):
    code, out = run_python(["-m", "recipes.custom_loop", "--cpu_replicas=3",
                            "--strategy=mirrored", "--global_batch_size=32",
                            f"--model_dir={tmp_path}", "--steps=1"],
                           timeout=120, check=False)
    assert code == 1
    assert "`global_batch_size`" in out and "32" in out and "3" in out
    assert "Traceback" not in out and "Flags and wiring" not in out, out
    # One line naming the problem, then the flag's help.
    error = out[out.index("custom_loop: error:"):].strip().splitlines()
    assert len(error) == 2 and error[1].startswith("  --global_batch_size: "), out


def _usage_lines(out, program):
    return out[out.index(f"{program}: error:"):].strip().splitlines()


def test_help_lists_the_recipe_flags():
    _, out = run_python(["-m", "recipes.keras_fit", "--help"], timeout=120,
                        check=False)
    for flag in ("--strategy", "--cpu_replicas", "--model_dir",
                 "--[no]resume", "--verbosity: -1 (default)"):
        assert flag in out, out


def test_unknown_dataset_is_one_line_with_the_closest_names(tmp_path):
    code, out = run_python(["-m", "recipes.keras_fit", "--dataset=cifar_10",
                            f"--model_dir={tmp_path / 'run'}"],
                           timeout=120, check=False)
    assert code == 1, out
    lines = _usage_lines(out, "keras_fit")
    assert len(lines) < 5 and "closest: cifar10" in lines[0], out
    assert "`--dataset` is 'cifar_10'" in lines[0], out
    assert "Traceback" not in out and "mnist" not in out, out


def _config(**changes):
    return {"loop": "fit", "seed": 0, "learning_rate": 1e-3,
            "strategy": "mirrored", **changes}


def _write_run(path, finished):
    os.makedirs(path)
    (path / rundir.CONFIG_FILE).write_text(json.dumps({"config": _config()}))
    if finished:
        (path / rundir.METRICS_FILE).write_text("{}")


@pytest.mark.parametrize("finished", [False, True])
def test_a_used_run_dir_needs_resume(tmp_path, finished):
    _write_run(tmp_path / "run", finished)
    keys = ("loop", "seed", "learning_rate")
    with pytest.raises(rundir.RunDirError, match="Pass --resume") as e:
        rundir.open_run_dir(str(tmp_path / "run"), config=_config(),
                            resume=False, compared=keys)
    assert ("nothing to train" in str(e.value)) == finished
    # The strategy may change on resume; what is trained may not.
    opened = lambda **c: rundir.open_run_dir(  # noqa: E731
        str(tmp_path / "run"), config=_config(**c), resume=True,
        compared=keys)
    with pytest.raises(rundir.RunDirError,
                       match=r"`learning_rate`: saved 0.001, now 0.5"):
        opened(learning_rate=0.5)
    if finished:
        with pytest.raises(rundir.NothingToTrain, match="nothing to train"):
            opened(strategy="multi_worker")
    else:
        assert opened(strategy="multi_worker").resuming


def test_run_dir_refusals_and_defaults(tmp_path, monkeypatch):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    with pytest.raises(rundir.RunDirError, match="holds no config.json"):
        rundir.open_run_dir(str(tmp_path / "other"), config={}, resume=True,
                            compared=())
    # --resume with nothing there starts a new run.
    assert not rundir.open_run_dir(str(tmp_path / "new"), config={},
                                   resume=True, compared=()).resuming
    # A directory named like the package, where Python imports from.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    with pytest.raises(rundir.RunDirError, match="`import tfmulti` find"):
        rundir.open_run_dir("tfmulti", config={}, resume=False, compared=())
    first = rundir.default_model_dir("keras_fit", environ={})
    assert re.fullmatch(r"runs/keras_fit-\d{8}-\d{6}", first)
    os.makedirs(first)
    assert rundir.default_model_dir("keras_fit", environ={}) != first
    # Workers of one launch share the launcher's id.
    assert rundir.default_model_dir(
        "keras_fit", environ={rundir.RUN_ID_ENV: "20260101-000000"}
    ) == "runs/keras_fit-20260101-000000"
