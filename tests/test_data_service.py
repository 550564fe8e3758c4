"""tf.data service input: real dispatcher and data workers on loopback.

One `python -m tfmulti.data.service_server local --workers 2` process serves the
module. Through it, on 4 mirrored replicas and on 2 worker processes:
evaluation sees every id exactly once and Keras's weighted metrics equal one
device (a plain dataset_fn on 4 replicas, record files sharded by file on 2
workers); two training epochs each see every element exactly once (no
faults); an address where nothing listens is a ConnectionError naming it,
within its bound.
"""

import json
import socket
import subprocess
import sys
import time
import warnings

import pytest

from tests.subproc import run_python, run_workers

WORKER = "tests/workers/data_service_worker.py"
TOLERANCE = 1e-6


def start_service(*args, lines=1, timeout=120):
    """Starts `python -m tfmulti.data.service_server ARGS`; returns (proc, the
    addresses it printed, in order)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfmulti.data.service_server", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addresses, deadline = [], time.monotonic() + timeout
    while len(addresses) < lines:
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"data service {args} did not start")
        if line.startswith("tfmulti: data service"):
            addresses.append(line.split(" at ")[-1].strip())
    return proc, addresses


def stop_service(proc):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def service():
    proc, addresses = start_service("local", "--workers", "2", lines=3)
    yield addresses[0]
    stop_service(proc)


def _check_eval(result):
    # Every id exactly once, whatever data worker produced it.
    assert sorted(result["eval_ids"]) == list(range(1001))
    for key in ("accuracy", "xent"):
        assert result["evaluate"][key] == pytest.approx(
            result["golden"][key], abs=TOLERANCE, rel=TOLERANCE)
    assert 0.02 < result["golden"]["accuracy"] < 0.95


def _check_unreachable(result):
    address = f"grpc://127.0.0.1:{result['closed_port']}"
    assert f"`{address}`" in result["unreachable"]
    assert "--data_workers" in result["unreachable"]
    # Bounded: 2 s of waiting plus one connect attempt, not TF's retries.
    assert result["unreachable_seconds"] < 10


@pytest.mark.slow
def test_four_replicas_through_service(service, tmp_path, shapes_data_dir):
    out = tmp_path / "mirrored.json"
    run_python([WORKER, str(out), "mirrored4", service,
                str(shapes_data_dir)], timeout=300)
    result = json.loads(out.read_text())
    # TFDS through 2 data workers, one of which reads nothing: the same
    # 200 examples as without the service (TFDS's length check is off on
    # the data workers, not on the pipeline's exact-once count).
    assert len(result["tfds_service"]) == 200
    assert result["tfds_service"] == result["tfds_local"]
    assert result["replicas"] == 4
    # 1001 / 48 -> 21 steps, the last one partly padding.
    assert result["eval_steps"] == 21
    _check_eval(result)
    for seen in result["train_ids"]:
        assert sorted(seen) == list(range(96))
    assert result["fit_loss"] > 0
    _check_unreachable(result)


@pytest.mark.slow
def test_two_workers_through_service(service, tmp_path):
    run_workers([WORKER, str(tmp_path / "worker{index}.json"),
                 "multi_worker", service], 2, timeout=300)
    results = [json.loads((tmp_path / f"worker{i}.json").read_text())
               for i in range(2)]
    eval_ids = results[0]["eval_ids"] + results[1]["eval_ids"]
    assert sorted(eval_ids) == list(range(1001))
    for result in results:
        assert result["replicas"] == 2
        # Files 0, 2, 4, 6 (504 examples) and 1, 3, 5, 7 (497), 24 per
        # step -> 21 steps each.
        assert result["eval_steps"] == 21
        for key in ("accuracy", "xent"):
            assert result["evaluate"][key] == pytest.approx(
                result["golden"][key], abs=TOLERANCE, rel=TOLERANCE)
    for epoch in range(2):
        seen = (results[0]["train_ids"][epoch]
                + results[1]["train_ids"][epoch])
        assert sorted(seen) == list(range(96))
    _check_unreachable(results[0])
    # Element sharding through the service would mix the pipelines.
    error = results[0]["element_sharding_error"]
    assert "`service`='grpc://127.0.0.1:" in error
    assert "files_dataset_fn" in error and "2 input pipelines" in error


@pytest.mark.slow
def test_a_data_worker_tells_readers_its_host_name():
    """TensorFlow's default, `localhost`, would send readers on other
    machines to themselves: a data worker whose dispatcher is on another
    host advertises this machine's name (or --worker_address)."""
    from tfmulti.data import service_server
    assert service_server.worker_host("grpc://node3:5050") == (
        socket.gethostname())
    assert service_server.worker_host("node3:5050", "10.0.0.7") == "10.0.0.7"
    for loopback in ("127.0.0.1:5050", "localhost:5050", "[::1]:5050"):
        assert service_server.worker_host(loopback) == "localhost"


@pytest.mark.slow
def test_servers_addressed_by_host_name_serve_a_reader(tmp_path):
    """As on a cluster: the dispatcher addressed by this machine's name
    (not loopback), a data worker started with it, and a reader through
    `TFMULTI_DATA_SERVICE` gets every id once, in order."""
    host = socket.gethostname()
    dispatcher, (address,) = start_service("dispatcher")
    worker = None
    try:
        dispatcher_address = f"{host}:{address.rsplit(':', 1)[1]}"
        worker, (worker_address,) = start_service(
            "worker", f"--dispatcher={dispatcher_address}")
        assert worker_address.startswith(f"{host}:")
        out = tmp_path / "child.json"
        run_python(["tests/workers/data_service_launch_child.py", str(out)],
                   env={"TFMULTI_DATA_SERVICE": dispatcher_address},
                   timeout=240)
        # One data worker: the local pipeline's order, not only its ids.
        assert json.loads(out.read_text())["ids"] == list(range(300))
    finally:
        for proc in (worker, dispatcher):
            if proc is not None:
                stop_service(proc)


def test_launch_data_workers(tmp_path):
    """`tfmulti-launch --data_workers 2` starts a dispatcher and 2 data
    workers, the job reads through them by `TFMULTI_DATA_SERVICE`, and
    all of them are gone when the launcher returns."""
    out = tmp_path / "child.json"
    _, output = run_python(
        ["-m", "tfmulti.launch", "--workers", "1", "--data_workers", "2",
         "--timeout", "400", "--", sys.executable,
         "tests/workers/data_service_launch_child.py", str(out)],
        timeout=450)
    result = json.loads(out.read_text())
    assert sorted(result["ids"]) == list(range(300))
    assert f"dispatcher at {result['address']}" in output
    host, port = result["address"].rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


class _StalledAfterDispatcherRestart(Exception):
    pass


def _read_through_restarts(out):
    """One run of the scenario below: the reader's messages (`said`)."""
    import os
    import signal
    from tfmulti import launch, launch_processes
    said = []
    reaper = launch_processes.Reaper(5)
    data = launch_processes.DataService(
        launch.LaunchOptions(workers=1, data_workers=2), reaper, said.append)
    reader = subprocess.Popen(
        [sys.executable, "tests/workers/data_service_fault_reader.py",
         str(out), data.address], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True)

    def kill_and_restart(name, restarts):
        os.killpg(data.procs[name].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while data.restarts < restarts and time.monotonic() < deadline:
            data.supervise()
            time.sleep(0.2)
        assert data.restarts == restarts, said

    try:
        assert reader.stdout.readline().strip() == "batch 25"
        kill_and_restart("d1", 1)
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "batch 45"
        kill_and_restart("dispatcher", 2)
        reader.stdin.write("\n")
        reader.stdin.flush()
        try:
            assert reader.wait(timeout=240) == 0
        except subprocess.TimeoutExpired:
            raise _StalledAfterDispatcherRestart(said) from None
    finally:
        # Not `kill -9 -PGID`: procps-ng 4.0.2's kill parses "-12345" as
        # "-1" (strace: kill(-1, SIGKILL)) and killed every process on the
        # machine whenever the reader's pid began with 1.
        launch_processes.kill_group(reader)
        data.stop()
        reaper.close()
    return said


def test_launcher_restarts_a_killed_data_worker_and_dispatcher(tmp_path):
    """The launcher's service (`tfmulti-launch --data_workers`): a data
    worker SIGKILLed mid-epoch and later the dispatcher are started again
    on their ports (the worker's in-flight elements lost, at most once, and
    reported; the dispatcher resumes from its journal), and the reader
    goes on to the end; without the restart it waits for the worker.

    Once (stop 42's CI, under the full suite's load; not in 16 runs of
    stop 43, alone or beside other multi-process tests) the reader got
    nothing more after the dispatcher's restart, for the whole bound:
    TensorFlow's own recovery, which docs/data.md states. That outcome, and
    only that, is run again once, with a warning in the test report.
    """
    out = tmp_path / "out.json"
    try:
        said = _read_through_restarts(out)
    except _StalledAfterDispatcherRestart as stalled:
        warnings.warn(f"tf.data service reader stalled after the "
                      f"dispatcher's restart (run again): {stalled.args[0]}")
        said = _read_through_restarts(out)
    assert any("d1 was killed by SIGKILL; starting it again on port" in line
               for line in said), said
    result = json.loads(out.read_text())
    counts = {i: result["ids"].count(i) for i in set(result["ids"])}
    # 60 batches of 20 from 3 epochs of 400: each id at most once per epoch,
    # none lost beyond what the losses say.
    assert len(result["ids"]) == 1200 and max(counts.values()) <= 4
    assert set(counts) == set(range(400))
    lost = sum(loss["lost"] for loss in result["losses"])
    assert lost < 100, result["losses"]
    if not lost:
        # The kill found d1 with nothing in flight (seen once under load,
        # the full suite beside it): then nothing may be missing either,
        # every epoch whole.
        assert set(counts.values()) == {3}, counts
    assert all(loss["delivered"] + loss["lost"] == loss["expected"] == 400
               for loss in result["losses"])


def test_recipe_through_the_launchers_service_reports_it(tmp_path,
                                                         shapes_data_dir):
    """The recipe as users run it on input workers: `tfmulti-launch
    --data_workers 1` and the recipe at its defaults but length; the
    training and evaluation input go through the service, and metrics.json
    says where from and that nothing was lost."""
    run = tmp_path / "run"
    run_python(["-m", "tfmulti.launch", "--workers", "1", "--data_workers",
                "1", "--timeout", "400", "--", sys.executable, "-m",
                "recipes.custom_loop", f"--model_dir={run}",
                f"--data_dir={shapes_data_dir}", "--steps=4",
                "--steps_per_loop=2"], timeout=450)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["data_service"]["address"].startswith("grpc://127.0.0.1:")
    assert metrics["data_service"]["lost"] == []
    assert metrics["steps"] == 4 and 0 <= metrics["eval"]["accuracy"] <= 1

