"""Endless and empty streams where a finite one is needed: refused up front.

In process, one device: each case used to hang inside one tf.function (or
return a loss of 0.0); now it fails before anything runs, naming the
argument and the fix.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmulti  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


def _dataset_fn(input_context):
    del input_context
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, np.zeros(32, "int32")))


@pytest.fixture(scope="module")
def setup():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        trainer = tfmulti.Trainer(model, keras.optimizers.SGD(0.1),
                                  loss=LOSS)
    train = tfmulti.distribute_dataset(strategy, _dataset_fn,
                                       global_batch_size=8)
    return strategy, trainer, train


def test_trainer_refuses_the_endless_training_stream_for_eval(setup):
    _, trainer, train = setup
    endless = "`eval_data` is an endless stream"
    with pytest.raises(ValueError, match=endless):
        trainer.evaluate(train)
    repeated = _dataset_fn(None).repeat().batch(8)
    with pytest.raises(ValueError, match=endless):
        trainer.evaluate(repeated)
    # fit refuses before its first step.
    with pytest.raises(ValueError, match=endless):
        trainer.fit(train, steps=2, eval_data=train)
    assert trainer.step == 0


def test_trainer_evaluate_on_an_empty_dataset_is_an_error(setup):
    _, trainer, _ = setup
    examples = _dataset_fn(None)
    # Refused before tracing: a first trace on a dataset of cardinality 0
    # never read, and later evaluations reused it ("no examples" for all).
    with pytest.raises(ValueError, match=(
            r"`eval_data` is empty \(its cardinality is 0\), so there is "
            "nothing to evaluate")):
        trainer.evaluate(examples.take(0).batch(8))
    empty = examples.filter(lambda x, y: y > 0).batch(8)
    with pytest.raises(ValueError, match="`eval_data` yielded no examples"):
        trainer.evaluate(empty)
    x, y = next(iter(examples.batch(32)))
    expected = float(np.mean(LOSS(y, trainer.model(x))))
    np.testing.assert_allclose(
        trainer.evaluate(examples.batch(8))["loss"], expected, rtol=1e-6)


def test_keras_fit_and_evaluate_refuse_the_endless_stream(setup):
    strategy, _, train = setup
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    tfmulti.keras.distributed(model)
    for steps in (None, 0):
        with pytest.raises(ValueError, match=(
                f"`steps_per_epoch` is {steps} but `x` is an endless "
                "training stream .* Pass steps_per_epoch=")):
            model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
    with pytest.raises(ValueError, match="`validation_data` is an endless"):
        model.fit(train, epochs=1, steps_per_epoch=2, validation_data=train,
                  verbose=0)
    with pytest.raises(ValueError, match="`x` is an endless stream"):
        model.evaluate(train, verbose=0)
    # With steps given, the same stream is fine.
    model.fit(train, epochs=1, steps_per_epoch=2, verbose=0)


def test_distribute_dataset_bad_dataset_fn_or_cache_path(setup, tmp_path):
    strategy = setup[0]
    with pytest.raises(ValueError, match=(
            "`dataset_fn` should be a callable .* got _TensorSliceDataset. "
            "Wrap a dataset as `lambda input_context: dataset`")):
        tfmulti.distribute_dataset(strategy, _dataset_fn(None),
                                   global_batch_size=8)
    with pytest.raises(ValueError, match=(
            "`dataset_fn` returned a batched dataset .* Remove the .batch()")):
        tfmulti.distribute_dataset(
            strategy, lambda ctx: _dataset_fn(ctx).batch(4),
            global_batch_size=8)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=(
            r"`cache` is '.*/afile/cache', but '.*/afile' is not a "
            r"directory \(it is a file\)")):
        tfmulti.distribute_dataset(strategy, _dataset_fn, global_batch_size=8,
                                   cache=str(tmp_path / "afile" / "cache"))


def test_training_data_that_does_not_fit_is_named(setup):
    """Unbatched, empty, too short, labels out of range, a shape change."""
    strategy = setup[0]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        trainer = tfmulti.Trainer(model, keras.optimizers.SGD(0.1),
                                  loss=LOSS)
    examples = _dataset_fn(None)
    with pytest.raises(ValueError, match=(
            r"`train_data` is not batched: its elements are \(\(4,\):float32, "
            r"\(\):int32\).* dataset.batch\(global_batch_size")):
        trainer.fit(examples.repeat(), steps=2, verbose=0)
    with pytest.raises(ValueError, match=(
            r"`train_data` is empty \(its cardinality is 0\)")):
        trainer.fit(examples.take(0).batch(8), steps=2, verbose=0)
    # Empty, but only the run can tell (was OutOfRangeError: 0 derived
    # errors ignored); and finite data shorter than `steps`.
    for data in (examples.filter(lambda x, y: y > 0).batch(
                     8, drop_remainder=True),
                 examples.batch(8, drop_remainder=True)):
        with pytest.raises(ValueError, match=(
                r"`train_data` ran out of batches in the loop starting at "
                r"step 0: `steps`=6 needs 6 x 1 batch\(es\). Repeat it")):
            trainer.fit(data, steps=6, verbose=0)
    x = np.zeros((32, 4), "float32")
    labels = tf.data.Dataset.from_tensor_slices(
        (x, np.full(32, 7, "int32"))).repeat().batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match=(
            r"`train_data` has a label 7, outside the model's 3 classes .* "
            r"give the model 8 or more outputs")):
        trainer.fit(labels, steps=2, verbose=0)

    def changing():
        for i in range(100):
            yield np.zeros((8, 4 if i < 2 else 5), "float32"), np.zeros(
                8, "int32")

    changes = tf.data.Dataset.from_generator(changing, output_signature=(
        tf.TensorSpec((8, None), tf.float32), tf.TensorSpec((8,), tf.int32)))
    with pytest.raises(ValueError, match=(
            r"`train_data` changed shape mid-stream: its elements are "
            r"\(\(8, None\):float32.* did not fit the model \(Matrix "
            r"size-incompatible: In\[0\]: \[8,5\]")):
        trainer.fit(changes, steps=4, verbose=0)
    assert trainer.step == 0


def test_evaluate_and_keras_fit_name_data_that_does_not_fit(setup):
    """The Trainer's `evaluate` and Keras `fit` / `evaluate` under
    `tfmulti.keras.distributed` translate as `Trainer.fit` does (were raw
    InvalidArgumentErrors, a `RuntimeError` about "step 0 of an epoch of 0
    steps", and a silent loss of 0.0 for an empty evaluation set)."""
    strategy, trainer, _ = setup
    x = np.zeros((32, 4), "float32")
    labels = tf.data.Dataset.from_tensor_slices(
        (x, np.full(32, 7, "int32"))).batch(8)

    def changing():
        for i in range(4):
            yield np.zeros((8, 4 if i < 2 else 5), "float32"), np.zeros(
                8, "int32")

    def changes():
        return tf.data.Dataset.from_generator(changing, output_signature=(
            tf.TensorSpec((8, None), tf.float32),
            tf.TensorSpec((8,), tf.int32)))

    label_error = (r"`{}` has a label 7, outside the model's 3 classes .* "
                   r"give the model 8 or more outputs")
    shape_error = (r"`{}` changed shape mid-stream: its elements are "
                   r"\(\(8, None\):float32.* did not fit the model \(Matrix "
                   r"size-incompatible: In\[0\]: \[8,5\]")
    with pytest.raises(ValueError, match=label_error.format("eval_data")):
        trainer.evaluate(labels)
    with pytest.raises(ValueError, match=shape_error.format("eval_data")):
        trainer.evaluate(changes())

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    tfmulti.keras.distributed(model)
    for run in (lambda data: model.fit(data, epochs=1, verbose=0),
                lambda data: model.evaluate(data, verbose=0)):
        with pytest.raises(ValueError, match=label_error.format("x")):
            run(labels)
        with pytest.raises(ValueError, match=shape_error.format("x")):
            run(changes())
    examples = _dataset_fn(None)
    with pytest.raises(ValueError, match=(
            r"`x` is not batched: its elements are \(\(4,\):float32, "
            r"\(\):int32\)")):
        model.fit(examples, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=(
            r"`x` is empty \(its cardinality is 0\)")):
        model.fit(examples.take(0).batch(8), epochs=1, verbose=0)
    filtered_empty = examples.filter(lambda x, y: y > 0).batch(8)
    with pytest.raises(ValueError, match=(
            r"`x` ran out of data before the first call of the train "
            r"function finished .* nothing was trained")):
        model.fit(filtered_empty, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=(
            r"`x` yielded no batches \(an empty dataset\), so there is no "
            r"loss to report")):
        model.evaluate(filtered_empty, verbose=0)
    with pytest.raises(ValueError, match=(
            r"`validation_data` yielded no batches")):
        model.fit(examples.batch(8), epochs=1, verbose=0,
                  validation_data=filtered_empty)
