"""A stand-in task of a parameter-server job for launcher tests (no TF).

Usage: ps_launch_child.py MODE DIR
Every task prints its role and writes its pid to DIR/pid-<attempt>-<role>.
The chief exits 0 after 1.5 s; workers and parameter servers serve (sleep)
until stopped, except: worker 1 dies (exit 3) at once, in every mode; with
MODE=psfail the ps dies (exit 3) on the first attempt, and that attempt's
chief never finishes.
"""

import json
import os
import sys
import time

mode, directory = sys.argv[1], sys.argv[2]
task = json.loads(os.environ["TF_CONFIG"])["task"]
role = f"{task['type']}{task['index']}"
attempt = int(os.environ["TFMULTI_LAUNCH_ATTEMPT"])
with open(os.path.join(directory, f"pid-{attempt}-{role}"), "w") as f:
    f.write(str(os.getpid()))
print(f"{role} attempt {attempt}", flush=True)
if role == "worker1":
    sys.exit(3)
if mode == "psfail" and attempt == 0:
    if role == "ps0":
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(600)
if role == "chief0":
    time.sleep(1.5)
    sys.exit(0)
time.sleep(600)
