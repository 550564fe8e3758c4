"""ParameterServerStrategy: bad clusters in process; real loopback jobs.

The slow tests start a chief, 2 workers and 1 parameter server as separate
processes (`tests/workers/ps_job.py`; the worker and ps tasks run a
`tf.distribute.Server`): one job SIGKILLs the ps, then both workers, then
one worker, and checks what issue 16 promises; another compares the test
accuracy of a fault-free asynchronous run with one device's synchronous run.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import subproc
from tfmulti import cluster as cl

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "workers", "ps_job.py")
WINDOW_JOB = os.path.join(HERE, "workers", "ps_ledger_window.py")
# Minutes on a loaded 2-core machine: four TensorFlow processes start.
TIMEOUT = 420
# The accuracy comparison: long enough for both runs to converge.
ACCURACY_STEPS = 1000
ACCURACY_TIMEOUT = 900
# Issue 16's bound. Measured with the warm-up (sync 95.93%), 8 async runs:
# async - sync -0.43, -0.33, -0.35, +0.08, 0.00, +0.30, +0.15, -0.10
# points (BUILD_NOTES, issue 16).
ACCURACY_TOLERANCE = 0.02
# The fault story: short (its accuracy is not the point), loops of 25.
STORY_STEPS, STORY_LOOP = 125, 25
# The test's bound on a job with every worker gone (600 s by default).
STALL = 8


def _cluster(**roles):
    return {"cluster": {role: [f"h{role}{i}:{2000 + i}" for i in range(n)]
                        for role, n in roles.items()}}


# -- bad configurations (in process) -------------------------------------


@pytest.mark.parametrize("tf_config, message", [
    ({**_cluster(worker=2, ps=1), "task": {"type": "worker", "index": 0}},
     "needs a `cluster.chief`"),
    ({**_cluster(chief=1, ps=1), "task": {"type": "chief", "index": 0}},
     "needs a `cluster.worker`"),
    ({**_cluster(chief=1, worker=2, ps=1), "task": {"type": "ps",
                                                   "index": 1}},
     "`task.index` is 1 but the cluster has 1 'ps' task(s)"),
    ({**_cluster(chief=1, worker=2, ps=2), "task": {"type": "ps",
                                                   "index": -1}},
     "must be in [0, 1]"),
])
def test_bad_parameter_server_cluster_is_a_clear_error(tf_config, message):
    with pytest.raises(ValueError) as e:
        cl.cluster_config(json.dumps(tf_config))
    assert message in str(e.value)
    assert "e.g." in str(e.value) or "Give each process" in str(e.value)


def test_parameter_server_strategy_needs_ps_tasks():
    import tfmulti
    config = cl.cluster_config(
        {**_cluster(chief=1, worker=2), "task": {"type": "chief",
                                                 "index": 0}})
    with pytest.raises(ValueError, match=r"needs a `cluster\.ps`"):
        tfmulti.create_strategy("parameter_server", cluster=config)


def test_other_strategies_refuse_ps_tasks():
    import tfmulti
    config = cl.cluster_config(
        {**_cluster(chief=1, worker=2, ps=1), "task": {"type": "chief",
                                                       "index": 0}})
    with pytest.raises(ValueError, match="has parameter servers"):
        tfmulti.create_strategy("multi_worker", cluster=config)


def test_async_warmup_is_the_default_and_only_for_parameter_servers(
        monkeypatch):
    import tfmulti
    from tests.test_recipes import _parse
    from tfmulti import experiment_config
    from tfmulti.training import async_trainer
    assert async_trainer.DEFAULT_WARMUP_STEPS == 100
    config = _parse("--strategy=parameter_server")
    assert config.async_warmup_steps is None
    warmup, length = experiment_config.length_notes(config, None, 300, True)
    assert warmup == (
        "asynchronous: the learning rate warms up over the first 100 of 300 "
        "updates (--async_warmup_steps=100); stale gradients without it can "
        "keep the model at chance for hundreds of updates.")
    # Shorter than the run measured within 2 points of synchronous: says
    # so, naming the flags.
    assert length.startswith("asynchronous: 300 updates may be too few") \
        and length.endswith("pass --epochs=9 (the default) or more.")
    assert experiment_config.length_notes(config, None, 1404, True) == [
        warmup.replace("of 300", "of 1404")]
    # Left to its default, the length is the measured one, and said so.
    assert config.epochs is None
    assert experiment_config.with_default_epochs(config).epochs == 9
    assert experiment_config.with_default_epochs(_parse()).epochs == 3
    assert experiment_config.with_default_epochs(
        _parse("--strategy=parameter_server", "--epochs=2")).epochs == 2
    defaulted = experiment_config.length_notes(
        experiment_config.with_default_epochs(config), None, 1404, True,
        True)[1]
    assert defaulted == (
        "asynchronous: 9 epochs (1404 updates) by default, 3 for synchronous "
        "strategies: stale workers need more updates to match synchronous "
        "training; --epochs or --steps sets the length.")
    # "auto" in a cluster with parameter servers is asynchronous too.
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {**_cluster(chief=1, worker=2, ps=1),
         "task": {"type": "chief", "index": 0}}))
    assert experiment_config.with_default_epochs(_parse()).epochs == 9
    assert "first 0 of" in experiment_config.length_notes(
        _parse("--strategy=parameter_server", "--async_warmup_steps=0"),
        None, 300, True)[0]
    with pytest.raises(experiment_config.ConfigError,
                       match="`async_warmup_steps`=50 .* 'mirrored'"):
        _parse("--strategy=mirrored", "--async_warmup_steps=50")
    import keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="`async_warmup_steps`=5 warms up "
                       "asynchronous updates, but the strategy is"):
        tfmulti.Trainer(model, keras.optimizers.SGD(), loss=lambda y, p: p,
                        async_warmup_steps=5)
    with pytest.raises(ValueError, match="`async_warmup_steps` should be an "
                       "int >= 0.*-1"):
        tfmulti.Trainer(model, keras.optimizers.SGD(), loss=lambda y, p: p,
                        async_warmup_steps=-1)


def test_ps_cluster_properties():
    config = cl.cluster_config(
        {**_cluster(chief=1, worker=2, ps=2), "task": {"type": "ps",
                                                       "index": 1}})
    assert (config.num_ps, config.is_chief, config.worker_rank) == (2, False,
                                                                    0)
    configs = cl.local_cluster(2, num_ps=1)
    assert [c["task"]["type"] for c in configs] == ["chief", "worker",
                                                    "worker", "ps"]
    assert len({a for addresses in configs[0]["cluster"].values()
                for a in addresses}) == 4


# -- real processes ----------------------------------------------------------


class PsCluster:
    """A chief, workers and parameter servers of `ps_job.py` on loopback.

    The chief's output is read line by line (for `wait_for`); every process
    is its own process group, killed in `close`.
    """

    def __init__(self, args, *, env=None, workers=2, ps=1, script=JOB):
        self.procs = {}
        self._lines = queue.Queue()
        self.output = []
        self.addresses = {}
        for config in cl.local_cluster(workers, num_ps=ps):
            task = config["task"]
            role = f"{task['type']}{task['index']}"
            self.addresses[role] = config["cluster"][task["type"]][
                task["index"]]
            chief = task["type"] == "chief"
            self.procs[role] = subprocess.Popen(
                [sys.executable, script, *args],
                env=dict(os.environ, **(env or {}),
                         TF_CONFIG=json.dumps(config)),
                stdout=subprocess.PIPE if chief else subprocess.DEVNULL,
                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.procs["chief0"].stdout:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern, timeout=TIMEOUT):
        """The first new chief line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            if re.search(pattern, line):
                return line
        raise AssertionError(f"the chief printed no {pattern!r}:\n"
                             + "".join(self.output[-40:]))

    def kill(self, role):
        os.killpg(self.procs[role].pid, signal.SIGKILL)

    def wait_chief(self, timeout=TIMEOUT):
        try:
            return self.procs["chief0"].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("the chief ran past its timeout:\n" +
                                 "".join(self.output[-40:]))

    def close(self):
        for proc in self.procs.values():
            subproc._kill(proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _error_line(job, name):
    return next((line for line in job.output if line.startswith(
        f"tfmulti.training.async_trainer.{name}")),
        "".join(job.output[-40:]))


@pytest.mark.slow
def test_async_job_survives_ps_all_workers_and_worker_kills(
        tmp_path, shapes_data_dir):
    """One job, as a user would live it, in three launches of every role.

    Attempt 1: the Trainer refuses a sharded Keras variable; after step 50
    the parameter server is SIGKILLed (a clear ParameterServerError).
    Attempt 2: resumes from the chief's checkpoint; BOTH workers are
    SIGKILLed: a WorkersLostError naming them and the checkpoint, after the
    stall bound (TensorFlow alone would wait an hour). Attempt 3: resumes;
    worker 1 SIGKILLed mid-loop: the job finishes, the retry is counted,
    no closure applied twice."""
    model_dir, out = tmp_path / "model", tmp_path / "async.json"
    env = dict(os.environ, PS_JOB_STEPS=str(STORY_STEPS), PS_JOB_BATCH="32",
               PS_JOB_LOOP=str(STORY_LOOP), PS_JOB_STALL=str(STALL))
    args = ["async", str(out), shapes_data_dir, str(model_dir)]
    with PsCluster(args, env=dict(env, PS_JOB_CHECK_SHARDED="1")) as job:
        # The checkpoint of step 25 is written before the loop to 50.
        job.wait_for(rf"^step {2 * STORY_LOOP}/")
        job.kill("ps0")
        code = job.wait_chief()
    assert code != 0
    message = _error_line(job, "ParameterServerError")
    print(message)
    assert re.search(r"A parameter server of \['127\.0\.0\.1:\d+'\] "
                     r"died", message)
    assert "resumes from its latest checkpoint" in message
    assert "is sharded over the parameter servers" in "".join(
        job.output), "".join(job.output[-40:])

    with PsCluster(args, env=env) as job:
        job.wait_for(r"^restored ")
        job.wait_for(r"^step \d+/")
        workers = [job.addresses["worker0"], job.addresses["worker1"]]
        job.kill("worker0")
        job.kill("worker1")
        killed = time.monotonic()
        code = job.wait_chief()
        waited = time.monotonic() - killed
    assert code != 0
    message = _error_line(job, "WorkersLostError")
    print(message, f"(chief exited {waited:.1f} s after the kill)")
    assert f"Every worker of this job ({workers!r})" in message
    assert re.search(r"latest checkpoint '.*ckpt-\d+'", message), message
    # The bound, not TensorFlow's hour: STALL s with no worker, plus the
    # time the coordinator takes to see both gone, plus the exit.
    assert STALL <= waited < STALL + 90, waited

    with PsCluster(args, env=env) as job:
        restored = job.wait_for(r"^restored ")
        job.wait_for(r"^step \d+/")
        # The chief schedules the next loop right after printing: both
        # workers are inside closures when worker 1 dies.
        time.sleep(0.5)
        job.kill("worker1")
        assert job.wait_chief() == 0, "".join(job.output[-40:])
    print("".join(line for line in job.output if line.startswith("step")))
    resumed_at = int(re.search(r"at step (\d+)", restored).group(1))
    run = json.loads(out.read_text())
    assert run["step"] == STORY_STEPS
    # The restarted job scheduled only the remaining closures, and one
    # attempt of each claimed its update, though the kill hit one in flight
    # and it was retried.
    assert set(run["claimed"][resumed_at:]) == {1}
    assert sum(run["claimed"]) == STORY_STEPS - resumed_at
    # The steps counted inside the claims: each loop of closures made
    # exactly that many (a closure claimed twice shows as 51 after 25).
    assert run["history"]["step"] == list(range(
        resumed_at + STORY_LOOP, STORY_STEPS + 1, STORY_LOOP))
    retried = run["history"]["retried_closures"][-1]
    assert retried >= 1, "the kill hit no closure in flight"
    # Closures re-run on the ps: a subset of the coordinator's retries (a
    # first attempt that never started reached no ps).
    assert sum(a > 1 for a in run["attempts"]) <= retried
    # An update cut off by the kill is lost, never applied twice: only a
    # retried closure can lose one, and the history counts them.
    lost = sum(run["claimed"]) - sum(run["completed"])
    assert run["history"]["lost_updates"][-1] == lost
    assert 0 <= lost <= retried
    print(f"resumed at step {resumed_at}, retried closures {retried}")


@pytest.mark.slow
def test_update_cut_off_by_a_dead_worker_is_lost_never_applied_twice(
        tmp_path):
    """The ledger's window forced open: a worker has claimed an update and
    is still computing it when it is SIGKILLed. The coordinator retries its
    closure on the other worker, which finds it claimed and applies
    nothing: every closure claimed once, the cut-off update lost and
    counted, and `completed` only counts writes that landed."""
    out, signals = tmp_path / "window.json", tmp_path / "signals"
    signals.mkdir()
    with PsCluster([str(out), str(signals)], script=WINDOW_JOB) as job:
        deadline = time.monotonic() + TIMEOUT
        while not os.listdir(signals):
            assert time.monotonic() < deadline, "".join(job.output[-40:])
            assert job.procs["chief0"].poll() is None, "".join(
                job.output[-40:])
            time.sleep(0.1)
        (signal,) = os.listdir(signals)
        job.kill("worker" + signal[-1])
        assert job.wait_chief() == 0, "".join(job.output[-40:])
    run = json.loads(out.read_text())
    print(run)
    assert run["claimed"] == [1, 1, 1]
    assert run["steps"] == 3
    assert run["retried"] >= 1
    # The killed closure ran again on worker 0 and found its claim.
    assert sorted(run["attempts"]) == [1, 1, 2], run["attempts"]
    retried_id = run["attempts"].index(2)
    assert run["completed"][retried_id] == 0
    assert run["applied"][retried_id] is False
    # That update lost, the other two landed once each, and `completed`
    # counts only writes that landed.
    assert run["total"] == sum(run["completed"]) == 2


@pytest.mark.slow
def test_async_accuracy_is_within_2_points_of_sync(tmp_path,
                                                   shapes_data_dir):
    """Issue 16: the local PS cluster (2 workers, truly asynchronous, no
    fault) trains the small CNN to within 2 points of one device's
    synchronous test accuracy over the same examples.

    1000 steps of 64 (3.2 epochs), Adam 1e-3 warmed up linearly over the
    first 150 steps (asynchronous: the Trainer's `async_warmup_steps`;
    synchronous: the same schedule) and stepped down over the last 30%, in
    both runs. docs/parameter_server.md states this bound. Both
    converge; the warm-up is what makes the asynchronous run reliable:
    without it the model sits at chance for 100-400 steps, longer with
    stale gradients, and async ended 92.2-97.1% against sync 96.7% (within
    2 points in 5 of 8 runs; at 500 steps 78-90%, once 38%). With it:
    BUILD_NOTES, issue 16."""
    out, sync_out = tmp_path / "async.json", tmp_path / "sync.json"
    env = dict(os.environ, PS_JOB_STEPS=str(ACCURACY_STEPS),
               PS_JOB_BATCH="64", PS_JOB_LOOP="100", PS_JOB_WARMUP="150")
    golden = subprocess.Popen(
        [sys.executable, JOB, "sync", str(sync_out), shapes_data_dir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=env)
    try:
        with PsCluster(["async", str(out), shapes_data_dir], env=env) as job:
            assert job.wait_chief(ACCURACY_TIMEOUT) == 0, "".join(
                job.output[-40:])
        out_text, _ = golden.communicate(timeout=ACCURACY_TIMEOUT)
        assert golden.returncode == 0, out_text[-3000:]
    finally:
        subproc._kill(golden)
    sync, run = (json.loads(p.read_text()) for p in (sync_out, out))
    assert run["step"] == sync["step"] == ACCURACY_STEPS
    # Every step claimed exactly once (at most once, and none skipped).
    # Nothing is killed here, but on a slow or loaded machine TensorFlow
    # may still retry a closure (a worker slow to answer), and an update
    # cut off that way is lost, never applied twice: counted, not failed.
    claimed, completed = run["claimed"], run["completed"]
    lost = sum(claimed) - sum(completed)
    assert claimed == [1] * ACCURACY_STEPS, sorted(set(claimed))
    assert all(c in (0, 1) for c in completed), sorted(set(completed))
    assert lost == run["history"]["lost_updates"][-1]
    gap = run["accuracy"] - sync["accuracy"]
    print(f"sync accuracy {sync['accuracy']:.4f}, async "
          f"{run['accuracy']:.4f} (async - sync {100 * gap:+.2f} points); "
          f"retried closures {run['history']['retried_closures'][-1]}, "
          f"lost updates {lost}")
    assert sync["accuracy"] > 0.93  # converged: the comparison means something
    assert abs(gap) <= ACCURACY_TOLERANCE, (sync["accuracy"],
                                           run["accuracy"])


def test_async_clipping_on_one_worker_equals_one_device(tmp_path,
                                                       shapes_data_dir):
    """The asynchronous step clips as the synchronous one does: with one
    worker every update is applied before the next is computed, so 20
    steps clipped to a global norm of 0.05 give one device's weights and
    losses (same batches), to 1e-5; unclipped, one device ends elsewhere
    (the bound was active)."""
    out = {name: tmp_path / f"{name}.json"
           for name in ("async", "sync", "unclipped")}
    env = dict(os.environ, PS_JOB_STEPS="20", PS_JOB_BATCH="32",
               PS_JOB_LOOP="10", PS_JOB_CLIP="0.05")
    golden = {name: subprocess.Popen(
        [sys.executable, JOB, "sync", str(out[name]), shapes_data_dir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(env, PS_JOB_CLIP=clip))
        for name, clip in (("sync", "0.05"), ("unclipped", "1e9"))}
    try:
        with PsCluster(["async", str(out["async"]), shapes_data_dir],
                       env=env, workers=1) as job:
            assert job.wait_chief(TIMEOUT) == 0, "".join(job.output[-40:])
        for proc in golden.values():
            text, _ = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, text[-3000:]
    finally:
        for proc in golden.values():
            subproc._kill(proc)
    run, sync = (json.loads(out[n].read_text()) for n in ("async", "sync"))
    assert run["step"] == sync["step"] == 20
    np.testing.assert_allclose(run["history"]["loss"],
                               sync["history"]["loss"], rtol=1e-5)
    weights = {n: np.load(f"{out[n]}.npy") for n in out}
    np.testing.assert_allclose(weights["async"], weights["sync"], atol=1e-5)
    assert np.abs(weights["unclipped"] - weights["sync"]).max() > 1e-3


# -- the launcher (a TensorFlow-free stand-in task) ---------------------------


def _assert_none_running(tmp_path):
    import psutil
    pids = [int((tmp_path / n).read_text()) for n in os.listdir(tmp_path)
            if n.startswith("pid-")]
    alive = [p for p in pids if psutil.pid_exists(p) and
             psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"tasks left running: {alive}"
    return pids


def test_launch_ps_survives_a_dead_worker_and_restarts_on_a_dead_ps(
        tmp_path, capfd):
    """In process (the launcher is plain Python): worker 1 exits 3 at once
    in every attempt and the group carries on; the ps exits 3 in attempt 0
    and the whole group restarts; attempt 1's chief exits 0."""
    from tfmulti import launch
    child = [sys.executable, os.path.join(HERE, "workers",
                                          "ps_launch_child.py"),
             "psfail", str(tmp_path)]
    code = launch.launch(child, launch.LaunchOptions(
        workers=2, ps=1, max_restarts=1, timeout=120))
    out, err = capfd.readouterr()
    assert code == 0, err
    for attempt in (0, 1):
        for line in (f"[chief] chief0 attempt {attempt}",
                     f"[w0] worker0 attempt {attempt}",
                     f"[w1] worker1 attempt {attempt}",
                     f"[ps0] ps0 attempt {attempt}"):
            assert line in out
    # The one restart is the ps's: worker 1's exit restarted nothing.
    assert re.findall(r"restarting", err) == ["restarting"], err
    assert "ps 0 exited with code 3; restarting" in err
    assert len(_assert_none_running(tmp_path)) == 8


def test_launch_rejects_negative_ps():
    from tfmulti import launch
    with pytest.raises(ValueError, match=r"`--ps` should be an integer >= 0"):
        launch.LaunchOptions(workers=2, ps=-1)


# -- cluster templates --------------------------------------------------------

TEMPLATES = os.path.join(os.path.dirname(HERE), "recipes", "cluster")


def test_slurm_parameter_server_roles():
    env = {"SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "n[1-5]",
           "TFMULTI_NUM_PS": "2"}
    configs = [cl.cluster_config(environ=dict(env, SLURM_PROCID=str(r)))
               for r in range(5)]
    assert [(c.task_type, c.task_index) for c in configs] == [
        ("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    assert dict(configs[0].cluster) == {
        "chief": ("n1:23456",), "ps": ("n2:23456", "n3:23456"),
        "worker": ("n4:23456", "n5:23456")}
    with pytest.raises(ValueError, match=r"`TFMULTI_NUM_PS` is 4 but the "
                       r"job has 5 task\(s\)"):
        cl.cluster_config(environ=dict(env, SLURM_PROCID="0",
                                       TFMULTI_NUM_PS="4"))


def test_slurm_ps_template_sets_the_roles_and_stops_the_servers():
    text = open(os.path.join(TEMPLATES, "slurm-ps.sbatch")).read()
    assert "TFMULTI_NUM_PS" in text
    assert "--strategy=parameter_server" in text
    assert "metrics.json" in text  # the chief's last write ends the step
    subprocess.run(["bash", "-n", os.path.join(TEMPLATES, "slurm-ps.sbatch")],
                   check=True)


def test_tfjob_ps_template_gives_a_valid_parameter_server_cluster():
    import yaml
    with open(os.path.join(TEMPLATES, "tfjob-ps.yaml")) as f:
        job = yaml.safe_load(f)
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker", "PS"}
    for spec in specs.values():
        container = spec["template"]["spec"]["containers"][0]
        assert "--strategy=parameter_server" in container["args"]
    # The TF_CONFIG the operator writes: lower-case roles, one address each.
    name = job["metadata"]["name"]
    cluster = {role.lower(): [f"{name}-{role.lower()}-{i}.default.svc:2222"
                              for i in range(spec["replicas"])]
               for role, spec in specs.items()}
    config = cl.cluster_config({"cluster": cluster,
                                "task": {"type": "ps", "index": 1}})
    assert (config.num_ps, config.is_chief) == (2, False)
