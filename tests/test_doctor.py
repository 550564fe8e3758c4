"""`tfmulti doctor`: passes on this install, fails naming a broken check."""

import json
import re

from tests.subproc import run_python


def test_doctor_passes_here():
    code, out = run_python(["-m", "tfmulti.doctor"], timeout=400,
                           check=False)
    assert code == 0, out
    for check in ("versions", "devices", "cluster", "trainer", "fit"):
        assert re.search(rf"^  ok    {check}: ", out, re.M), out
    # The self-check's measured 1-vs-2-replica differences are printed.
    diffs = re.findall(r"max weight difference (\S+) ", out)
    assert len(diffs) == 2 and all(float(d) <= 1e-5 for d in diffs), out
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
