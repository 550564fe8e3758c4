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
