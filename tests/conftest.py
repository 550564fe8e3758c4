"""Test set-up: the repo root on sys.path here and in every subprocess."""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shapes_builder(tmp_path_factory):
    """`tfmulti_shapes` generated and prepared from scratch, once a session."""
    from tfmulti.data import shapes
    return shapes.prepare_default(
        str(tmp_path_factory.getbasetemp() / "tfds"))


@pytest.fixture(scope="session")
def shapes_data_dir(shapes_builder):
    """The TFDS data dir holding the prepared `tfmulti_shapes`."""
    return shapes_builder.data_dir_root
