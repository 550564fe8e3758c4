"""Outside code (Keras guides, TF tutorial, upstream reports) on one device
and on mirrored replicas, in ONE process with 4 simulated CPU devices.

Usage: cases_local.py OUT_JSON [CASE ...]
Each case function gets a strategy factory and returns numbers (weights,
losses, logs) or the text of the error it raised; the test file compares
layouts. Every case builds its own model with a fixed seed.
"""

import json
import os
import sys
import tempfile
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfmulti  # noqa: E402

DEVICES = tfmulti.simulate_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_STRATEGIES = {}


def strategy(layout):
    """"one" (one device), "m3", "m4": mirrored over 3 / 4 devices."""
    if layout not in _STRATEGIES:
        if layout == "one":
            _STRATEGIES[layout] = tfmulti.create_strategy(
                "one_device", devices=DEVICES[:1])
        else:
            # The only line changed in the user code: the strategy.
            _STRATEGIES[layout] = tfmulti.create_strategy(
                "mirrored", devices=DEVICES[:int(layout[1:])])
    return _STRATEGIES[layout]


def weights(model):
    return [w.numpy().tolist() for w in model.weights]


_INITIAL = {}


def remember(model):
    """Keeps `model`'s initial weights, so `trained` can show they moved."""
    _INITIAL[id(model)] = [w.numpy().copy() for w in model.weights]
    return model


def trained(model):
    """The final weights, and how far they moved from the remembered ones
    (None if not remembered): a golden run that did not train compares
    nothing."""
    initial = _INITIAL.get(id(model))
    moved = None if initial is None else max(
        float(np.max(np.abs(w.numpy() - w0)))
        for w, w0 in zip(model.weights, initial))
    return {"weights": weights(model), "moved": moved}


def data(n, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    w = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")
    return x, y, w


def mlp(features=8, classes=3):
    keras.utils.set_random_seed(1)
    return remember(keras.Sequential([
        keras.Input((features,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(classes)]))


def sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def caught(fn):
    """Runs fn; returns ("ok", result, warnings) or ("error", text)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - the text is the result
            return {"error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:]}
    return {"result": out, "warnings": [str(w.message) for w in seen
                                        if "tfmulti" in str(w.message)]}


def fit_two_epochs(model, how, x, y, *, batch=32, evaluate=False):
    """Two epochs of full batches (then evaluate, if asked); `how`
    "distributed" goes through tfmulti.keras.distributed, "plain" is Keras
    alone."""
    if how == "distributed":
        tfmulti.keras.distributed(model)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True)
    history = model.fit(ds, epochs=2, verbose=0)
    out = {**trained(model), "history": history.history}
    if evaluate:
        out["eval"] = model.evaluate(ds, verbose=0, return_dict=True)
    return out


CASES = {}


def on_one_and_four(run):
    """`run(layout, how)`: plain Keras on one device (the golden run), plain
    and through tfmulti.keras.distributed on 4 replicas."""
    return {"one": {"plain": caught(lambda: run("one", "plain"))},
            "m4": {how: caught(lambda: run("m4", how))
                   for how in ("plain", "distributed")}}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# -- silent differences ---------------------------------------------------

def _uneven_fit(layout, how):
    """330 examples, batch 32, sample weights: the last batch of 10 splits
    3,3,2,2 over 4 replicas."""
    x, y, w = data(330)
    with strategy(layout).scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), sce(),
                      weighted_metrics=["accuracy"])
    if how == "distributed":
        tfmulti.keras.distributed(model)
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(32)
    history = model.fit(ds, epochs=2, verbose=0)
    return {**trained(model), "history": history.history}


@case
def uneven_fit():
    return {"one": {"plain": caught(lambda: _uneven_fit("one", "plain"))},
            "m4": {how: caught(lambda: _uneven_fit("m4", how))
                   for how in ("plain", "distributed")}}


def _trainer_uneven(layout):
    x, y, w = data(330)
    with strategy(layout).scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    trainer = tfmulti.Trainer(
        model, optimizer, strategy=strategy(layout),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None))
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(32).repeat(2)
    trainer.fit(ds, steps=22, global_batch_size=32, verbose=0)
    return trained(model)


@case
def trainer_uneven():
    return {layout: caught(lambda: _trainer_uneven(layout))
            for layout in ("one", "m4")}


def _indivisible(layout, how):
    """A global batch of 64 on 3 replicas: 22, 21, 21 examples."""
    x, y, w = data(192)
    with strategy(layout).scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01), sce(),
                      metrics=["accuracy"])
    return fit_two_epochs(model, how, x, y, batch=64, evaluate=True)


@case
def indivisible_batch():
    return {"one": {"plain": caught(lambda: _indivisible("one", "plain"))},
            "m3": {how: caught(lambda: _indivisible("m3", how))
                   for how in ("plain", "distributed")}}


class OwnTestStep(keras.Sequential):
    """A `test_step` returning its own logs (not the model's metrics)."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return {"own_loss": keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(
                y, y_pred, from_logits=True)), "scaled": loss * 0 + 7.0}


class OldComputeLoss(keras.Sequential):
    """`compute_loss` with the pre-Keras-3.3 signature (no `training`)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return super().compute_loss(x, y, y_pred, sample_weight)


class ExtraMetrics(keras.Sequential):
    """`compute_metrics` returning a key that is not a metric."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        logs["mean_logit"] = keras.ops.mean(y_pred)
        return logs


def _subclassed(cls, layout, how):
    x, y, _ = data(256)
    with strategy(layout).scope():
        keras.utils.set_random_seed(1)
        model = remember(cls([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)]))
        model.compile(keras.optimizers.SGD(0.1), sce(), metrics=["accuracy"])
    return fit_two_epochs(model, how, x, y, evaluate=True)


@case
def keras_overrides():
    # 3 replicas split the batch of 32 as 11/11/10 (each replica's share
    # counts); the pre-3.3 `compute_loss` is compared on 4 (even) and only
    # warns on 3.
    runs = {"one": (OwnTestStep, OldComputeLoss, ExtraMetrics),
            "m3": (OwnTestStep, OldComputeLoss, ExtraMetrics),
            "m4": (OldComputeLoss,)}
    out = {}
    for layout, classes in runs.items():
        how = "plain" if layout == "one" else "distributed"
        out[layout] = {cls.__name__: caught(
            lambda: _subclassed(cls, layout, how)) for cls in classes}

    def instance_train_step():
        with strategy("m4").scope():
            model = mlp()
            model.compile(keras.optimizers.SGD(0.1), sce())
        import types
        model.train_step = types.MethodType(
            lambda self, data: {"loss": 0.0}, model)
        tfmulti.keras.distributed(model)
    out["instance_train_step"] = caught(instance_train_step)
    return out


def _spe8(layout):
    x, y, _ = data(256)
    with strategy(layout).scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01), sce(),
                      metrics=["accuracy"], steps_per_execution=8)
    return fit_two_epochs(model, "plain", x, y)


@case
def steps_per_execution():
    return {layout: caught(lambda: _spe8(layout)) for layout in ("one", "m4")}



# -- TensorFlow's "Custom training with tf.distribute.Strategy" ------------
# As written, apart from: the strategy line; generated images instead of
# Fashion MNIST (128/64 images of 16x16); GLOBAL_BATCH_SIZE fixed at 64 so that one device
# and N replicas train on the same batches; shuffle(..., seed=0) so that
# both runs see the same order; 2 epochs, no checkpoint files.

def _tutorial(layout):
    rng = np.random.default_rng(0)
    train_images = rng.random((128, 16, 16, 1), dtype=np.float32)
    train_labels = rng.integers(0, 10, 128).astype("uint8")
    test_images = rng.random((64, 16, 16, 1), dtype=np.float32)
    test_labels = rng.integers(0, 10, 64).astype("uint8")
    keras.utils.set_random_seed(1)

    strategy_ = strategy(layout)
    BUFFER_SIZE = len(train_images)
    GLOBAL_BATCH_SIZE = 64
    EPOCHS = 2
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (train_images, train_labels)).shuffle(BUFFER_SIZE, seed=0).batch(
            GLOBAL_BATCH_SIZE)
    test_dataset = tf.data.Dataset.from_tensor_slices(
        (test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy_.experimental_distribute_dataset(
        train_dataset)
    test_dist_dataset = strategy_.experimental_distribute_dataset(
        test_dataset)

    def create_model():
        regularizer = tf.keras.regularizers.L2(1e-5)
        model = tf.keras.Sequential([
            tf.keras.layers.Conv2D(32, 3, activation='relu',
                                   kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, activation='relu',
                                   kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation='relu',
                                  kernel_regularizer=regularizer),
            tf.keras.layers.Dense(10, kernel_regularizer=regularizer)
        ])
        return model

    with strategy_.scope():
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True,
            reduction=tf.keras.losses.Reduction.NONE)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(
                    tf.add_n(model_losses))
            return loss

    with strategy_.scope():
        test_loss = tf.keras.metrics.Mean(name='test_loss')
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name='train_accuracy')
        test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name='test_accuracy')

    with strategy_.scope():
        model = create_model()
        optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy_.run(train_step, args=(dataset_inputs,))
        return strategy_.reduce(tf.distribute.ReduceOp.SUM,
                                per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy_.run(test_step, args=(dataset_inputs,))

    logs = []
    for epoch in range(EPOCHS):
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        logs.append([float(train_loss), float(train_accuracy.result()),
                     float(test_loss.result()),
                     float(test_accuracy.result())])
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    return {**trained(model), "logs": logs}


@case
def tf_custom_training_tutorial():
    # 64 on 3 replicas is uneven, which the tutorial's own
    # compute_average_loss (no global_batch_size) does not handle.
    return {layout: caught(lambda: _tutorial(layout))
            for layout in ("one", "m4")}


# -- keras-io "Multi-GPU distributed training with TensorFlow" ------------
# As written, apart from: the strategy line; generated arrays instead of
# MNIST (128/64/64 examples); a fixed seed; verbose=0.

def _guide_multi_gpu(layout):
    def get_compiled_model():
        inputs = keras.Input(shape=(784,))
        x = keras.layers.Dense(256, activation="relu")(inputs)
        x = keras.layers.Dense(256, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model

    def get_dataset():
        batch_size = 32
        num_val_samples = 64
        rng = np.random.default_rng(0)
        x_train = rng.random((192, 784), dtype=np.float32)
        y_train = rng.integers(0, 10, 192).astype("float32")
        x_test = rng.random((64, 784), dtype=np.float32)
        y_test = rng.integers(0, 10, 64).astype("float32")
        x_val = x_train[-num_val_samples:]
        y_val = y_train[-num_val_samples:]
        x_train = x_train[:-num_val_samples]
        y_train = y_train[:-num_val_samples]
        return (
            tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(
                batch_size),
            tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(
                batch_size),
            tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(
                batch_size),
        )

    keras.utils.set_random_seed(1)
    strategy_ = strategy(layout)
    with strategy_.scope():
        model = remember(get_compiled_model())
        train_dataset, val_dataset, test_dataset = get_dataset()
        history = model.fit(train_dataset, epochs=2,
                            validation_data=val_dataset, verbose=0)
        result = model.evaluate(test_dataset, verbose=0, return_dict=True)
    return {**trained(model), "history": history.history,
            "eval": result}


@case
def keras_guide_multi_gpu():
    return {layout: caught(lambda: _guide_multi_gpu(layout))
            for layout in ("one", "m4")}


# -- TF tutorial "Custom training loop with Keras and MultiWorkerMirrored-
# Strategy": tests/conformance/tutorial_ctl.py; the same code on two
# workers is in cases_multi_worker.py. The global batch is the 2-worker one
# (2 x 64) on every layout.

def _ctl_tutorial(layout):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tutorial_ctl
    with tempfile.TemporaryDirectory() as tmp:
        return tutorial_ctl.run(strategy(layout), 2, tmp)


@case
def ctl_tutorial():
    return {layout: caught(lambda: _ctl_tutorial(layout))
            for layout in ("one", "m4")}


# -- TF tutorial "Distributed input": tests/conformance/tutorial_input.py
# (its cells on one device, 2 replicas as the tutorial, and 3 for its
# "3 replicas" example); the sharding policies on two workers are in
# cases_multi_worker.py.

@case
def input_tutorial():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tutorial_input
    out = {layout: caught(lambda: tutorial_input.cells(strategy(layout)))
           for layout in ("one", "m2")}
    # Its other cells use a global batch of 16, which 3 replicas cannot split.
    out["m3"] = caught(lambda: {"range8_batch4": tutorial_input.rebatching(
        strategy("m3"), tf.data.Dataset.range(8).batch(4))})
    return out


# -- TF tutorial "Save and load a model using a distribution strategy" -----
# As written (Keras API: `.keras`, load without a strategy and under
# another; tf.saved_model API: `tf.saved_model.save`, load, serve on one
# device and with `another_strategy.run`), apart from: the strategy lines,
# generated images for MNIST, the global batch of 4 replicas on every
# layout (the tutorial's 64 per replica, here 16), fixed seeds, verbose=0,
# a temporary directory for /tmp, and `model.export` next to
# `tf.saved_model.save` (the Keras 3 way to a SavedModel).

def _save_and_load(layout, save_dir):
    mirrored_strategy = strategy(layout)

    def get_data():
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (256, 28, 28, 1)).astype("uint8")
        labels = rng.integers(0, 10, 256).astype("int64")
        mnist_train = tf.data.Dataset.from_tensor_slices(
            (images[:192], labels[:192]))
        mnist_test = tf.data.Dataset.from_tensor_slices(
            (images[192:], labels[192:]))

        BUFFER_SIZE = 10000

        BATCH_SIZE_PER_REPLICA = 16
        BATCH_SIZE = BATCH_SIZE_PER_REPLICA * 4

        def scale(image, label):
            image = tf.cast(image, tf.float32)
            image /= 255

            return image, label

        train_dataset = mnist_train.map(scale).cache().shuffle(
            BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
        eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

        return train_dataset, eval_dataset

    def get_model():
        with mirrored_strategy.scope():
            model = keras.Sequential([
                keras.Input(shape=(28, 28, 1)),
                keras.layers.Conv2D(32, 3, activation='relu'),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation='relu'),
                keras.layers.Dense(10)
            ])

            model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                optimizer=keras.optimizers.Adam(),
                metrics=['accuracy'])
            return model

    keras.utils.set_random_seed(1)
    model = remember(get_model())
    train_dataset, eval_dataset = get_data()
    model.fit(train_dataset, epochs=2, verbose=0)
    out = trained(model)
    images = np.concatenate([x for x, _ in eval_dataset.as_numpy_iterator()])
    out["predict"] = model.predict(images, verbose=0).tolist()

    keras_model_path = os.path.join(save_dir, "keras_save.keras")
    model.save(keras_model_path)
    restored_keras_model = keras.models.load_model(keras_model_path)
    restored_keras_model.fit(train_dataset, epochs=2, verbose=0)
    out["restored_none"] = weights(restored_keras_model)

    for name, another_strategy in (("one", strategy("one")),
                                   ("m4", strategy("m4"))):
        with another_strategy.scope():
            restored_keras_model_ds = keras.models.load_model(
                keras_model_path)
            restored_keras_model_ds.fit(train_dataset, epochs=2, verbose=0)
        out[f"restored_{name}"] = weights(restored_keras_model_ds)

    saved_model_path = os.path.join(save_dir, "tf_save")
    tf.saved_model.save(model, saved_model_path)
    export_path = os.path.join(save_dir, "export")
    model.export(export_path, verbose=False)
    DEFAULT_FUNCTION_KEY = "serving_default"
    predict_dataset = eval_dataset.map(lambda image, label: image)
    for path, key in ((saved_model_path, "saved_model"),
                      (export_path, "export")):
        loaded = tf.saved_model.load(path)
        inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]
        served = []
        for batch in predict_dataset:
            served.append(next(iter(inference_func(batch).values())).numpy())
        out[f"{key}_served"] = np.concatenate(served).tolist()
        another_strategy = strategy("m4")
        with another_strategy.scope():
            loaded = tf.saved_model.load(path)
            inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]
            dist_predict_dataset = (
                another_strategy.experimental_distribute_dataset(
                    predict_dataset))
            served = []
            for batch in dist_predict_dataset:
                result = another_strategy.run(inference_func, args=(batch,))
                for part in another_strategy.experimental_local_results(
                        result):
                    served.append(next(iter(part.values())).numpy())
        out[f"{key}_served_m4"] = np.concatenate(served).tolist()
    return out


@case
def tf_save_and_load():
    import tempfile
    out = {}
    for layout in ("one", "m4"):
        with tempfile.TemporaryDirectory() as save_dir:
            out[layout] = caught(lambda: _save_and_load(layout, save_dir))
    return out


# -- keras-io "Customizing what happens in fit() with TensorFlow" ----------
# The guide's four models (compute_loss + metrics; own metrics; sample
# weights; own test_step) as written, apart from: the strategy line around
# model creation, a fixed seed, verbose=0. The GAN is left out: it draws
# random latents per replica, which no N-replica run can match.

class GuideModel1(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GuideModel2(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {
            "loss": self.loss_tracker.result(),
            "mae": self.mae_metric.result(),
        }

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class GuideModel3(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
            )
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class GuideModel4(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _guide_custom_fit(layout, number, how="plain", make_strategy=None):
    rng = np.random.default_rng(number)
    x = rng.random((256, 32))
    y = rng.random((256, 1))
    sw = rng.random((256, 1))
    keras.utils.set_random_seed(1)
    with (make_strategy or strategy)(layout).scope():
        inputs = keras.Input(shape=(32,))
        outputs = keras.layers.Dense(1)(inputs)
        cls = [GuideModel1, GuideModel2, GuideModel3, GuideModel4][number - 1]
        model = remember(cls(inputs, outputs))
        if number == 2:
            model.compile(optimizer="adam")
        elif number == 4:
            model.compile(loss="mse", metrics=["mae"])
        else:
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    if how == "distributed":
        tfmulti.keras.distributed(model)
    if number == 4:
        return {"eval": model.evaluate(x, y, verbose=0, return_dict=True)}
    kwargs = {"sample_weight": sw} if number == 3 else {}
    history = model.fit(x, y, epochs=2, verbose=0, **kwargs)
    return {**trained(model), "history": history.history}


@case
def keras_guide_custom_fit():
    out = {layout: {f"model{n}": caught(lambda: _guide_custom_fit(layout, n))
                    for n in (1, 2, 3, 4)} for layout in ("one", "m4")}
    # "Providing your own evaluation step" through `distributed` too.
    out["m4"]["model4_distributed"] = caught(
        lambda: _guide_custom_fit("m4", 4, "distributed"))
    return out


# The guide's GAN (tests/conformance/guide_gan.py): without a strategy (the
# guide's run), under tfmulti's one_device and 4 mirrored replicas.
@case
def keras_guide_gan():
    import contextlib
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import guide_gan
    out = {"none": caught(lambda: guide_gan.run(contextlib.nullcontext()))}
    out.update({layout: caught(lambda: guide_gan.run(strategy(layout).scope()))
                for layout in ("one", "m4")})
    return out


# -- plain Keras evaluate on an exact-once distributed dataset --------------

def _eval_exact_once(layout, how):
    x, y, _ = data(1000)
    with strategy(layout).scope():
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1), sce(),
                      weighted_metrics=["accuracy"])
    if how == "distributed":
        tfmulti.keras.distributed(model)

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, y))

    runs = []
    for _ in range(2):
        if layout == "one" and how == "plain":
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(84)
        else:
            ds = tfmulti.distribute_dataset(strategy(layout), dataset_fn,
                                            global_batch_size=84,
                                            training=False)
        logs = model.evaluate(ds, verbose=0, return_dict=True)
        logs["count"] = float(model.metrics[0].count.numpy())
        runs.append(logs)
    return runs


@case
def evaluate_exact_once():
    return {"one": {how: caught(lambda: _eval_exact_once("one", how))
                    for how in ("plain", "distributed")},
            "m4": {how: caught(lambda: _eval_exact_once("m4", how))
                   for how in ("plain", "distributed")}}


# -- BatchNormalization moving statistics per replica ----------------------

def _bn_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                             keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.Activation("relu"),
                             keras.layers.Dense(3)])


def _batchnorm(how):
    """One epoch on 4 replicas; then how far the replicas' copies of the
    moving statistics are apart, evaluate on 4 replicas (each replica its
    own copy) and on one device from `get_weights` (what a checkpoint
    holds)."""
    x, y, _ = data(128)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        32, drop_remainder=True)
    with strategy("m4").scope():
        model = remember(_bn_model())
        model.compile(keras.optimizers.SGD(0.1), sce(), metrics=["accuracy"])
    if how == "distributed":
        tfmulti.keras.distributed(model)
    model.fit(ds, epochs=1, verbose=0)
    bn = model.layers[1]
    copies = [np.array([t.numpy() for t in strategy(
        "m4").experimental_local_results(v.value)])
        for v in (bn.moving_mean, bn.moving_variance)]
    with strategy("one").scope():
        saved = _bn_model()
        saved.compile(keras.optimizers.SGD(0.1), sce(), metrics=["accuracy"])
    saved.set_weights(model.get_weights())
    return {"moved": trained(model)["moved"],
            "replica_spread": max(float(np.max(np.abs(c - c[0])))
                                  for c in copies),
            "eval": model.evaluate(ds, verbose=0, return_dict=True),
            "eval_saved": saved.evaluate(ds, verbose=0, return_dict=True)}


@case
def batchnorm_statistics():
    return {how: caught(lambda: _batchnorm(how))
            for how in ("plain", "distributed")}


# -- upstream reports -------------------------------------------------------

def _embedding(layout, how):
    """keras-team/keras#21069: IndexedSlices gradients on 2+ replicas."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(256, 6)).astype("int32")
    y = rng.integers(0, 3, size=(256,)).astype("int32")
    with strategy(layout).scope():
        keras.utils.set_random_seed(1)
        model = remember(keras.Sequential([
            keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]))
        model.compile(keras.optimizers.Adam(0.01), sce())
    return fit_two_epochs(model, how, x, y)


@case
def k21069_embedding():
    return on_one_and_four(_embedding)


def _k19891(layout, how):
    """keras-team/keras#19891, the report's code: 12 examples, Dense(10),
    mse, sgd; evaluate and fit change with the replica count."""
    keras.utils.set_random_seed(0)
    batch_size = 12
    x = tf.random.uniform((batch_size, 1), -1, 1, seed=0)
    y = tf.random.uniform((batch_size, 10), -1, 1, seed=1)
    with strategy(layout).scope():
        inp = keras.Input(shape=(1,))
        layer = keras.layers.Dense(10)
        model = remember(keras.Model(inp, layer(inp)))
        model.compile(loss="mse", optimizer="sgd")
    if how == "distributed":
        tfmulti.keras.distributed(model)
    gt = keras.losses.mean_squared_error(
        y, model.predict(x, batch_size=batch_size, verbose=0))
    evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0)
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    post = keras.losses.mean_squared_error(
        y, model.predict(x, batch_size=batch_size, verbose=0))
    return {"ground_truth": float(tf.reduce_mean(gt)),
            "evaluate": float(evaluated),
            "post_fit": float(tf.reduce_mean(post)),
            **trained(model)}


@case
def k19891_replica_count():
    return on_one_and_four(_k19891)


def _k20611(layout, how):
    """keras-team/keras#20611, the report's model: Dense(128, gelu),
    Dropout(0.2), Dense(128) made under a MirroredStrategy scope (failed to
    initialise with Keras 3.7). Inference equals one device; dropout masks
    are drawn per replica in training, so fit is compared by its loss
    falling, not bitwise."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 16)).astype("float32")
    # A learnable target, so the loss can fall.
    y = np.tanh(x @ rng.normal(scale=0.5, size=(16, 128))).astype("float32")
    with strategy(layout).scope():
        keras.utils.set_random_seed(2)
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(128, activation="gelu"),
            tf.keras.layers.Dropout(0.2),
            tf.keras.layers.Dense(128),
        ])
        model.build((None, 16))
        model.compile(keras.optimizers.SGD(0.5), "mse")
    if how == "distributed":
        tfmulti.keras.distributed(model)
    before = {"predict": model.predict(x, batch_size=32, verbose=0).tolist(),
              "evaluate": float(model.evaluate(x, y, batch_size=32,
                                               verbose=0))}
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    return {**before, "fit_loss": history.history["loss"]}


@case
def k20611_dropout():
    return on_one_and_four(_k20611)


def _k21366(layout, how):
    """keras-team/keras#21366: mixed precision with jit_compile=True under
    MirroredStrategy (LossScaleOptimizer merge_call)."""
    x, y, _ = data(128)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy(layout).scope():
            model = mlp()
            model.compile(keras.optimizers.SGD(0.05), sce(),
                          jit_compile=True)
        return fit_two_epochs(model, how, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@case
def k21366_mixed_precision_jit():
    return on_one_and_four(_k21366)


def _tf72686(layout):
    """tensorflow/tensorflow#72686: a custom loop whose first
    `apply_gradients` (building the optimizer) runs inside
    `tf.function(strategy.run(...))`, with the default Keras optimizer
    created in scope and the loss from `compute_average_loss` with the
    global batch."""
    x, y, _ = data(256)
    strategy_ = strategy(layout)
    with strategy_.scope():
        model = mlp()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
    dist = strategy_.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(
            64, drop_remainder=True))

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(labels, model(features, training=True)),
                global_batch_size=64)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(inputs):
        return strategy_.reduce("SUM", strategy_.run(step, args=(inputs,)),
                                axis=None)

    losses = [float(train(batch)) for _ in range(2) for batch in dist]
    return {**trained(model), "losses": losses}


@case
def tf72686_lazy_optimizer():
    return {layout: caught(lambda: _tf72686(layout)) for layout in ("one", "m4")}



@case
def dict_inputs():
    """The one-device golden run of `cases_multi_worker.py`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cases_multi_worker
    return {how: caught(lambda: cases_multi_worker.run(strategy("one"), how))
            for how in ("plain", "distributed")}


# -- guards: the upstream behaviour tfmulti works around --------------------

def _stock_mirrored(n):
    cls = tf.distribute.MirroredStrategy
    previous = cls._collective_key_base
    cls._collective_key_base = 50_000_000 + n  # apart from tfmulti's
    try:
        return cls(DEVICES[:n])
    finally:
        cls._collective_key_base = previous


@case
def guards():
    """Stock TF/Keras behaviour; each fails once upstream fixes it."""
    x, y, _ = data(192)

    def lazy_optimizer():
        s = _stock_mirrored(4)
        with s.scope():
            model = mlp()
            optimizer = keras.optimizers.Adam(0.01)
        dist = s.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32))

        def step(inputs):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    keras.losses.sparse_categorical_crossentropy(
                        inputs[1], model(inputs[0]), from_logits=True),
                    global_batch_size=32)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def train(inputs):
            s.run(step, args=(inputs,))

        for batch in dist:
            train(batch)

    def first_batch_build():
        s = _stock_mirrored(3)
        with s.scope():
            model = mlp()
            model.compile(keras.optimizers.SGD(0.1), sce())
        model.fit(tf.data.Dataset.from_tensors((x[:64], y[:64])), verbose=0)

    def guide_test_step():
        # "Providing your own evaluation step" on a stock MirroredStrategy.
        # Its golden run is keras_guide_custom_fit's ["one"]["model4"]: the
        # same call, not run twice.
        return _guide_custom_fit("m4", 4, make_strategy=lambda _: (
            _stock_mirrored(4)))["eval"]

    return {"lazy_optimizer": caught(lazy_optimizer),
            "first_batch_build": caught(first_batch_build),
            "guide_test_step": caught(guide_test_step)}


def main():
    # `--resume`: keep the cases an earlier (stalled) process finished.
    args = sys.argv[1:]
    resume = "--resume" in args
    args = [a for a in args if a != "--resume"]
    out_path, names = args[0], args[1:] or list(CASES)
    results = {}
    if resume and os.path.exists(out_path):
        with open(out_path) as f:
            results = json.load(f)
    for name in names:
        if name in results:
            continue
        results[name] = CASES[name]()
        # Written (whole) after every case: a stall keeps the others.
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
