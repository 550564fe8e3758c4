"""README's two commands: the main job reaches the accuracy README states,
and CI runs exactly README's test command (with the slowest tests listed)."""

import configparser
import json
import pathlib
import re

import pytest

from tests.subproc import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _fenced_command(after):
    """The first command in a ```sh block after the text `after`."""
    match = re.search(re.escape(after) + r".*?```sh\n(.*?)\n```", README,
                      re.S)
    assert match, f"README has no command block after {after!r}"
    return match.group(1).strip()


def test_ci_runs_readme_test_command_and_lists_the_slowest_tests():
    command = _fenced_command("Tests (")
    assert command == "pip install -e '.[test]' && python -m pytest"
    ci_lines = [line.strip() for line in
                (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert "--durations=15" in config["tool:pytest"]["addopts"].split()


@pytest.mark.slow
def test_main_job_reaches_the_stated_test_accuracy(tmp_path, shapes_data_dir):
    # README's main-job command at its defaults (3 epochs of the small CNN
    # on 2 simulated replicas), on the offline dataset the suite prepares.
    command = _fenced_command("Main job:")
    assert command == ("pip install -e . && python -m recipes.keras_fit "
                       "--cpu_replicas=2")
    low, high = (float(v) / 100 for v in re.search(
        r"test accuracy (\d+)-(\d+)%, tested at the\s+default seed", README
    ).groups())
    run_python(["-m", "recipes.keras_fit", "--cpu_replicas=2",
                f"--model_dir={tmp_path / 'run'}",
                f"--data_dir={shapes_data_dir}"], timeout=900)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    accuracy = metrics["eval"]["accuracy"]
    print(f"main job: test accuracy {accuracy:.4f}, "
          f"{metrics['examples_per_sec']:.0f} examples/s")
    assert metrics["num_replicas"] == 2
    assert low <= accuracy <= high, (accuracy, low, high)
