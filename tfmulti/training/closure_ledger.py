"""At most one update per closure of a parameter-server job.

TensorFlow's `ClusterCoordinator` runs a closure at least once, not exactly
once (a worker can die after its update reached the parameter servers and
before the coordinator heard back, and the retry would apply a second
update). Every closure of the asynchronous runner has an id, and the
`ClosureLedger` on the parameter servers lets one attempt per id claim the
right to update, after all its gradients arrived and before any write.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


class ClosureLedger:
    """Per-closure marks on the parameter servers: at most one update each.

    TensorFlow's coordinator runs a closure at least once, not exactly once:
    a worker that dies while its update is landing on the parameter servers
    has its closure run again on another worker. TensorFlow has no
    transaction over several variables (each write runs as soon as its own
    inputs arrive), so "update, then mark it done" applied one closure twice
    (measured: 126 steps after a 125-step job) and an atomic update is not
    possible. `guarded` therefore marks first, then updates: a retry of a
    marked closure applies nothing. The price is at-most-once: an update cut
    off by its worker's death is lost, possibly with some of its writes
    landed (like a gradient dropped, which asynchronous training tolerates),
    and `lost` counts them.

    `attempts[i]` counts the executions of closure `i` that started (more
    than one: retried); `claimed[i]` is 1 once an attempt took the right to
    update (never more, by construction); `completed[i]` is 1 once that
    update's writes have all landed. `steps` counts the claimed closures on
    top of the restored step: the Trainer's step.

    Args:
      strategy: the ParameterServerStrategy.
      size: the number of closure ids (steps of the job).
      steps: the job's step counter (int64 variable on the ps), shared by
        the ledgers of successive `fit` calls.
    """

    def __init__(self, strategy, size: int, *, steps):
        self.size = size
        self.steps = steps

        def counter(name):
            return tf.Variable(tf.zeros([size], tf.int32), trainable=False,
                               name=name)

        with strategy.scope():
            self.attempts = counter("closure_attempts")
            self.claimed = counter("closure_claimed")
            self.completed = counter("closure_completed")
        with tf.device(self.claimed.device):
            # A mutex on the ps: claim, update and completed mark of one
            # closure are one step (a retry arriving meanwhile waits, then
            # sees the claim), and the updates are serialised.
            self._lock = tf.CriticalSection(name="closure_ledger")

    def count_attempt(self, closure_id):
        self.attempts.scatter_nd_add([[closure_id]], [1])

    def guarded(self, closure_id, apply_fn, inputs, *, written):
        """Runs `apply_fn(inputs)` unless closure `closure_id` claimed one.

        Placed on the parameter server that holds the ledger. The claim
        waits for every input (the gradients) to arrive there, so a worker
        that dies before sending all of them leaves its closure unclaimed
        for the retry.

        Args:
          closure_id: int32 scalar, the closure's id (its step).
          apply_fn: the update, `apply_fn(inputs)`.
          inputs: a nest of tensors (from the worker).
          written: the variables `apply_fn` writes; their reads, which
            tf.function orders after the writes, are what `completed`
            waits for.

        Returns:
          bool scalar: whether this attempt applied the update.
        """
        with tf.device(self.claimed.device):
            # Every input on this device BEFORE the claim is read.
            # TensorFlow lowers tf.cond to Switch/Merge, whose branch ops
            # each start as soon as their own input arrives.
            arrived = [tf.identity(t) for t in
                       tf.nest.flatten(inputs, expand_composites=True)]

            def claim_and_apply():
                with tf.control_dependencies(arrived):
                    fresh = tf.equal(self.claimed[closure_id], 0)
                take = tf.cast(fresh, tf.int32)
                marks = [self.claimed.scatter_nd_add([[closure_id]], [take]),
                         self.steps.assign_add(tf.cast(take, tf.int64),
                                               read_value=False)]
                # The branch waits for the predicate, so for the marks:
                # the claim is set before any write of the update.
                with tf.control_dependencies(marks):
                    fresh = tf.identity(fresh)

                def apply():
                    apply_fn(inputs)
                    with tf.control_dependencies(
                            [tf.identity(v) for v in written]):
                        done = self.completed.scatter_nd_add(
                            [[closure_id]], [1])
                    with tf.control_dependencies([done]):
                        return tf.constant(True)

                return tf.cond(fresh, apply, lambda: tf.constant(False))

            # The section's lock is held until its output exists, which
            # waits for the completed mark. Not exclusive: the model's
            # variables are also read outside it (the forward pass), and
            # `steps` is shared by the ledgers of later fits.
            return self._lock.execute(claim_and_apply,
                                      exclusive_resource_access=False)

    def counts(self) -> dict:
        """{"attempts", "claimed", "completed"}: arrays read from the ps."""
        return {"attempts": self.attempts.numpy(),
                "claimed": self.claimed.numpy(),
                "completed": self.completed.numpy()}

    @staticmethod
    def lost(counts) -> int:
        """Updates claimed but never completed (their worker died)."""
        return int(np.sum(counts["claimed"]) - np.sum(counts["completed"]))
