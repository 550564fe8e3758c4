"""Bad inputs of the README's table that no other test file covers. The
others are asserted where their code is tested (the README's table names
the test for each row)."""

import json

import pytest

from tfmulti import cluster as cluster_lib
from tests.subproc import run_python


@pytest.mark.slow
def test_strategy_after_tensorflow_ran_ops_says_create_it_first():
    tf_config = cluster_lib.local_cluster(2)[0]
    _, out = run_python(["tests/workers/reliability_late_strategy.py"],
                        timeout=120, env={"TF_CONFIG": json.dumps(tf_config)})
    line = [l for l in out.splitlines() if l.startswith(("ERROR", "NO "))]
    assert line, out[-3000:]
    assert line[0].startswith(
        "ERROR RuntimeError: create_strategy('multi_worker') was called after"
        " TensorFlow had started running operations")
    assert "Create the strategy first thing in the program" in line[0]
