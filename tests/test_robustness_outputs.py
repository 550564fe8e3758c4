"""The run's output directory: checked at start, results readable by others.

Real files: a metrics.json that is a directory, a model_dir under a file.
"""

import os
import stat

import pytest

from tfmulti import rundir


def test_metrics_json_is_written_readable_by_others(tmp_path):
    path = tmp_path / "metrics.json"
    old = os.umask(0o022)
    try:
        rundir.write_json_atomically(str(path), {"loss": 1.0})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_bad_output_dirs_fail_at_start_naming_the_path(tmp_path):
    (tmp_path / "run" / "metrics.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=(
            r"'.*/run/metrics.json' is a directory, so the run's results")):
        rundir.check_output_dir(str(tmp_path / "run"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=(
            r"`model_dir` '.*/afile/run' cannot be created \(Not a "
            r"directory")):
        rundir.check_output_dir(str(tmp_path / "afile" / "run"))
    rundir.check_output_dir(str(tmp_path / "fresh"))  # fine
