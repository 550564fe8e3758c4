"""The SLURM and Kubernetes templates give each worker the right TF_CONFIG.

The Kubernetes manifests are read as written (their env values), with the pod
environment Kubernetes would add simulated. Two real workers whose cluster
comes only from SLURM's variables run in tests/test_multi_worker_fit.py.
"""

import pathlib
import re

import yaml

from tfmulti import cluster as cl

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "cluster"


def _container(doc):
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_indexed_job_env_gives_every_pod_its_place():
    docs = list(yaml.safe_load_all((TEMPLATES / "indexed-job.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    env = {e["name"]: e["value"] for e in _container(job)["env"]}
    workers = job["spec"]["completions"]
    assert int(env["TFMULTI_NUM_WORKERS"]) == workers
    # Pods are named <job>-<index>.<subdomain>; the pattern must match that.
    assert job["spec"]["template"]["spec"]["subdomain"] == (
        service["metadata"]["name"])
    assert env["TFMULTI_WORKER_HOST"] == (
        f"{job['metadata']['name']}-{{index}}.{service['metadata']['name']}")
    assert int(env["TFMULTI_PORT"]) == service["spec"]["ports"][0]["port"]
    configs = [cl.cluster_config(environ=dict(
        env, JOB_COMPLETION_INDEX=str(i), HOSTNAME=f"tfmulti-{i}"))
        for i in range(workers)]
    assert [c.task_index for c in configs] == list(range(workers))
    assert configs[0].worker_addresses == tuple(
        f"tfmulti-{i}.tfmulti:23456" for i in range(workers))
    assert [c.is_chief for c in configs] == [True] + [False] * (workers - 1)
    assert "--strategy=multi_worker" in _container(job)["args"]


def test_tfjob_runs_the_recipe_as_multi_worker():
    job = yaml.safe_load((TEMPLATES / "tfjob.yaml").read_text())
    worker = job["spec"]["tfReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "recipes.keras_fit"]
    assert "--strategy=multi_worker" in container["args"]
    # What the operator sets in pod 1 of this TFJob, parsed as tfmulti does.
    addresses = [f"tfmulti-worker-{i}.default.svc:2222"
                 for i in range(worker["replicas"])]
    c = cl.cluster_config({"cluster": {"worker": addresses},
                           "task": {"type": "worker", "index": 1}})
    assert c.num_workers == worker["replicas"] and not c.is_chief


def test_slurm_script_runs_one_task_per_node_as_multi_worker():
    script = (TEMPLATES / "slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script
    assert re.search(r"srun .*python -m recipes.keras_fit", script)
    assert "--strategy=multi_worker" in script



# Stand-ins for the SLURM commands the data-service script calls: `scontrol
# show hostnames` lists FAKE_NODES; `srun` starts its command once per task
# (SLURM_PROCID, SLURM_NTASKS and SLURM_STEP_NODELIST as srun sets them) and
# stops them on SIGTERM. `python` records each start and stands for a server
# that dies after a second, or the training, which takes TRAIN_SECONDS.
_FAKE_SCONTROL = """#!/bin/bash
tr ',' '\\n' <<< "$FAKE_NODES"
"""
_FAKE_SRUN = """#!/bin/bash
ntasks=1; nodelist=
while [[ $1 == --* ]]; do
  case $1 in --ntasks=*) ntasks=${1#*=};; --nodelist=*) nodelist=${1#*=};; esac
  shift
done
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM
for ((i = 0; i < ntasks; i++)); do
  SLURM_PROCID=$i SLURM_NTASKS=$ntasks SLURM_STEP_NODELIST=$nodelist \\
    "$@" & pids+=($!)
done
wait
"""
_FAKE_PYTHON = """#!/bin/bash
echo "$SLURM_STEP_NODELIST $SLURM_PROCID ${TFMULTI_DATA_SERVICE:-} $*" \\
  >> "$FAKE_LOG"
if [[ $* == *recipes.keras_fit* ]]; then sleep "$TRAIN_SECONDS"; exit 0; fi
sleep 1; exit 1
"""


def test_slurm_data_service_script_splits_nodes_and_restarts_servers(
        tmp_path):
    import os
    import subprocess
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", _FAKE_SCONTROL), ("srun", _FAKE_SRUN),
                       ("python", _FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "starts.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               FAKE_NODES="n1,n2,n3,n4", FAKE_LOG=str(log), DATA_NODES="2",
               TRAIN_SECONDS="8", SLURM_JOB_NODELIST="n[1-4]",
               SLURM_JOB_ID="7", MODEL_DIR=str(tmp_path / "run"))
    script = str(TEMPLATES / "slurm-data-service.sbatch")
    done = subprocess.run(["bash", script, "--epochs=1"], env=env,
                          capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr
    starts = [line.split(" ", 3) for line in log.read_text().splitlines()]
    train = [s for s in starts if "recipes.keras_fit" in s[3]]
    # The training step on the other nodes, one task each, every one told
    # where the dispatcher is.
    assert sorted((s[0], s[1]) for s in train) == [("n3,n4", "0"),
                                                   ("n3,n4", "1")]
    assert {s[2] for s in train} == {"n1:5050"}
    assert all("--strategy=multi_worker" in s[3] and "--epochs=1" in s[3]
               for s in train)
    dispatcher = [s for s in starts if " dispatcher " in f" {s[3]} "]
    workers = [s for s in starts if " worker " in f" {s[3]} "]
    assert {s[0] for s in dispatcher} == {"n1"}
    assert f"--work_dir={tmp_path / 'run'}/data-service-journal" in (
        dispatcher[0][3])
    assert {(s[0], s[1]) for s in workers} == {("n1,n2", "0"),
                                               ("n1,n2", "1")}
    assert all("--dispatcher=n1:5050 --port=5051" in s[3] for s in workers)
    # Servers that exit come back (each died after a second, every 5 s).
    assert len(dispatcher) >= 2 and len(workers) >= 4
    # Nothing of the job is left running.
    assert subprocess.run(["pgrep", "-f", str(bin_dir)],
                          capture_output=True).stdout == b""

    too_few = subprocess.run(["bash", script], env=dict(env, DATA_NODES="4"),
                             capture_output=True, text=True, timeout=30)
    assert too_few.returncode == 2
    assert "DATA_NODES=4 leaves none of the 4 nodes" in too_few.stderr


def test_kubernetes_data_service_names_agree():
    """data-service.yaml: each data worker advertises its stable pod DNS
    name (Kubernetes restarts it there), the dispatcher address the workers
    and the training pods use is its Service, and the args parse."""
    from tfmulti.data import service_server
    docs = list(yaml.safe_load_all(
        (TEMPLATES / "data-service.yaml").read_text()))
    services = {d["metadata"]["name"]: d for d in docs
                if d["kind"] == "Service"}
    sets = {d["metadata"]["name"]: d for d in docs
            if d["kind"] == "StatefulSet"}
    dispatcher, worker = (_container(sets[name]) for name in (
        "tfmulti-data-dispatcher", "tfmulti-data-worker"))
    port = services["tfmulti-data-dispatcher"]["spec"]["ports"][0]["port"]
    d_args = service_server.parser().parse_args(
        dispatcher["command"][3:] + dispatcher["args"])
    assert d_args.role == "dispatcher" and d_args.port == port
    assert d_args.work_dir == dispatcher["volumeMounts"][0]["mountPath"]
    workers_service = sets["tfmulti-data-worker"]["spec"]["serviceName"]
    assert services[workers_service]["spec"]["clusterIP"] == "None"
    pod = "tfmulti-data-worker-2"  # what Kubernetes names replica 2
    assert worker["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name")
    w_args = service_server.parser().parse_args(
        worker["command"][3:] + [a.replace("$(POD_NAME)", pod)
                                 for a in worker["args"]])
    assert w_args.dispatcher == f"tfmulti-data-dispatcher:{port}"
    assert service_server.worker_host(w_args.dispatcher, w_args.worker_address
                                   ) == f"{pod}.{workers_service}"
    assert w_args.port == (
        services[workers_service]["spec"]["ports"][0]["port"])
    # The training pods' address, as the comment at the top gives it.
    assert f'value: "tfmulti-data-dispatcher:{port}"' in (
        TEMPLATES / "data-service.yaml").read_text()
