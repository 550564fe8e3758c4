"""Prepares a small `tfmulti_shapes` into DATA_DIR, as every worker of a job
would at start-up; prints the split sizes it then reads.

Usage: data_prepare_worker.py DATA_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tfmulti.data import shapes  # noqa: E402

# Small splits keep the race short; the code path is the full one.
shapes.SPLIT_SIZES = {"train": 400, "test": 160}
builder = shapes.prepare_default(sys.argv[1])
print("SIZES " + json.dumps({name: split.shard_lengths for name, split
                             in builder.info.splits.items()}))
