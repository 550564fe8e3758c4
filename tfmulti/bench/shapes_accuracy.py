"""How learnable is `tfmulti_shapes`? Test accuracy of a small CNN over time.

Keras `fit` and `evaluate` on the tfmulti pipeline (training stream with
`steps_per_epoch`, exact-once evaluation with weighted metrics), printing
test accuracy and wall/CPU seconds after every epoch.

    python -m tfmulti.bench.shapes_accuracy [--epochs 4] [--replicas 1]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import keras
import tensorflow as tf

from tfmulti.bench import input_pipeline
from tfmulti.data import pipeline, shapes, tfds_source


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def train_and_evaluate(strategy: tf.distribute.Strategy, *,
                       data_dir: str | None = None, epochs: int = 4,
                       global_batch_size: int = 128,
                       learning_rate: float = 2e-3) -> list[dict]:
    """Trains the benchmark CNN; one dict per epoch (accuracy, seconds)."""
    data_dir = data_dir or tempfile.mkdtemp(prefix="tfmulti_shapes_")
    builder = shapes.prepare_default(data_dir)
    train = pipeline.distribute_dataset(
        strategy, tfds_source.tfds_dataset_fn(shapes.NAME, "train",
                                              data_dir=data_dir),
        global_batch_size=global_batch_size)
    test = pipeline.distribute_dataset(
        strategy, tfds_source.tfds_dataset_fn(shapes.NAME, "test",
                                              data_dir=data_dir),
        global_batch_size=global_batch_size, training=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = input_pipeline.cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])
    steps = builder.info.splits["train"].num_examples // global_batch_size
    start, cpu, results = time.perf_counter(), _cpu_seconds(), []
    for epoch in range(epochs):
        model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
        evaluation = model.evaluate(test, verbose=0, return_dict=True)
        results.append({"epoch": epoch + 1,
                        "test_accuracy": evaluation["accuracy"],
                        "wall_s": time.perf_counter() - start,
                        "cpu_s": _cpu_seconds() - cpu})
        print("epoch {epoch}: test accuracy {test_accuracy:.3f} after "
              "{wall_s:.0f} s wall, {cpu_s:.0f} s CPU".format(**results[-1]),
              flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--data_dir", default=None)
    args = parser.parse_args(argv)
    import tfmulti  # Devices first: before any other TensorFlow work.
    tfmulti.simulate_devices(args.replicas)
    return train_and_evaluate(tfmulti.create_strategy("mirrored"),
                              data_dir=args.data_dir, epochs=args.epochs)


if __name__ == "__main__":
    main()
