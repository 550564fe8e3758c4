"""`tfmulti doctor`: passes on this install, fails naming a broken check."""

import importlib.metadata
import json
import os
import re

from tests.subproc import run_python
from tfmulti import doctor


def test_doctor_passes_here():
    code, out = run_python(["-m", "tfmulti.doctor"], timeout=400,
                           check=False)
    assert code == 0, out
    for check in ("versions", "devices", "cluster", "trainer", "fit"):
        assert re.search(rf"^  ok    {check}: ", out, re.M), out
    # The self-check's measured 1-vs-2-replica differences are printed.
    diffs = re.findall(r"max weight difference (\S+) ", out)
    assert len(diffs) == 2 and all(float(d) <= 1e-5 for d in diffs), out
    # ... and training moved the weights far more than that.
    moved = re.findall(r"weights moved by up to (\S+)$", out, re.M)
    assert len(moved) == 2 and all(float(m) >= 1e-3 for m in moved), out
    assert "all 5 checks passed" in out, out


def test_doctor_fails_naming_the_check():
    bad = {"cluster": {"worker": ["localhost:23456", "nohost.invalid:23456"]},
           "task": {"type": "worker", "index": 0}}
    code, out = run_python(["-m", "tfmulti.doctor", "--only", "versions",
                            "cluster"], env={"TF_CONFIG": json.dumps(bad)},
                           timeout=120, check=False)
    assert code == 1, out
    assert re.search(r"^  FAIL  cluster: TF_CONFIG: .*nohost.invalid:23456 "
                     r"does not resolve", out, re.M), out
    assert re.search(r"^  ok    versions: ", out, re.M), out
    assert out.strip().splitlines()[-1].startswith("FAILED: cluster"), out


def test_versions_check_fails_outside_the_declared_range():
    version = importlib.metadata.version("tensorflow")
    result = doctor.check_versions({"tensorflow": "<2", "keras": ">=3"})
    assert not result.ok
    assert result.detail.startswith(
        f"tensorflow {version} is outside <2. Install a supported pair: "
        "pip install -e . (tensorflow<2, keras>=3)"), result.detail


def test_devices_check_fails_on_gpus_tensorflow_does_not_see(tmp_path,
                                                             monkeypatch):
    # A driver that lists two GPUs (this machine has none for TensorFlow).
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-0)'\n"
                   "echo 'GPU 1: Fake (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = doctor.check_devices()
    assert not result.ok
    assert re.search(
        r"0 GPU; .*\. nvidia-smi lists 2 GPU\(s\) that TensorFlow does not "
        r"see: install tensorflow\[and-cuda\]", result.detail), result.detail


def test_selfchecks_fail_on_an_update_that_does_nothing_or_differs():
    """Learning rate 0 on one device (the update does nothing: it matched
    itself before the weights had to move) and 0.05 on 2 replicas (they
    train differently): both self-checks fail, each naming both."""
    results = doctor.check_equivalence(2, 1e-5,
                                       learning_rates={1: 0.0, 2: 0.05})
    assert [r.name for r in results] == ["trainer", "fit"]
    for result in results:
        assert not result.ok
        assert re.search(
            r"^2 simulated CPU replicas vs 1 device, 8 steps: max weight "
            r"difference (\S+) \(tolerance 1e-05\); weights moved by up to "
            r"0\.0e\+00\. The 2 replicas train differently from one device: "
            r"this install's distributed step is wrong \(see "
            r"docs/conformance\.md\)\. Training did not move the weights "
            r"\(largest change on 1 device\(s\): 0\.0e\+00; at least 0\.001 "
            r"expected\): an update that does nothing would pass the "
            r"comparison, so it proves nothing$", result.detail
        ), result.detail
