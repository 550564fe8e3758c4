"""Peak memory of gradient accumulation vs a real large batch.

    python -m tfmulti.bench.parts accumulation_memory \
        '{"batch": 128, "grad_accum_steps": 4}'

Trains `models.small_cnn` (32x32x3) with the Trainer on one device, in a
fresh process per configuration, and reports the process's peak resident
memory (`ru_maxrss`) and how much training added to the memory held after
start-up. Run once with batch B, once with batch K*B, and once with batch B
and `grad_accum_steps=K` (an update over K*B examples): the activations of
one micro-batch are alive at a time, so accumulation should cost about what
batch B costs.
"""

from __future__ import annotations

import resource


def _rss_bytes() -> int:
    # Current resident set, from /proc (Linux): pages * page size.
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize()


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(*, batch: int, grad_accum_steps: int = 1, steps: int = 4) -> dict:
    """Trains `steps` updates; returns the memory figures of this process.

    Args:
      batch: examples per micro-batch (the global batch of each step).
      grad_accum_steps: micro-batches per update.
      steps: optimizer updates to run.

    Returns:
      {"peak_rss_bytes": peak of the whole process, "startup_rss_bytes":
      resident memory after TensorFlow, the model, the optimizer and the
      data were set up, "training_bytes": peak minus start-up, and the
      settings}.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmulti
    from tfmulti import models

    strategy = tfmulti.create_strategy("one_device")
    rng = np.random.default_rng(0)
    examples = batch * grad_accum_steps * 2
    x = rng.integers(0, 256, size=(examples, 32, 32, 3)).astype("uint8")
    y = rng.integers(0, 10, size=(examples,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        batch, drop_remainder=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = models.small_cnn(batch_norm=False)
        optimizer = keras.optimizers.Adam(1e-3)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy,
        grad_accum_steps=grad_accum_steps, steps_per_loop=steps,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction=None))
    startup = _rss_bytes()
    trainer.fit(data, steps=steps, verbose=0)
    peak = _peak_rss_bytes()
    return {"peak_rss_bytes": peak, "startup_rss_bytes": startup,
            "training_bytes": peak - startup, "batch": batch,
            "grad_accum_steps": grad_accum_steps,
            "examples_per_update": batch * grad_accum_steps, "steps": steps}
