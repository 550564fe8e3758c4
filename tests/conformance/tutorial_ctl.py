"""TF tutorial "Custom training loop with Keras and MultiWorkerMirroredStrategy"
(tensorflow.org/tutorials/distribute/multi_worker_with_ctl), its `mnist.py`
and `main.py`, as the tutorial writes them, under a tfmulti strategy.

What differs from the tutorial, and why:
- the strategy is passed in (the only line a tfmulti user changes);
- generated MNIST-shaped data in place of `keras.datasets.mnist` (no
  network), and no unseeded `shuffle(60000)` (two runs could not be
  compared);
- `num_steps_per_epoch` is 10, not 70 (test time);
- `train_accuracy.reset_states()` is `reset_state()`: Keras 3 renamed it
  (AttributeError on one device too, nothing distributed about it);
- a strategy without a cluster (one device, mirrored) is a single-process
  run: `task_type`, `task_id` are None, as in the tutorial's notebook cells
  before `TF_CONFIG` is set;
- a restart is a second `train` call in the same process with a fresh model,
  optimizer and counters (what a new `main.py` process would build), after
  `num_epochs` epochs of the first: TensorFlow lets a process create one
  multi-worker strategy;
- `advance_before_save=True` moves the tutorial's two counter updates
  before `checkpoint_manager.save()`. As written, the checkpoint holds the
  finished epoch's index with `step_in_epoch` = NUM_STEPS_PER_EPOCH, so a
  restart runs no step and divides by `num_batches` = 0
  (ZeroDivisionError), on one device as on N: a bug of the tutorial, not of
  distribution, that no strategy can fix.
"""

import os

import numpy as np
import tensorflow as tf

PER_WORKER_BATCH_SIZE = 64
NUM_STEPS_PER_EPOCH = 10
EXAMPLES = 64 * 2 * NUM_STEPS_PER_EPOCH


# --- mnist.py -------------------------------------------------------------
def mnist_dataset(batch_size):
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, size=(EXAMPLES, 28, 28)).astype("uint8")
    y_train = rng.integers(0, 10, size=(EXAMPLES,))
    # The `x` arrays are in uint8 and have values in the range [0, 255].
    # You need to convert them to float32 with values in the range [0, 1]
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    return train_dataset


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines,
                            input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    return dataset


def build_cnn_model():
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])


# --- main.py --------------------------------------------------------------
def _is_chief(task_type, task_id, cluster_spec):
    return (task_type is None
            or task_type == 'chief'
            or (task_type == 'worker'
                and task_id == 0
                and 'chief' not in cluster_spec.as_dict()))


def _get_temp_dir(dirpath, task_id):
    base_dirpath = 'workertemp_' + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def train(strategy, num_workers, checkpoint_dir, num_epochs,
          advance_before_save=False):
    """main.py from "Define Strategy" on; returns the model, the printed
    epoch lines and whether the run started from a checkpoint."""
    global_batch_size = PER_WORKER_BATCH_SIZE * num_workers

    with strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        multi_worker_model = build_cnn_model()
        initial = [w.numpy().copy() for w in multi_worker_model.weights]

        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))
        optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name='train_accuracy')

    @tf.function
    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs
            with tf.GradientTape() as tape:
                predictions = multi_worker_model(x, training=True)
                per_batch_loss = tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True,
                    reduction=tf.keras.losses.Reduction.NONE)(y, predictions)
                loss = tf.nn.compute_average_loss(
                    per_batch_loss, global_batch_size=global_batch_size)

            grads = tape.gradient(loss, multi_worker_model.trainable_variables)
            optimizer.apply_gradients(
                zip(grads, multi_worker_model.trainable_variables))
            train_accuracy.update_state(y, predictions)

            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(
            tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = tf.Variable(
        initial_value=tf.constant(0, dtype=tf.dtypes.int64), name='epoch')
    step_in_epoch = tf.Variable(
        initial_value=tf.constant(0, dtype=tf.dtypes.int64),
        name='step_in_epoch')

    resolver = strategy.cluster_resolver
    if resolver is not None:
        task_type, task_id, cluster_spec = (resolver.task_type,
                                            resolver.task_id,
                                            resolver.cluster_spec())
    else:
        task_type, task_id, cluster_spec = None, None, tf.train.ClusterSpec({})

    checkpoint = tf.train.Checkpoint(
        model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                          cluster_spec)
    checkpoint_manager = tf.train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

    # Restoring the checkpoint
    latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)

    printed = []
    # Resume our CTL training
    while epoch.numpy() < num_epochs:
        iterator = iter(multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0

        while step_in_epoch.numpy() < NUM_STEPS_PER_EPOCH:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch.assign_add(1)

        train_loss = total_loss / num_batches
        printed.append('Epoch: %d, accuracy: %f, train_loss: %f.'
                       % (epoch.numpy(), train_accuracy.result(), train_loss))

        train_accuracy.reset_state()

        if advance_before_save:
            epoch.assign_add(1)
            step_in_epoch.assign(0)
        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            tf.io.gfile.rmtree(write_checkpoint_dir)

        if not advance_before_save:
            epoch.assign_add(1)
            step_in_epoch.assign(0)
    return multi_worker_model, initial, printed, bool(latest_checkpoint)


def run(strategy, num_workers, directory, seed=1):
    """As written: two epochs, then a restart (its error is the result).
    With the counters advanced before the save: two epochs, a restart that
    restores and trains the third. Keras is seeded before each (the tutorial
    does not, so two runs would start apart)."""
    tf.keras.utils.set_random_seed(seed)
    written = os.path.join(directory, "as_written", "ckpt")
    train(strategy, num_workers, written, 2)
    try:
        train(strategy, num_workers, written, 3)
        restart_error = None
    except ZeroDivisionError as e:
        restart_error = f"ZeroDivisionError: {e}"

    fixed = os.path.join(directory, "fixed", "ckpt")
    tf.keras.utils.set_random_seed(seed)
    _, initial, printed, _ = train(strategy, num_workers, fixed, 2,
                                   advance_before_save=True)
    model, _, printed_after, restored = train(strategy, num_workers, fixed, 3,
                                              advance_before_save=True)
    top = os.path.dirname(fixed)
    files = sorted(os.path.relpath(os.path.join(root, name), top)
                   for root, _, names in os.walk(top) for name in names)
    return {"restart_error": restart_error,
            "weights": [w.numpy().tolist() for w in model.weights],
            "moved": max(float(np.max(np.abs(w.numpy() - w0)))
                         for w, w0 in zip(model.weights, initial)),
            "losses": [float(line.rsplit(" ", 1)[1].rstrip("."))
                       for line in printed + printed_after],
            "printed": printed + printed_after,
            "restored": restored,
            "files": files}
