"""A stand-in worker for launcher tests: no TensorFlow, fast.

Usage: launch_child.py MODE DIR
  ok         print the TF_CONFIG index and exit 0
  fail1      worker 1 exits 3; the others wait to be stopped
  flaky      worker 1 exits 3 on the first attempt only, then all succeed
  hang       every worker sleeps until killed
Each worker writes its pid to DIR/pid-<attempt>-<index> so the test can check
that nothing is left running.
"""

import json
import os
import sys
import time

mode, directory = sys.argv[1], sys.argv[2]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
attempt = int(os.environ["TFMULTI_LAUNCH_ATTEMPT"])
with open(os.path.join(directory, f"pid-{attempt}-{index}"), "w") as f:
    f.write(str(os.getpid()))
print(f"hello from worker {index} attempt {attempt}", flush=True)
if mode == "ok" or (mode == "flaky" and (attempt > 0 or index != 1)):
    time.sleep(0.5)
    sys.exit(0)
if mode in ("fail1", "flaky") and index == 1:
    sys.exit(3)
time.sleep(600)
