"""TF tutorial "Distributed input" (tensorflow.org/tutorials/distribute/input):
its code cells under a tfmulti strategy, returning what the tutorial prints,
so the test can compare it with what the tutorial says each cell shows.

What differs from the tutorial, and why: the strategy is passed in (the
only line a tfmulti user changes); `print`/`tf.print` become returned values;
the tutorial's 2 virtual devices are the caller's (2 and 3 replicas; the
"5 replicas" example needs 5 devices and is left out); the sharding-policy
examples, which the tutorial describes in prose, run on two real workers
(`sharding_on_workers`), with the tutorial's numbers.
"""

import os

import tensorflow as tf


def _local(strategy, value):
    """Each replica's value as a list (a tensor on one replica)."""
    return [v.numpy().tolist() for v in strategy.experimental_local_results(value)]


def rebatching(strategy, dataset):
    """ "Batching": what each replica gets at each step."""
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    return [_local(strategy, x) for x in dist_dataset]


def cells(strategy):
    """The tutorial's cells on `strategy`, by section."""
    out = {}
    global_batch_size = 16
    # Create a tf.data.Dataset object.
    dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(
        global_batch_size)

    # "experimental_distribute_dataset", usage: 1 global batch in 1 step.
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    features, labels = next(iter(dist_dataset))
    out["first_batch"] = [len(f) for f in _local(strategy, features)]

    # "Batching": the tutorial's examples.
    out["range6_batch4"] = rebatching(
        strategy, tf.data.Dataset.range(6).batch(4, drop_remainder=False))
    out["range8_batch4"] = rebatching(strategy, tf.data.Dataset.range(8).batch(4))

    # "distribute_datasets_from_function".
    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(64).batch(16)
        dataset = dataset.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        dataset = dataset.prefetch(2)  # This prefetches 2 batches per device.
        return dataset

    from_function = strategy.distribute_datasets_from_function(dataset_fn)
    out["from_function_shapes"] = [
        [list(f.shape) for f in strategy.experimental_local_results(x[0])]
        for x in from_function]

    # "Use a Pythonic for loop construct".
    @tf.function
    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    losses = []
    for x in dist_dataset:
        # train_step trains the model using the dataset elements
        loss = strategy.run(train_step, args=(x,))
        losses.append(_local(strategy, loss))
    out["for_loop"] = losses

    # "Use `iter` to create an explicit iterator".
    num_epochs = 10
    steps_per_epoch = 5
    explicit = []
    for epoch in range(num_epochs):
        dist_iterator = iter(dist_dataset)
        for step in range(steps_per_epoch):
            # train_step trains the model using the dataset elements
            loss = strategy.run(train_step, args=(next(dist_iterator),))
            explicit.append(_local(strategy, loss))
    out["explicit_iterator"] = explicit

    # `get_next_as_optional` in a host training loop, with `break`.
    global_batch_size = 4
    steps_per_loop = 5
    dataset = tf.data.Dataset.range(9).batch(global_batch_size)
    distributed_iterator = iter(strategy.experimental_distribute_dataset(dataset))
    seen = []

    @tf.function
    def train_fn(distributed_iterator):
        for _ in tf.range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            per_replica_results = strategy.run(
                lambda x: x, args=(optional_data.get_value(),))
            # tf.print(strategy.experimental_local_results(per_replica_results))
            tf.py_function(
                lambda *values: seen.append([v.numpy().tolist() for v in values]),
                list(strategy.experimental_local_results(per_replica_results)), [])

    train_fn(distributed_iterator)
    out["get_next_as_optional"] = seen

    # "Using the `element_spec` property".
    global_batch_size = 16
    epochs = 5
    steps_per_epoch = 5
    dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(
        global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    traces = []

    @tf.function(input_signature=[dist_dataset.element_spec])
    def train_step_spec(per_replica_inputs):
        traces.append(1)

        def step_fn(inputs):
            return 2 * inputs

        return strategy.run(step_fn, args=(per_replica_inputs,))

    outputs = []
    for _ in range(epochs):
        iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            output = train_step_spec(next(iterator))
            outputs.append(_local(strategy, output[0]))
    out["element_spec"] = {"outputs": outputs, "traces": len(traces)}

    # "Preprocessing with a custom training loop": a Keras layer under scope.
    vocab = ["a", "b", "c", "d", "f"]
    with strategy.scope():
        # Create the layer(s) under scope.
        layer = tf.keras.layers.StringLookup(vocabulary=vocab)

    def dataset_fn_kpl(input_context):
        # a tf.data.Dataset
        dataset = tf.data.Dataset.from_tensor_slices(["a", "c", "e"]).repeat()

        # Custom your batching, sharding, prefetching, etc.
        global_batch_size = 4
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = dataset.batch(batch_size)
        dataset = dataset.shard(
            input_context.num_input_pipelines,
            input_context.input_pipeline_id)

        # Apply the preprocessing layer(s) to the tf.data.Dataset
        def preprocess_with_kpl(input):
            return layer(input)

        processed_ds = dataset.map(preprocess_with_kpl)
        return processed_ds

    distributed_dataset = strategy.distribute_datasets_from_function(
        dataset_fn_kpl)
    # Print out a few example batches.
    distributed_dataset_iterator = iter(distributed_dataset)
    out["preprocessing"] = [_local(strategy, next(distributed_dataset_iterator))
                            for _ in range(3)]

    # "Tensor inputs": values per replica from a function.
    def value_fn(ctx):
        return tf.constant(ctx.replica_id_in_sync_group, tf.float32)

    distributed_values = strategy.experimental_distribute_values_from_function(
        value_fn)
    out["values_from_function"] = _local(
        strategy, strategy.run(lambda v: v * 2, args=(distributed_values,)))
    return out


def sharding_on_workers(strategy, directory):
    """ "Sharding": the AUTO/FILE/DATA/OFF examples (12 elements, global batch
    4, one replica per worker), what this worker's replica gets per step.
    FILE reads two files [0..5] and [6..11], written to `directory`."""
    os.makedirs(directory, exist_ok=True)
    files = []
    for i, values in enumerate((range(0, 6), range(6, 12))):
        path = os.path.join(directory, f"file{i + 1}.txt")
        # Every worker writes the same two files: each through its own
        # temporary name, so the renames do not race.
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write("".join(f"{v}\n" for v in values))
        os.replace(temporary, path)
        files.append(path)
    out = {}
    for name in ("FILE", "DATA", "OFF"):
        if name == "FILE":
            dataset = tf.data.TextLineDataset(files).map(
                lambda line: tf.strings.to_number(line, tf.int64))
        else:
            dataset = tf.data.Dataset.range(12)
        dataset = dataset.batch(4)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, name)
        dataset = dataset.with_options(options)
        out[name] = [values[0] for values in rebatching(strategy, dataset)]
    return out
