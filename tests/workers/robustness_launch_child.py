"""A stand-in worker for the launcher's fault tests: no TensorFlow, fast.

Usage: robustness_launch_child.py MODE DIR
  save        on SIGTERM write DIR/saved-<index> and exit 75 (a preempted
              worker that saved); otherwise sleep until signalled
  stubborn    worker 0 as `save`; the others ignore SIGTERM and SIGINT and
              sleep until killed
  one_hangs   worker 0 exits 0 at once, the others sleep until killed
Every worker writes its pid to DIR/pid-<index> first, and also starts a
grandchild (a `sleep`) in its process group whose pid goes to
DIR/grandchild-<index>: it must die with the worker.
"""

import json
import os
import signal
import subprocess
import sys
import time

mode, directory = sys.argv[1], sys.argv[2]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def saved(signum, frame):
    del signum, frame
    with open(os.path.join(directory, f"saved-{index}"), "w") as f:
        f.write("saved")
    sys.exit(75)


if mode == "save" or (mode == "stubborn" and index == 0):
    signal.signal(signal.SIGTERM, saved)
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
grandchild = subprocess.Popen(["sleep", "600"])
with open(os.path.join(directory, f"grandchild-{index}"), "w") as f:
    f.write(str(grandchild.pid))
with open(os.path.join(directory, f"pid-{index}"), "w") as f:
    f.write(str(os.getpid()))
print(f"worker {index} ready", flush=True)
if mode == "one_hangs" and index == 0:
    grandchild.kill()
    sys.exit(0)
time.sleep(600)
