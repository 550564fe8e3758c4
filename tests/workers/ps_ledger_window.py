"""The ClosureLedger's at-most-once window, forced open (issue 16).

Run as every role of a loopback cluster (chief + 2 workers + 1 ps; see
`tests/test_parameter_server.py::PsCluster`). The chief schedules CLOSURES
closures through a real `ClusterCoordinator`; each claims its update on the
ps, then computes on its worker for WINDOW seconds before its write lands on
the ps: the window in which a worker's death cuts an update off. Each
closure's worker writes SIGNAL_DIR/claimed-<id>-worker<index> as it enters
the window; the test SIGKILLs that worker at the first. Writes {"claimed", "completed",
"attempts", "total", "retried", "steps", "applied"} to OUT_JSON ("total":
the writes that landed).

Usage: ps_ledger_window.py OUT_JSON SIGNAL_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

OUT, SIGNAL_DIR = sys.argv[1:3]
CLOSURES = 3
WINDOW = 6.0

strategy = tfmulti.create_strategy("parameter_server",
                                   stall_timeout_seconds=120)

import tensorflow as tf  # noqa: E402

from tfmulti import parameter_server  # noqa: E402
from tfmulti.training import closure_ledger, coordinator_watch  # noqa: E402

coordinator = parameter_server.coordinator(strategy)
retries = coordinator_watch.RetryCounter(coordinator)
with strategy.scope():
    steps = tf.Variable(0, dtype=tf.int64, trainable=False)
    total = tf.Variable(0, dtype=tf.int64, trainable=False)
ledger = closure_ledger.ClosureLedger(strategy, CLOSURES, steps=steps)


def apply(update, closure_id, worker):
    # Back on the worker that runs the closure (out of the ledger's ps
    # device scope): busy until WINDOW seconds after the claim.
    with tf.device(None):
        signal = tf.io.write_file(tf.strings.join(
            [SIGNAL_DIR, "/claimed-", tf.strings.as_string(closure_id),
             "-worker", tf.strings.as_string(worker)]), "")
        with tf.control_dependencies([signal]):
            start = tf.timestamp()
        _, busy = tf.while_loop(
            lambda i, x: tf.timestamp() < start + WINDOW,
            lambda i, x: (i + 1, tf.tanh(tf.matmul(x, x))),
            (tf.constant(0), tf.random.normal([64, 64])))
        update = update + tf.cast(tf.reduce_sum(busy) * 0.0, tf.int64)
    total.assign_add(update)


@tf.function
def closure(closure_id):
    ledger.count_attempt(closure_id)
    # Here, not inside the ledger's conditional: TensorFlow feeds it to
    # the closure's own graph only.
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    return ledger.guarded(
        closure_id, lambda update: apply(update, closure_id, worker),
        tf.constant(1, tf.int64), written=[total])


remote = [coordinator.schedule(closure, args=(tf.constant(i),))
          for i in range(CLOSURES)]
coordinator.join()
counts = ledger.counts()
result = {key: value.tolist() for key, value in counts.items()}
result.update(total=int(total.numpy()), retried=retries.value(),
              steps=int(steps.numpy()),
              applied=[bool(r.fetch()) for r in remote])
with open(OUT, "w") as f:
    json.dump(result, f)
print("done", json.dumps(result), flush=True)
