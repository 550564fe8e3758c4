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
    empty = _dataset_fn(None).take(0).batch(8)
    with pytest.raises(ValueError, match="`eval_data` yielded no examples"):
        trainer.evaluate(empty)


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
            r"`train_data` changed shape while training: its elements are "
            r"\(\(8, None\):float32.* did not fit the model \(Matrix "
            r"size-incompatible: In\[0\]: \[8,5\]")):
        trainer.fit(changes, steps=4, verbose=0)
    assert trainer.step == 0
