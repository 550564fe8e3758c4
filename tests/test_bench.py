"""python -m tfmulti.bench: the tiniest run writes a well-formed report."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest

from tests.subproc import run_python
from tfmulti.bench import communication, parts, report, sharding, stats
from tfmulti.bench import __main__ as bench_main


def test_gradient_shapes_have_about_the_asked_parameters():
    shapes = communication.gradient_shapes(10_000_000)
    params = sum(math.prod(shape) for shape in shapes)
    assert len(shapes) == 8
    assert 0.99e7 < params < 1.01e7


def test_bad_reduce_config_and_mode_are_named():
    with pytest.raises(ValueError, match="`dtype` is 'int8'"):
        communication.ReduceConfig("x", dtype="int8")
    with pytest.raises(ValueError, match="`pack_bytes` .* got -1"):
        communication.ReduceConfig("x", pack_bytes=-1)
    with pytest.raises(ValueError, match="`mode` is 'fast'"):
        bench_main.run(out="unused", mode="fast")
    with pytest.raises(ValueError, match="unknown parts \\['speed'\\]"):
        bench_main.run(out="unused", only=["speed"])


def test_methods_include_variants_the_step_benchmark_adds():
    figures = {"bare_loop_32": 3.0, "keras_fit": 1.0, "tfmulti_fit_32": 2.0,
               "trainer_32_vs_bare_loop_32": 0.9, "replicas": 4, "rounds": {}}
    assert report.methods(figures) == ["bare_loop_32", "keras_fit",
                                       "tfmulti_fit_32"]


def test_goals_say_met_or_missed_with_the_ratio():
    figures = {"replicas": 4, "steps": 256, "trainer_32_vs_bare_loop_32": 0.9,
               "trainer_32_vs_keras_fit": 6.0,
               "trainer_32_xla_vs_bare_loop_32": 1.4,
               "tfmulti_fit_32_vs_keras_fit": 2.0,
               "tfmulti_fit_32_steady_vs_trainer_32_steady": 1.0}
    results = {"step_overhead": {"mlp": {"4": figures},
                                 "cnn": {"1": dict(figures, replicas=1),
                                         "4": figures}},
               "settings": {"mode": "quick"}, "seconds": 200.0,
               "load_average": {"start": (3.0, 2.0, 1.0),
                                "end": (4.0, 2.0, 1.0)}}
    goals = {g["name"]: (g["value"], g["status"])
             for g in report.goals(results)}
    assert goals["mlp: Trainer/bare loop at N=4"] == (0.9, "MISSED")
    assert goals["cnn: Trainer XLA / uncompiled bare loop at N=1"] == (
        1.4, "met")
    assert goals["mlp: tfmulti fit / Keras fit, whole 256-step call at "
                 "N=4"] == (2.0, "MISSED")
    assert goals["mlp: tfmulti fit / Trainer, steady, at N=4"] == (
        1.0, "met")
    wall = [g for g in report.goals(results) if "--quick" in g["name"]]
    assert [(g["value"], g["status"]) for g in wall] == [(200.0, "MISSED")]
    assert "3.0/2.0/1.0" in wall[0]["name"]


def test_paired_ratio_interval_and_the_verdict_on_a_goal():
    """The geometric mean of per-round ratios with Student's t interval on
    the logs; a goal is met or MISSED only by the whole interval."""
    # Ratios 2, 2*e^0.1, 2*e^-0.1: log mean ln 2, sd 0.1, 3 rounds.
    low_b = [1.0, 1.0, 1.0]
    high_a = [2.0, 2.0 * math.exp(0.1), 2.0 * math.exp(-0.1)]
    interval = stats.paired_ratio(high_a, low_b)
    half = 4.303 * 0.1 / math.sqrt(3)
    assert interval["ratio"] == pytest.approx(2.0)
    assert interval["low"] == pytest.approx(2.0 * math.exp(-half))
    assert interval["high"] == pytest.approx(2.0 * math.exp(half))
    assert interval["rounds"] == 3
    assert stats.verdict(interval, 1.5) == "met"
    assert stats.verdict(interval, 2.0) == "not shown"
    assert stats.verdict(interval, 3.0) == "MISSED"
    # One round: no interval, never judged.
    one = stats.paired_ratio([2.0], [1.0])
    assert one["low"] is None and stats.verdict(one, 1.0) == "not shown"
    assert stats.relative_width(one) == math.inf
    assert stats.relative_width(interval) == pytest.approx(
        math.exp(2 * half) - 1)
    with pytest.raises(ValueError, match="equally long"):
        stats.paired_ratio([1.0], [1.0, 2.0])
    # The report judges a step-overhead ratio by its interval, and the
    # communication defaults by time, not by the count of collectives.
    figures = {"replicas": 2, "steps": 64, "intervals": {
        "trainer_32_vs_bare_loop_32": dict(interval, ratio=0.97, low=0.93,
                                           high=1.01)}}
    comm = {"configs": {
        name: {"rounds": rounds, "payload_bytes": size, "wire_dtypes": [d]}
        for name, rounds, size, d in (
            ("one_pack_float32", [0.30, 0.33, 0.36], 8, "float32"),
            ("pack_4MiB_float32", [0.20, 0.21, 0.22], 8, "float32"),
            ("one_pack_bfloat16", [0.10, 0.11, 0.12], 4, "bfloat16"),
            ("pack_4MiB_bfloat16", [0.21, 0.20, 0.23], 4, "bfloat16"))},
        # In a whole training step the packs are measurably slower here.
        "train_step": {"configs": {
            "one_pack_float32": {"rounds": [0.100, 0.101, 0.102]},
            "pack_4MiB_float32": {"rounds": [0.110, 0.111, 0.112]}}}}
    found = {g["name"]: g for g in report.goals(
        {"step_overhead": {"mlp": {"2": figures}}, "communication": comm})}
    trainer = found["mlp: Trainer/bare loop at N=2"]
    assert (trainer["status"], trainer["interval"]) == (
        "not shown", [0.93, 1.01])
    assert "[0.93, 1.01] (3 rounds)" in report.format_goal_value(trainer)
    packs = found["all-reduce speed-up: default 4 MiB packs over one pack"]
    assert packs["status"] == "met" and packs["value"] > 1.5
    assert found["all-reduce speed-up: bfloat16 over float32 on the wire "
                 "(4 MiB packs; opt-in, lossy)"]["status"] == "not shown"
    step = found["training-step speed-up: default 4 MiB packs over one pack"]
    assert step["status"] == "MISSED" and step["value"] == pytest.approx(
        0.101 / 0.111, rel=1e-3)


def test_a_failed_layout_keeps_the_others_and_is_listed(monkeypatch):
    """One step-overhead layout timing out (a loaded machine) loses only
    itself; the calibration comes from the first layout."""
    def part(name, kwargs, timeout):
        if (kwargs["model"], kwargs["replicas"]) == ("cnn", 1):
            raise TimeoutError(f"{name} ran past {timeout} s")
        return [{"model": kwargs["model"], "replicas": kwargs["replicas"],
                 "bare_loop_32": 10.0 * kwargs["replicas"], "timing_s": 1.0,
                 "load_average": {"before": (1.0, 1.0, 1.0)}}]

    monkeypatch.setattr(parts, "run_part", part)
    mode = dict(bench_main.MODES["quick"], deadline=1e18)
    results = bench_main._step_overhead(mode, 10)
    assert {m: sorted(by_n) for m, by_n in results.items()} == {
        "mlp": ["1", "4"], "cnn": ["4"]}
    assert list(mode["layout_errors"]) == ["step_overhead cnn N=1"]
    assert mode["calibration"]["steps_per_s"] == 10.0
    # Set-up time is recorded per layout (wall minus timed rounds).
    assert "setup_s" in results["mlp"]["4"]


def test_budgeted_layouts_share_what_is_left_set_up_included(monkeypatch):
    """To a budget, each layout's process gets a deadline: an equal share
    of the time left (its set-up counts against it), so a long set-up
    shortens its own rounds instead of passing the budget."""
    shares = []

    def part(name, kwargs, timeout):
        shares.append(kwargs["deadline"] - time.time())
        time.sleep(0.2)  # this layout's set-up and rounds
        return [{"model": kwargs["model"], "replicas": kwargs["replicas"],
                 "bare_loop_32": 10.0, "timing_s": 0.1,
                 "load_average": {"before": (1.0, 1.0, 1.0)}}]

    monkeypatch.setattr(parts, "run_part", part)
    mode = dict(bench_main.MODES["quick"], reserve_seconds=2.0,
                deadline=time.monotonic() + 10.0)
    bench_main._step_overhead(mode, 10)
    assert len(shares) == 4
    assert shares[0] == pytest.approx(8.0 / 4, abs=0.1)
    # The last layout gets everything left: 8 s less what the others took.
    assert shares[-1] == pytest.approx(8.0 - 3 * 0.2, abs=0.15)


@pytest.mark.slow
def test_tiny_run_writes_results_json_markdown_and_plots(tmp_path,
                                                         shapes_data_dir):
    out = tmp_path / "bench"
    run_python(["-m", "tfmulti.bench", "--tiny", "--out", str(out),
                "--data_dir", str(shapes_data_dir), "--timeout", "480"],
               # Under pytest-timeout's 600 s; a loaded machine needed more
               # than 300 s for the step-overhead layouts.
               timeout=570)
    results = json.loads((out / "results.json").read_text())
    for key in report.TOP_LEVEL_KEYS:
        assert key in results, key
    assert results["schema_version"] == report.SCHEMA_VERSION
    assert results["errors"] == {}
    assert results["machine"]["cpus"] >= 1

    for model in ("mlp", "cnn"):
        by_n = results["step_overhead"][model]
        assert sorted(by_n) == ["1", "2"]
        for n, figures in by_n.items():
            assert figures["replicas"] == int(n)
            for method in ("bare_loop_32", "bare_loop_keras",
                           "bare_loop_reduce_once", "bare_loop_32_steady",
                           "trainer_32", "trainer_32_steady", "trainer_1",
                           "keras_fit"):
                assert figures[method] > 0
            assert figures["trainer_32_vs_bare_loop_32"] > 0
            assert len(figures["load_average"]["before"]) == 3
        scaling = results["replica_overhead"][model]["trainer_32"]
        assert scaling["1"] == 1.0 and scaling["2"] > 0

    pipe = results["input_pipeline"]
    assert set(pipe["steps_per_s"]) == {"pipeline", "pipeline_map", "memory"}
    assert pipe["ratio_paired"] > 0

    comm = results["communication"]
    assert comm["workers"] == 2
    configs = comm["configs"]
    f32, b16, f16 = (configs[f"one_pack_{d}"]
                     for d in ("float32", "bfloat16", "float16"))
    # Bytes follow the dtype the traced collective actually carries.
    assert f32["wire_dtypes"] == ["float32"]
    assert b16["wire_dtypes"] == ["bfloat16"]
    assert f16["wire_dtypes"] == ["float16"]
    assert b16["payload_bytes"] * 2 == f32["payload_bytes"] == (
        comm["params"] * 4)
    assert configs["per_tensor_float32"]["collectives_per_step"] == (
        comm["gradient_tensors"])
    assert f32["collectives_per_step"] == 1
    assert all(c["seconds_per_step"] > 0 for c in configs.values())
    # The default packing timed in a whole training step as well.
    step = comm["train_step"]
    assert set(step["configs"]) == {"one_pack_float32", "pack_4MiB_float32"}
    assert all(c["seconds_per_step"] > 0 and len(c["rounds"]) >= 1
               for c in step["configs"].values())
    assert step["compute_only_s"] > 0 and step["layers"] == 4

    service = results["data_service"]
    assert [service[f]["data_workers"] for f in (
        "local", "service_1", "service_2")] == [0, 1, 2]
    assert all(service[f]["steps_per_s"] > 0 for f in (
        "local", "service_1", "service_2"))
    assert service["restarts"] == 0

    mem = results["accumulation_memory"]
    assert mem["accumulated"]["examples_per_update"] == (
        mem["large_batch"]["examples_per_update"])
    assert mem["accum_vs_batch"] > 0
    assert {g["name"] for g in results["goals"]} >= {
        "bfloat16 bytes / float32 bytes", "peak memory: accumulate K x B / "
        "batch B", "cnn: Trainer XLA / uncompiled bare loop at N=1",
        "cnn: Trainer XLA / uncompiled bare loop at N=2",
        "mlp: tfmulti fit / Keras fit, whole 64-step call at N=2",
        "mlp: tfmulti fit / Trainer, steady, at N=2",
        "all-reduce speed-up: default 4 MiB packs over one pack"}
    for goal in results["goals"]:
        # One round per layout here: a ratio without an interval is never
        # judged.
        assert goal["status"] in ("met", "MISSED", "not shown"), goal
        assert goal["met"] == (goal["status"] == "met"), goal
    assert results["calibration"]["steps_per_s"] == (
        results["step_overhead"]["mlp"]["1"]["bare_loop_32"])
    load = results["load_average"]
    assert len(load["start"]) == len(load["end"]) == 3
    # The parts --tiny runs; the others are named once as skipped.
    assert set(load["parts"]) == {
        name for name in bench_main.PART_NAMES
        if name not in bench_main.OPTIONAL_PARTS or
        name in bench_main.MODES["tiny"]}

    markdown = (out / "results.md").read_text()
    assert "Machine:" in markdown and "## Communication" in markdown
    assert "## tf.data service" in markdown
    assert "load average" in markdown and "| status |" in markdown
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("steps_per_s.png", "scaling.png", "communication.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recipe_rows_are_the_recipe_command_lines_judged_by_interval():
    """The `recipes` part's plumbing, without training: each row's command
    line parses as the recipe's flags, paired gaps get Student's t interval,
    and a goal is met only by the interval's far end."""
    from tests.test_recipes import _parse
    from tfmulti.bench import recipe_commands as rc
    for row in rc.ROWS:
        cmd = rc.command(row, seed=3, steps=300, model_dir="/m",
                         data_dir="/d")
        # A pipeline runs in one process (it refuses a cluster).
        assert (cmd[:3] == ["tfmulti-launch", "--workers", "2"]) == (
            row != "pipeline")
        recipe = cmd[cmd.index("recipes.custom_loop") + 1:]
        config = _parse(*recipe)
        assert (config.steps, config.seed, config.model_dir,
                config.data_dir) == (300, 3, "/m", "/d")
        # Every other flag at its default.
        assert len(recipe) == len(rc.ROWS[row][0]) + 4
        # Without `steps`, the recipe's own run length (--epochs).
        default = rc.command(row, seed=3, steps=None, model_dir="/m",
                             data_dir=None)
        assert _parse(*default[default.index(
            "recipes.custom_loop") + 1:]).steps is None
    assert "--ps" in rc.command("parameter_server", seed=0, steps=1,
                                model_dir="/m", data_dir=None)
    # mean 2, sd 1, n 3: half-width t(2) * 1 / sqrt(3).
    mean, low, high = rc.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(4.303 / 3 ** 0.5)
    assert rc.judge(-0.5, 0.9, 1.0) == "met"
    assert rc.judge(-0.5, 1.1, 1.0) == "not shown"
    assert rc.judge(1.2, 3.0, 1.0) == "MISSED"

    def run(accuracy, nbytes):
        return {"accuracy": accuracy, "seconds": 60.0,
                "inter_worker_bytes": nbytes}

    runs = {"sync": {"0": run(0.90, 800), "1": run(0.80, 800),
                     "2": run(0.85, 800)},
            "local_sgd_h8": {"0": run(0.899, 100), "1": run(0.795, 100),
                             "2": run(0.848, 100)},
            "sync_9_epochs": {"0": run(0.95, 2400), "1": run(0.85, 2400)},
            "parameter_server": {"0": run(0.50, 0), "1": run(0.40, 0),
                                 "2": {"error": "exit 1: ..."}}}
    rows = rc.summarize(runs)
    # Parameter servers (9 epochs by default) against synchronous training
    # of the same length, not the 3-epoch row.
    assert rows["parameter_server"]["gap_points"] == pytest.approx([45, 45])
    assert "gap_points" not in rows["sync_9_epochs"]
    h8 = rows["local_sgd_h8"]
    assert h8["gap_points"] == pytest.approx([0.1, 0.5, 0.2])
    assert h8["fewer_bytes_than_sync"] == 8.0
    assert rows["parameter_server"]["paired_seeds"] == 2
    assert "fewer_bytes_than_sync" not in rows["parameter_server"]
    found = {g["name"].split(":")[0]: g for g in rc.goals(rows)}
    assert found["recipe --sync_every=8"]["status"] == "met"
    assert found["recipe --strategy=parameter_server"]["status"] == "MISSED"
    table = "\n".join(rc.markdown({"settings": {"steps": 300, "workers": 2},
                                   "rows": rows}))
    assert "| parameter_server | `--ps 1 --strategy=parameter_server` | " \
           "0,1 (failed: 2) | 45.00% |" in table
    # The report carries the part's goals and table.
    results = {"recipes": {"settings": {"steps": 300, "workers": 2},
                           "rows": rows}}
    assert [g["status"] for g in report.goals(results)] == ["met", "MISSED"]


def test_sharding_part_measures_a_half_per_device():
    # The part in its own process, 2 simulated replicas, the smallest run:
    # the state per device (read from the variables' placement) is half of
    # the unsharded one at both stages, the host keeps the unsharded copy;
    # stage 2 keeps half of the reduced gradient and sends one
    # all-reduce's worth of bytes, through the all-to-all.
    result = parts.run_part("sharding", {
        "replicas": 2, "steps": 4, "rounds": 2, "width": 32,
        "global_batch_size": 16}, timeout=240)[0]
    unsharded = result["unsharded"]
    # Adam: 2 slots of 3466 float32 parameters plus two copies of the
    # int64 step and float32 rate (shard and model optimizer) sharded.
    assert unsharded["bytes_per_device"] == 2 * 3466 * 4 + 12
    assert unsharded["gradient_bytes_per_device"] == 3466 * 4
    for name in ("stage1", "stage2"):
        sharded = result[name]
        assert sharded["devices"] == unsharded["devices"] == 2
        assert sharded["bytes_per_device"] == 2 * 1733 * 4 + 2 * 12
        assert sharded["host_bytes"] == 2 * 3466 * 4
        assert sharded["bytes_fraction"] <= 1 / 2 + 0.05
        assert result["step_time_ratio"][name]["ratio"] > 0
    assert result["stage2"]["gradient_bytes_per_device"] == 1733 * 4
    assert result["stage2"]["bytes_with_gradient_fraction"] <= 1 / 2 + 0.05
    assert result["stage2"]["path"] == "all-to-all"
    assert result["stage2"]["wire_over_all_reduce"] == 1.0
    assert result["stage1"]["wire_over_all_reduce"] == 1.5
    table = "\n".join(sharding.markdown({"2": result}))
    assert "| 2 | 3466 | stage2 |" in table and "all-to-all" in table
