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

