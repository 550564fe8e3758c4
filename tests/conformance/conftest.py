"""Shared runs of the conformance cases: one subprocess per device layout."""

import json

import pytest

from tests.subproc import run_python, run_workers

LOCAL = "tests/conformance/cases_local.py"
MULTI_WORKER = "tests/conformance/cases_multi_worker.py"


@pytest.fixture(scope="session")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance") / "local.json"
    run_python([LOCAL, str(out)], timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def multi_worker(tmp_path_factory):
    """Each worker's results (the golden run is `local["dict_inputs"]`)."""
    tmp = tmp_path_factory.mktemp("conformance_mw")
    run_workers([MULTI_WORKER, str(tmp / "worker{index}.json")], 2,
                timeout=300)
    return [json.loads((tmp / f"worker{i}.json").read_text())
            for i in range(2)]


def ok(node):
    """The result of a case that must have run, or the failure's text."""
    assert "error" not in node, node.get("trace", node["error"])
    return node["result"]


def error_of(node):
    assert "error" in node, f"expected an error, got {node}"
    return node["error"]


