"""Workers started with different settings stop before training, naming it.

Two real worker processes (MultiWorkerMirroredStrategy on loopback), three
mismatches in one run: global batch size; grad_accum_steps and
steps_per_loop;
a `model_dir` that is not shared (restored steps differ).
"""

import pytest

from tests import subproc

WORKER = "tests/workers/robustness_agreement.py"


@pytest.mark.slow
def test_workers_that_differ_fail_clearly_before_training(tmp_path):
    results = subproc.run_workers([WORKER, str(tmp_path)], 2, timeout=400)
    for rank, (_, out) in enumerate(results):
        assert "DONE" in out, out[-3000:]
        lines = {line[:6]: line for line in out.splitlines()
                 if line.startswith("CASE ")}
        assert ("`global_batch_size` differs across workers (worker 0 has "
                "16, worker 1 has 32)") in lines["CASE 1"], out[-3000:]
        assert "ConfigMismatchError" in lines["CASE 1"]
        assert ("`grad_accum_steps` differs across workers (worker 0 has 1, "
                "worker 1 has 2)") in lines["CASE 2"]
        assert ("`steps_per_loop` differs across workers (worker 0 has 1, "
                "worker 1 has 2)") in lines["CASE 2"]
        assert ("the workers do not read the same checkpoint. Put "
                "`model_dir` on a filesystem every worker can read"
                ) in lines["CASE 3"]
