"""ClusterConfig parsing: valid layouts and every malformed input."""

import json

import pytest

from tfmulti import cluster as cl


def test_single_process_when_nothing_is_set():
    c = cl.cluster_config(environ={})
    assert (c.num_workers, c.is_chief, c.worker_addresses) == (1, True, ())
    assert c.tf_config() == {}


def test_multi_worker_from_environment():
    tf_config = {"cluster": {"worker": ["a:1", "b:2", "c:3"]},
                 "task": {"type": "worker", "index": 2}}
    c = cl.cluster_config(environ={"TF_CONFIG": json.dumps(tf_config)})
    assert c.num_workers == 3
    assert c.worker_addresses == ("a:1", "b:2", "c:3")
    assert not c.is_chief
    assert c.worker_rank == 2
    assert c.tf_config() == tf_config
    assert cl.cluster_config(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker",
                                                  "index": 0}}).is_chief


def test_chief_is_the_chief_and_worker_zero_is_not():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    chief = cl.cluster_config({"cluster": cluster,
                               "task": {"type": "chief", "index": 0}})
    worker0 = cl.cluster_config({"cluster": cluster,
                                 "task": {"type": "worker", "index": 0}})
    assert chief.is_chief and not worker0.is_chief
    assert chief.num_workers == 3
    assert chief.worker_addresses == ("c:1", "w:1", "w:2")
    assert (chief.worker_rank, worker0.worker_rank) == (0, 1)


def test_evaluator_is_not_a_training_worker():
    c = cl.cluster_config({"cluster": {"worker": ["w:1"], "evaluator": ["e:1"]},
                           "task": {"type": "evaluator", "index": 0}})
    assert c.num_workers == 1 and not c.is_chief


def test_config_is_frozen():
    c = cl.cluster_config(environ={})
    with pytest.raises(Exception):
        c.task_index = 3


@pytest.mark.parametrize("tf_config, field", [
    ("{not json", "`TF_CONFIG` is not valid JSON"),
    ('["worker"]', "`TF_CONFIG` should be a JSON object"),
    ({"task": {"type": "worker", "index": 0}}, "no `cluster`"),
    ({"cluster": {"worker": ["a:1"]}}, "no `task`"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}},
     "`task.type` is 'chief'"),
    ({"cluster": {"worker": ["a:1", "b:1"]},
      "task": {"type": "worker", "index": 2}}, "`task.index` is 2"),
    ({"cluster": {"worker": ["a:1", "b:1"]},
      "task": {"type": "worker", "index": -1}}, "`task.index` is -1"),
    ({"cluster": {"worker": ["a:1", "a:1"]},
      "task": {"type": "worker", "index": 0}}, "both 'a:1'"),
    ({"cluster": {"chief": ["a:1"], "worker": ["a:1"]},
      "task": {"type": "worker", "index": 0}}, "both 'a:1'"),
    ({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}},
     "`cluster.worker[0]` is 'a'"),
    ({"cluster": {"worker": ["a:port"]},
      "task": {"type": "worker", "index": 0}}, "no valid port"),
    ({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}},
     "`cluster.worker` should be a list"),
    ({"cluster": {"ps": ["p:1"], "worker": ["a:1"]},
      "task": {"type": "worker", "index": 0}}, "needs a `cluster.chief`"),
    ({"cluster": {"parameter_server": ["p:1"], "worker": ["a:1"]},
      "task": {"type": "worker", "index": 0}},
     "task type 'parameter_server'"),
    ({"cluster": {"chief": ["a:1", "b:1"]},
      "task": {"type": "chief", "index": 0}}, "only one chief"),
])
def test_malformed_tf_config_names_the_field(tf_config, field):
    with pytest.raises(ValueError) as e:
        cl.cluster_config(tf_config)
    assert field in str(e.value)


def test_error_shows_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        cl.cluster_config({"cluster": {"worker": ["a:1", "b:1"]},
                           "task": {"type": "worker", "index": 5}})
    with pytest.raises(ValueError, match="'host:port'"):
        cl.cluster_config({"cluster": {"worker": ["nohost"]},
                           "task": {"type": "worker", "index": 0}})


def test_local_cluster_gives_distinct_loopback_ports():
    configs = cl.local_cluster(3)
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for i, c in enumerate(configs):
        parsed = cl.cluster_config(c)
        assert parsed.task_index == i and parsed.num_workers == 3
    with pytest.raises(ValueError, match="`num_workers`"):
        cl.local_cluster(0)


@pytest.mark.parametrize("nodelist, ntasks, per_node, expected", [
    ("node[01-04,07]", "5", None,
     ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu1,gpu2", "2", None, ["gpu1", "gpu2"]),
    ("n[1-2]", "4", "2(x2)", ["n1", "n1", "n2", "n2"]),
])
def test_slurm_derivation(nodelist, ntasks, per_node, expected):
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": ntasks,
               "SLURM_JOB_NODELIST": nodelist, "TFMULTI_PORT": "30000"}
    if per_node:
        environ["SLURM_TASKS_PER_NODE"] = per_node
    c = cl.cluster_config(environ=environ)
    assert [a.rsplit(":", 1)[0] for a in c.worker_addresses] == expected
    assert c.task_index == 1 and not c.is_chief
    assert len(set(c.worker_addresses)) == len(expected)
    if per_node:
        assert c.worker_addresses[:2] == ("n1:30000", "n1:30001")


def test_slurm_step_on_part_of_the_allocation_is_a_cluster_of_its_nodes():
    """`srun --nodelist=n[3-4]` inside a 4-node job (the other nodes serving
    tf.data): rank and task count are the step's, and so are the nodes."""
    c = cl.cluster_config(environ={
        "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_TASKS_PER_NODE": "1(x4)",
        "SLURM_STEP_NODELIST": "n[3-4]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "TFMULTI_PORT": "30000"})
    assert c.worker_addresses == ("n3:30000", "n3:30001", "n4:30000",
                                  "n4:30001")
    assert c.task_index == 1


def test_slurm_errors_name_the_variable():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(ValueError, match="`SLURM_PROCID` is 3"):
        cl.cluster_config(environ=dict(base, SLURM_PROCID="3"))
    with pytest.raises(ValueError, match="`SLURM_NTASKS`"):
        cl.cluster_config(environ=dict(base, SLURM_NTASKS="x"))
    with pytest.raises(ValueError, match="`SLURM_JOB_NODELIST`"):
        cl.cluster_config(environ=dict(base, SLURM_JOB_NODELIST="n[1-"))
    with pytest.raises(ValueError, match="`SLURM_NTASKS`=3"):
        cl.cluster_config(environ=dict(base, SLURM_NTASKS="3"))
    with pytest.raises(ValueError, match="`SLURM_STEP_NODELIST`"):
        cl.cluster_config(environ=dict(base, SLURM_STEP_NODELIST="n[3-"))


def test_tf_config_wins_over_slurm():
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
               "SLURM_JOB_NODELIST": "n[1-2]",
               "TF_CONFIG": json.dumps({"cluster": {"worker": ["x:1"]},
                                        "task": {"type": "worker",
                                                 "index": 0}})}
    assert cl.cluster_config(environ=environ).worker_addresses == ("x:1",)


@pytest.mark.parametrize("pod_env, index", [
    ({"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "trainer-2-abcde"}, 2),
    ({"HOSTNAME": "trainer-1"}, 1),
])
def test_kubernetes_derivation(pod_env, index):
    environ = dict(pod_env, TFMULTI_NUM_WORKERS="3",
                   TFMULTI_WORKER_HOST="trainer-{index}.trainer")
    c = cl.cluster_config(environ=environ)
    assert c.worker_addresses == ("trainer-0.trainer:23456",
                                  "trainer-1.trainer:23456",
                                  "trainer-2.trainer:23456")
    assert c.task_index == index


def test_kubernetes_errors():
    with pytest.raises(ValueError, match="`TFMULTI_WORKER_HOST`"):
        cl.cluster_config(environ={"TFMULTI_NUM_WORKERS": "2",
                                   "TFMULTI_WORKER_HOST": "trainer",
                                   "HOSTNAME": "trainer-0"})
    with pytest.raises(ValueError, match="`HOSTNAME` is 'box'"):
        cl.cluster_config(environ={"TFMULTI_NUM_WORKERS": "2",
                                   "TFMULTI_WORKER_HOST": "t-{index}.t",
                                   "HOSTNAME": "box"})
    with pytest.raises(ValueError, match="`task.index` is 5"):
        cl.cluster_config(environ={"TFMULTI_NUM_WORKERS": "2",
                                   "TFMULTI_WORKER_HOST": "t-{index}.t",
                                   "HOSTNAME": "t-5"})


def test_of_strategy_reads_the_resolver_and_applies_the_chief_rule():
    import tensorflow as tf

    def strategy_with(spec, task_type, task_id):
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type=task_type, task_id=task_id)
        return type("Strategy", (), {"cluster_resolver": resolver})()

    spec = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    assert cl.of_strategy(strategy_with(spec, "chief", 0)).is_chief
    worker0 = cl.of_strategy(strategy_with(spec, "worker", 0))
    assert not worker0.is_chief and worker0.num_workers == 3
    assert cl.of_strategy(strategy_with({}, None, None)) == cl.ClusterConfig()
    assert cl.of_strategy(object()).is_chief  # OneDevice: no resolver
