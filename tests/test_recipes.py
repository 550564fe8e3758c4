"""The recipes end to end: one_device, 2 simulated replicas, 2 workers.

Each run trains a few steps on the offline dataset and must leave
checkpoints, TensorBoard events and a complete metrics.json in --model_dir.
"""

import json
import os
import re
import sys

from absl import flags as absl_flags
import pytest

from tests.subproc import run_python
from tfmulti import flags as tfmulti_flags

RECIPES = {"recipes.custom_loop": "trainer", "recipes.keras_fit": "fit"}
METRICS_FIELDS = {"loop", "train", "eval", "steps", "examples_per_sec",
                  "num_replicas", "config", "versions"}


def _flags(model_dir, data_dir, *extra):
    return [f"--model_dir={model_dir}", f"--data_dir={data_dir}",
            "--global_batch_size=32", "--steps=4", "--steps_per_loop=2",
            *extra]


def _check_run(model_dir, recipe, num_replicas):
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert METRICS_FIELDS <= set(metrics)
    assert metrics["loop"] == RECIPES[recipe]
    assert metrics["num_replicas"] == num_replicas
    assert metrics["steps"] == 4
    assert metrics["examples_per_sec"] > 0
    assert 0.0 <= metrics["eval"]["accuracy"] <= 1.0
    assert {"tensorflow", "keras", "tfmulti"} <= set(metrics["versions"])
    assert metrics["config"]["global_batch_size"] == 32
    files = [os.path.join(d, f) for d, _, fs in os.walk(model_dir)
             for f in fs]
    assert any("tfevents" in f for f in files), files
    assert any(f.endswith(".index") or f.endswith(".keras") for f in files)
    return metrics


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("strategy, extra, replicas", [
    ("one_device", [], 1),
    ("mirrored", ["--cpu_replicas=2"], 2),
])
def test_recipe_runs_end_to_end(recipe, strategy, extra, replicas, tmp_path,
                                shapes_data_dir):
    run_python(["-m", recipe, f"--strategy={strategy}",
                *_flags(tmp_path / "run", shapes_data_dir, *extra)],
               timeout=300)
    _check_run(tmp_path / "run", recipe, replicas)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_on_two_workers(recipe, tmp_path, shapes_data_dir):
    _, out = run_python(
        ["-m", "tfmulti.launch", "--workers", "2", "--timeout", "300", "--",
         sys.executable, "-m", recipe, "--strategy=multi_worker",
         *_flags(tmp_path / "run", shapes_data_dir)], timeout=360)
    assert "[w0]" in out and "[w1]" in out
    metrics = _check_run(tmp_path / "run", recipe, 2)
    assert metrics["config"]["strategy"] == "multi_worker"


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
     "value should be one of <auto|one_device|mirrored|multi_worker>"),
    (["--all_reduce=mpi"], "value should be one of"),
    (["--global_batch_size=0"], "0 is not a positive integer"),
    (["--pack_bytes=0"], "--pack_bytes must be positive"),
])
def test_bad_flag_values_say_what_is_allowed(args, message):
    with pytest.raises(absl_flags.Error, match=re.escape(message)):
        _parse(*args)


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
