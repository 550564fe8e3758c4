"""create_strategy on 1, 2 and 4 simulated CPU devices and on 2 workers."""

import json

import pytest

from tests.subproc import run_python, run_workers


def _result(output):
    line = [l for l in output.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module", params=[1, 2, 4])
def probe(request):
    _, out = run_python(["tests/workers/strategy_probe.py",
                         str(request.param)], timeout=180)
    return request.param, _result(out)


def test_each_name_gives_the_expected_strategy(probe):
    count, result = probe
    assert len(result["devices"]) == count
    created = result["created"]
    assert created["one_device"] == ["OneDeviceStrategy", 1]
    assert created["mirrored"] == ["MirroredStrategy", count]
    assert created["mirrored_subset"] == ["MirroredStrategy", 1]
    expected_auto = "MirroredStrategy" if count > 1 else "OneDeviceStrategy"
    assert created["auto"] == [expected_auto, count]
    assert result["options"] == [1 << 20, 30]
    # pack_bytes=None: tfmulti's measured default, 4 MiB packs.
    assert result["default_bytes_per_pack"] == 4 << 20
    assert result["again"] == count
    assert result["all_reduce_sums"] == sorted({1.0, min(2.0, count), count})


def test_bad_options_get_clear_errors(probe):
    errors = probe[1]["errors"]
    assert "`name` is 'horovod'" in errors["bad_name"]
    assert "'multi_worker'" in errors["bad_name"]  # lists the valid ones
    assert "`all_reduce` is 'ring'" in errors["bad_algorithm"]
    assert "'hierarchical_copy'" in errors["bad_algorithm"]
    assert "needs GPUs" in errors["nccl"]
    assert "`num_gpus` is 2" in errors["gpus"] and "0 GPU" in errors["gpus"]
    assert "`pack_bytes`" in errors["pack"]
    assert "`timeout_seconds`" in errors["timeout"]
    assert "`stall_timeout_seconds` should be a positive number" in (
        errors["stall"]) and "got -1" in errors["stall"]


def test_explicit_collective_timeout_warns_once_about_threads(probe):
    warned = probe[1]["timeout_warnings"]
    assert len(warned) == 1, warned
    assert "one thread alive per collective" in warned[0]
    assert "`stall_timeout_seconds`" in warned[0]


def test_simulate_devices_too_late_says_what_to_do(probe):
    message = probe[1]["errors"]["late"]
    assert "before any other TensorFlow operation" in message
    assert f"simulate_devices(count={probe[0] + 1})" in message


@pytest.mark.slow
def test_auto_picks_multi_worker_in_a_cluster():
    results = run_workers(["tests/workers/multi_worker_probe.py"], 2,
                          timeout=180)
    got = [_result(out) for _, out in results]
    assert got == [["KerasMultiWorkerMirroredStrategy", 2, True],
                   ["KerasMultiWorkerMirroredStrategy", 2, False]]
