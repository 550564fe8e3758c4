"""`distributed(model)`: Keras `model.fit` through the Trainer's train step.

Keras 3's own train function (TensorFlow backend, checked up to 3.15) runs
`steps_per_execution` steps in a `tf.while_loop` with a `tf.cond` around each
step, which MirroredStrategy cannot run ("You must feed a value for
placeholder tensor"); its optimizer clips each replica's LOCAL gradient
before summing, and its `gradient_accumulation_steps` puts the reduction
inside a `tf.cond` (a crash under any strategy).

`distributed` gives one compiled model instance the train function of
`tfmulti.Trainer`: `tfmulti.training.TrainStep` (one explicit all-reduce per
update, clipping by the reduced norm, accumulation, low-precision reduction,
loss scaling) inside `create_train_loop` (a `tf.range` over
`strategy.run`). Loss, metrics and callbacks stay Keras's: the compiled loss
(`model.compute_loss`), the compiled metrics (`model.compute_metrics`) and
the loss tracker are updated as Keras's `train_step` updates them. Evaluation
runs `model.test_step` `steps_per_execution` times per call without a sync
point inside the conditional that ends it at the end of the data. Nothing in
Keras is patched: only attributes of that model instance change.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

import keras
import tensorflow as tf

from tfmulti import compat, peer_failure, watchdog
from tfmulti import strategies
from tfmulti.data import finiteness
from tfmulti.data import eval_padding
from tfmulti.training import agreement
from tfmulti.training import communication as communication_lib
from tfmulti.training import data_checks
from tfmulti.keras import fit_input as fit_input_lib
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import loop as loop_lib
from tfmulti.training import reducers
from tfmulti.training import step as step_lib
from tfmulti.training import xla as xla_lib

# The instance attribute holding this module's state on a model.
_STATE = "_tfmulti_fit"


def _check_accumulation(optimizer):
    gradients_lib.reject_keras_accumulation(
        optimizer, instead="call tfmulti.keras.distributed(model, "
        "grad_accum_steps={steps})")


def _check_model(model):
    from tfmulti.pipeline import runner as pipeline_runner
    pipeline_runner.refuse_keras_fit(model)
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` should be a keras.Model, got "
                         f"{type(model).__name__}.")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            f"`model` {model.name!r} is not compiled with an optimizer. Call "
            "model.compile(optimizer=..., loss=..., steps_per_execution=...) "
            "under `strategy.scope()` first, then tfmulti.keras."
            "distributed(model).")
    if compat.model_strategy(model) is None:
        # TensorFlow's default strategy has no devices to loop over.
        raise ValueError(
            f"`model` {model.name!r} was built without a strategy. Create it "
            "and compile it under `with strategy.scope():`, with strategy = "
            "tfmulti.create_strategy(...) (\"one_device\" for one device).")
    own = type(model).train_step
    if own is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, which "
            "tfmulti.keras.distributed would silently replace with tfmulti's "
            "step. Override `compute_loss` / `compute_metrics` instead, or "
            "use tfmulti.Trainer.")
    if "train_step" in vars(model):
        raise ValueError(
            f"`model.train_step` of {model.name!r} was replaced on the "
            "instance, which tfmulti.keras.distributed would silently "
            "bypass with tfmulti's step. Override `compute_loss` / "
            "`compute_metrics` instead, or use tfmulti.Trainer.")
    _check_accumulation(model.optimizer)


class _DistributedState:
    """What `distributed` keeps on a model between Keras's calls: its
    options, the kept input and reducer, and the chunk and evaluation in
    progress."""

    def __init__(self, options, strategy, *, jit_compile=False, sync=None,
                 compression=None):
        self.options = options
        self.jit_compile = jit_compile
        # The kept training iterator, across `fit` calls (fit_input.py).
        self.input = fit_input_lib.FitInput(strategy)
        self.sync = sync
        self.compression = compression
        # Made with the first train function and kept: its state (anchors,
        # error feedback) and traffic counts outlive a re-`compile`.
        self.reducer = None
        # Set by `_Chunk` at each batch begin: the first step of the chunk
        # Keras is about to run and the steps in the epoch (None: unknown).
        self.begin = 0
        self.steps = None
        # Epochs begun and train calls finished by the current `fit`: an
        # epoch begun with no call finished had no data (Keras only warns).
        self.epochs_begun = 0
        self.train_calls = 0
        # The argument `evaluate` is reading (`x`, or `validation_data` from
        # inside `fit`) and the batches it evaluated: 0 is an empty dataset
        # (Keras would report a loss of 0.0).
        self.eval_arg = "x"
        self.eval_batches = 0
        # Whether that argument's weights are `distribute_dataset`'s
        # padding mask (the loss then leaves padding out).
        self.eval_masked = False
        # Extra keys of an overridden `compute_metrics` (a `_Logs`).
        self.train_extras = None
        # A custom `test_step`'s extra logs (a `_Logs`), captured per batch.
        self.test_logs = None
        self.warned_weighting = False


def _overrides(model, name) -> bool:
    """Whether `model` overrides Keras's method `name` (class or instance)."""
    return name in vars(model) or (
        getattr(type(model), name) is not getattr(keras.Model, name))


class _Logs:
    """Values a replica step returns that are not the model's metrics.

    Each replica keeps its value times its number of examples, and the
    examples, in sync-on-read SUM variables: a cross-replica read is the
    mean over replicas weighted by their real shares, which is the
    one-device value of a per-batch mean even when a batch splits unevenly
    (Keras's own step functions take the plain mean over replicas). Names
    of the model's metrics are read from the metrics themselves (summed
    over replicas), so they equal one device where a per-replica `result()`
    would not.
    """

    def __init__(self, model, specs, keys):
        self.keys = list(keys)
        self.variables = {}

        def zeros(shape):
            return tf.Variable(
                tf.zeros(shape, tf.float32), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)

        with model.distribute_strategy.scope():
            self.examples = zeros([])
            for key, spec in specs.items():
                if key in self.keys and key not in _metric_names(model):
                    self.variables[key] = zeros(spec.shape)

    def capture(self, logs, batch):
        """In replica context: keeps this replica's values of `logs`."""
        logs = _flat_logs(logs)
        examples = tf.cast(tf.shape(step_lib.first_tensor(batch))[0],
                           tf.float32)
        self.examples.assign(examples)
        for key, variable in self.variables.items():
            variable.assign(tf.cast(logs[key], tf.float32) * examples)

    def read(self, metric_results):
        """In cross-replica context: the logs, in the step's key order."""
        examples = self.examples.read_value()
        return {key: tf.math.divide_no_nan(self.variables[key].read_value(),
                                           examples)
                if key in self.variables else metric_results[key]
                for key in self.keys}


def _metric_names(model):
    return set(model.get_metrics_result().keys())


def _flat_logs(logs):
    """`logs` with nested dicts merged in, as Keras flattens a step's logs
    for the history (a guide's `{m.name: m.result() for m in
    self.metrics}` nests the compiled metrics' dict)."""
    flat = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(_flat_logs(value))
        else:
            flat[key] = value
    return flat


def _discover_logs(model, replica_fn, element_spec):
    """Traces `strategy.run(replica_fn)` once, without running it, and
    returns the specs of the dict it returns."""
    found = []

    def record(batch):
        logs = replica_fn(batch)
        if not isinstance(logs, dict):
            raise ValueError(
                f"{replica_fn.__name__} of {model.name!r} returned "
                f"{type(logs).__name__}; tfmulti.keras.distributed needs a "
                "dict of logs (name -> scalar), as Keras's own steps return.")
        if not found:
            found.append({k: tf.TensorSpec(tf.convert_to_tensor(v).shape,
                                           tf.convert_to_tensor(v).dtype)
                          for k, v in _flat_logs(logs).items()})
        return tf.constant(0.0)

    strategy = model.distribute_strategy
    tf.function(lambda b: strategy.run(record, args=(b,))
                ).get_concrete_function(element_spec)
    for key, spec in found[0].items():
        if not spec.shape.is_fully_defined():
            raise ValueError(
                f"The log {key!r} returned by {replica_fn.__name__} of "
                f"{model.name!r} has shape {spec.shape}; "
                "tfmulti.keras.distributed needs logs of a fixed shape "
                "(scalars).")
    return found[0]


class _Chunk(keras.callbacks.Callback):
    """Tells the train function which steps of the epoch a call runs.

    Keras's train function gets only the iterator; with `steps_per_epoch`
    not a multiple of `steps_per_execution` the last call of an epoch must
    run fewer steps than the others.
    """

    def __init__(self, state):
        super().__init__()
        self._state = state

    def on_train_begin(self, logs=None):
        self._state.steps = self.params.get("steps")
        self._state.begin = 0
        self._state.epochs_begun = self._state.train_calls = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._state.epochs_begun += 1

    def on_train_batch_end(self, batch, logs=None):
        self._state.train_calls += 1

    def on_train_batch_begin(self, batch, logs=None):
        self._state.begin = batch

    def on_train_end(self, logs=None):
        self._state.steps = None


def _steps_this_call(model, state):
    per_call = int(model.steps_per_execution)
    if state.steps is None:
        return per_call
    remaining = state.steps - state.begin
    if remaining < 1:
        raise RuntimeError(
            f"Keras asked for step {state.begin} of an epoch of "
            f"{state.steps} steps; tfmulti's train function cannot tell how "
            "many steps to run.")
    return min(per_call, remaining)


def _forward(model, x, y, sample_weight, *, training):
    """Predictions and the compiled loss as Keras's own steps compute them;
    `_compute_loss` accepts a pre-3.3 `compute_loss(x, y, y_pred,
    sample_weight)` override as Keras does."""
    if compat.call_has_training_arg(model):
        y_pred = model(x, training=training)
    else:
        y_pred = model(x)
    return y_pred, model._compute_loss(x=x, y=y, y_pred=y_pred,
                                       sample_weight=sample_weight,
                                       training=training)


def _loss_reduction(model):
    """"sum_over_batch_size" or "sum" if every compiled loss reduces that
    way (or there is none), else None: how Keras's compiled loss treats a
    replica's batch. Read after the loss was built (at trace time)."""
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None) if compiled else []
    if flat is None:
        return None
    reductions = {getattr(entry[1], "reduction", None) for entry in flat}
    if not reductions:
        return "sum"
    if len(reductions) == 1 and reductions <= {"sum_over_batch_size",
                                               "sum"}:
        return reductions.pop()
    return None


def _warn_weighting_once(model, state, why):
    if state.warned_weighting:
        return
    state.warned_weighting = True
    warnings.warn(
        f"tfmulti.keras.distributed cannot weight a partial or uneven batch "
        f"by each replica's share for {model.name!r}: {why}. Each replica's "
        "loss keeps Keras's 1/replicas weight, so such a batch gives a "
        "different update than one device. Batch the training data with "
        "drop_remainder=True and a global batch divisible by the replicas.",
        UserWarning, stacklevel=2)


def _compute_loss_fn(model):
    strategy = model.distribute_strategy
    num_replicas = strategy.num_replicas_in_sync
    state = getattr(model, _STATE)
    custom_loss = _overrides(model, "compute_loss")

    def compute_loss(x, y, sample_weight, global_batch=None):
        # What Keras's `train_step` does, minus the gradient: the compiled
        # loss is this replica's mean scaled by 1/replicas (Keras).
        y_pred, loss = _forward(model, x, y, sample_weight, training=True)
        local = tf.cast(tf.shape(step_lib.first_tensor(x))[0], loss.dtype)
        if global_batch is None:
            tracked = loss * num_replicas
        else:
            global_batch = tf.cast(global_batch, loss.dtype)
            reduction = None if custom_loss else _loss_reduction(model)
            if reduction == "sum_over_batch_size":
                # Weight the data term by this replica's real share: its
                # mean times local/global, not times 1/replicas. The
                # regularisation terms are the same on every replica and
                # keep 1/replicas.
                extra = tf.zeros_like(loss)
                for term in model.losses:
                    extra += tf.cast(model._aggregate_additional_loss(term),
                                     loss.dtype)
                loss = (loss - extra) * (
                    num_replicas * local / global_batch) + extra
            elif reduction is None:
                _warn_weighting_once(
                    model, state, "it overrides `compute_loss`" if custom_loss
                    else "its compiled losses do not all use the "
                    "'sum_over_batch_size' reduction")
            # Summed over replicas, value x weight is the batch's loss x its
            # size, as one device tracks it.
            tracked = tf.math.divide_no_nan(loss * global_batch, local)
        compat.loss_tracker(model).update_state(tracked, sample_weight=local)
        logs = model.compute_metrics(x, y, y_pred,
                                     sample_weight=sample_weight)
        if state.train_extras is not None:
            state.train_extras.capture(logs, x)
        return loss, y_pred
    return compute_loss


def _train_metrics_logs(model):
    """The logs of `compute_metrics` in training (for the key discovery)."""
    def replica_fn(batch):
        x, y, sample_weight = step_lib.unpack_batch(batch)
        y_pred, _ = _forward(model, x, y, sample_weight, training=True)
        return model.compute_metrics(x, y, y_pred,
                                     sample_weight=sample_weight)
    replica_fn.__name__ = "compute_metrics"
    return replica_fn


def _metrics_function(model):
    # Metric variables are summed over replicas (and workers) on read: one
    # traced read per call, not one eager collective per variable.
    return tf.function(model.get_metrics_result)


def _make_train_function(model, force=False):
    if model.train_function is not None and not force:
        return model.train_function
    state = getattr(model, _STATE)
    strategy = model.distribute_strategy
    optimizer = model.optimizer
    _check_accumulation(optimizer)
    if not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    strategies.check_created_in_scope(strategy, model, optimizer)
    if not gradients_lib.reduces_gradients(optimizer):
        gradients_lib.disable_optimizer_reduction(optimizer)
    communication_options = strategies.communication_options(strategy)
    if state.reducer is None:
        state.reducer = reducers.make_reducer(
            strategy, model.trainable_variables, sync=state.sync,
            compression=state.compression,
            communication_options=communication_options,
            allreduce_dtype=state.options.allreduce_dtype)
    train_step = step_lib.TrainStep(
        strategy, model, optimizer, _compute_loss_fn(model),
        options=state.options, communication_options=communication_options,
        reducer=state.reducer, jit_compile=state.jit_compile)
    train = loop_lib.create_train_loop(train_step, strategy=strategy)
    results = _metrics_function(model)
    extras_read = None

    def train_function(iterator):
        nonlocal extras_read
        if not isinstance(iterator, tf.distribute.DistributedIterator):
            raise ValueError(
                "A model made by tfmulti.keras.distributed trains from the "
                f"distributed iterator `fit` makes; got "
                f"{type(iterator).__name__} (train_on_batch is not "
                "supported: use fit).")
        if extras_read is None and _overrides(model, "compute_metrics"):
            # Extra keys of a `compute_metrics` override reach the history,
            # as in Keras; known only by tracing it once.
            specs = _discover_logs(model, _train_metrics_logs(model),
                                   iterator.element_spec)
            state.train_extras = _Logs(model, specs, specs.keys())
            extras_read = tf.function(
                lambda: state.train_extras.read(model.get_metrics_result()))
        # A label or shape that does not fit is named as in the Trainer;
        # running out of data ends Keras's epoch, as in Keras.
        with data_checks.translated(iterator.element_spec, arg="x"):
            train(iterator,
                  tf.constant(_steps_this_call(model, state), tf.int32))
        if extras_read is not None:
            return extras_read()
        return results()

    model.train_function = train_function
    return train_function


def _make_test_function(model, force=False):
    if model.test_function is not None and not force:
        return model.test_function
    strategy = model.distribute_strategy
    state = getattr(model, _STATE)
    state.test_logs = None
    own_test_step = model.test_step
    if _overrides(model, "test_step"):
        # Its losses are only logged: as one device computes them, not
        # scaled by 1/replicas for a gradient sum (the keras-io guide's
        # `metric.update_state(self.compute_loss(...))`).
        own_test_step = compat.losses_unscaled_in(model.test_step)

    def test_step(batch, masked):
        if masked and len(batch) == 3 and not (
                _overrides(model, "test_step") or
                _overrides(model, "compute_loss")):
            logs = _masked_test_step(model, batch)
        else:
            logs = own_test_step(batch)
        if state.test_logs is not None:
            state.test_logs.capture(logs, batch)

    def run(iterator, num_steps, masked):
        done = tf.constant(0)
        for _ in tf.range(num_steps):
            # No sync point in the test step (metrics are summed on read),
            # so a cond around it is safe; the Optional's `has_value` is
            # agreed by every worker.
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            strategy.run(test_step, args=(batch.get_value(), masked))
            done += 1
        return done

    # One trace for a stream whose weights mask padding, one for the rest.
    runs = {masked: tf.function(functools.partial(run, masked=masked))
            for masked in (False, True)}

    results = _metrics_function(model)
    custom_read = None

    def test_function(iterator):
        nonlocal custom_read
        if custom_read is None and (_overrides(model, "test_step") or
                                    _overrides(model, "compute_metrics")):
            # A custom `test_step`'s own logs (or those of Keras's, through
            # a `compute_metrics` override) are what Keras's evaluate
            # returns: keep them (metric names read globally).
            specs = _discover_logs(model, own_test_step,
                                   iterator.element_spec)
            logs = _Logs(model, specs, specs.keys())
            state.test_logs = logs
            custom_read = tf.function(
                lambda: logs.read(model.get_metrics_result()))
        steps = int(model.steps_per_execution)
        run_eval = runs[state.eval_masked]
        with watchdog.calling(strategy, run_eval), data_checks.translated(
                iterator.element_spec, arg=state.eval_arg):
            done = run_eval(iterator, tf.constant(steps))
        state.eval_batches += int(done)
        if int(done) < steps:
            # The end of the data: Keras's loop stops on this flag. A
            # StopIteration would stop it too, but Keras 3.15 then warns
            # "Your input ran out of data; interrupting training".
            model.stop_evaluating = True
        if custom_read is not None:
            return custom_read()
        return results()

    model.test_function = test_function
    return test_function


def _masked_test_step(model, batch):
    """Keras's `test_step` on an evaluation stream of
    `tfmulti.distribute_dataset`, whose weights are 1 on real examples and
    0 on padding: the loss is averaged over the real examples only.

    Keras's 'sum_over_batch_size' divides the weighted sum by all the rows,
    padding included, and tracks the loss with the row count as its weight,
    so padding would pull the loss towards 0 by an amount that depends on
    the number of replicas. Here the weights are scaled to sum to the rows
    (the batch's loss is the mean over its real examples) and the loss is
    tracked with the real count. Metrics get the mask as their weights, as
    in Keras.
    """
    x, y, mask = batch
    if compat.call_has_training_arg(model):
        y_pred = model(x, training=False)
    else:
        y_pred = model(x)
    compiled = getattr(model, "_compile_loss", None)
    if compiled is not None and not compiled.built:
        # As its first call would; `_loss_reduction` reads what it built.
        compiled.build(y, y_pred)
    rows = tf.cast(tf.shape(step_lib.first_tensor(x))[0], mask.dtype)
    real = tf.reduce_sum(mask)
    weights, count = mask, rows
    if _loss_reduction(model) == "sum_over_batch_size":
        weights, count = mask * tf.math.divide_no_nan(rows, real), real
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                               sample_weight=weights, training=False)
    # Keras's loss carries a 1/replicas scale under a strategy; its own
    # `test_step` tracks it without.
    compat.loss_tracker(model).update_state(
        compat.unscaled_keras_loss(loss, model.distribute_strategy),
        sample_weight=count)
    return model.compute_metrics(x, y, y_pred, sample_weight=mask)


def _spec_batch(element_spec):
    """One replica's batch spec: shapes and dtypes, no data."""
    return tf.nest.map_structure(
        lambda spec: getattr(spec, "_value_specs", (spec,))[0], element_spec)


def _fit(model, *args, **kwargs):
    bound = inspect.signature(type(model).fit).bind(model, *args, **kwargs)
    arguments = bound.arguments
    if finiteness.is_endless(arguments.get("x")) and not arguments.get(
            "steps_per_epoch"):
        raise ValueError(
            f"`steps_per_epoch` is {arguments.get('steps_per_epoch')!r} but "
            "`x` is an endless training stream (tfmulti.distribute_dataset "
            "repeats it), so the first epoch would never end. Pass "
            "steps_per_epoch=<examples per epoch> // global_batch_size.")
    if arguments.get("validation_data") is not None:
        finiteness.check_finite(
            arguments["validation_data"], arg="validation_data",
            fix=_FINITE_FIX)
    x = arguments.get("x")
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        # As the Trainer checks `train_data`: before anything is traced.
        data_checks.check_batched(x.element_spec, arg="x")
        data_checks.check_not_empty(x, arg="x")
    if "shuffle" not in bound.arguments and isinstance(
            bound.arguments.get("x"), (tf.data.Dataset,
                                       tf.distribute.DistributedDataset)):
        # Keras ignores it for datasets, and warns when it is True (its
        # default).
        bound.arguments["shuffle"] = False
    callbacks = bound.arguments.get("callbacks")
    state = getattr(model, _STATE)
    x = bound.arguments.get("x")
    if state.input.reusable(x,
                            class_weight=bound.arguments.get("class_weight")):
        bound.arguments["x"] = state.input.dataset_for(x)
    chunk = _Chunk(state)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(chunk)
    else:
        bound.arguments["callbacks"] = [chunk, *(callbacks or [])]
    # A lost peer surfaces as PeerFailureError naming the cause, as in the
    # Trainer.
    with peer_failure.translated(model.distribute_strategy):
        # Before Keras builds the train function: another grad_accum_steps
        # creates other variables, whose broadcasts would meet this check.
        _check_workers_agree(model, state, dict(bound.arguments, x=x))
        history = type(model).fit(*bound.args, **bound.kwargs)
    if state.epochs_begun and not state.train_calls:
        raise ValueError(
            "`x` ran out of data before the first call of the train function "
            f"finished ({int(model.steps_per_execution)} batch(es), "
            "`steps_per_execution`): it is empty, or shorter than that, so "
            "nothing was trained (Keras only warns). Check the split and any "
            "filter() in the pipeline.")
    return history


def _global_batch(strategy, x, batch_size) -> int:
    """The batch summed over replicas that `fit` will train with (0: not
    known statically)."""
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return batch_size or 32  # Keras's default for arrays
    size = data_checks.batch_size(spec)
    if size is None:
        return 0
    per_replica = isinstance(x, tf.distribute.DistributedDataset)
    return size * strategy.num_replicas_in_sync if per_replica else size


def _check_workers_agree(model, state, arguments):
    """The Trainer's config agreement, for Keras `fit` on several workers:
    one all-reduce of the settings that must match (a no-op on one)."""
    strategy = model.distribute_strategy
    agreement.check_agreement(strategy, {
        "global_batch_size": _global_batch(strategy, arguments.get("x"),
                                           arguments.get("batch_size")),
        "grad_accum_steps": state.options.grad_accum_steps,
        "steps_per_execution": int(model.steps_per_execution),
        "steps_per_epoch": arguments.get("steps_per_epoch") or 0,
        "epochs": arguments.get("epochs", 1),
        "model variable shapes (fingerprint)":
            agreement.shapes_fingerprint(model.variables),
    })


_FINITE_FIX = ("Pass an exact-once evaluation stream: tfmulti.distribute_"
               "dataset(..., training=False).")


def _evaluate(model, x=None, *args, **kwargs):
    if kwargs.get("steps") is None:
        finiteness.check_finite(x, arg="x", fix=_FINITE_FIX + (
            " Or give `steps`."))
    state = getattr(model, _STATE)
    # Keras's `fit` validates through this method, with its cached dataset.
    state.eval_arg = ("validation_data" if kwargs.get(
        "_use_cached_eval_dataset") else "x")
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        data_checks.check_not_empty(x, arg=state.eval_arg,
                                    purpose="evaluate")
    state.eval_batches = 0
    state.eval_masked = eval_padding.has_padding_mask(x)
    # Between local-SGD synchronisations: on the workers' mean weights.
    with (state.reducer.evaluation_weights() if state.reducer is not None
          else contextlib.nullcontext()):
        logs = type(model).evaluate(model, x, *args, **kwargs)
    if not state.eval_batches:
        raise ValueError(
            f"`{state.eval_arg}` yielded no batches (an empty dataset), so "
            "there is no loss to report (Keras would report 0.0). Check the "
            "split and any filter() in the pipeline.")
    return logs


def _maybe_symbolic_build(model, iterator=None, data_batch=None):
    """Keras's symbolic build, only when something is left to build, and
    from the data's spec instead of a real batch.

    Keras 3.15's TF trainer reads one batch from a fresh iterator of the
    data (all-reducing it eagerly across workers), builds from it and drops
    the iterator, at every `fit` and `evaluate`, even when everything is
    built: each such iterator costs 0.2-1 s, its prefetching is cancelled
    ("Local rendezvous is aborting with status: CANCELLED"), a cache being
    filled is discarded ("did not fully read the dataset being cached"), and
    the eager reduction warns that the strategy is used eagerly. Only shapes
    and dtypes are needed, and the distributed dataset has them.
    """
    if not fit_input_lib.needs_symbolic_build(model):
        return None
    dataset = getattr(iterator, "_distributed_dataset", None)
    if data_batch is None and dataset is not None:
        with model.distribute_strategy.scope():
            return model._symbolic_build(
                iterator=iterator,
                data_batch=_spec_batch(dataset.element_spec))
    with getattr(model, _STATE).input.probing():
        return type(model)._maybe_symbolic_build(
            model, iterator=iterator, data_batch=data_batch)


def batches_per_step(model) -> int:
    """Batches one step of `model.fit` reads: K for a model made by
    `distributed(model, grad_accum_steps=K)`, else 1."""
    state = getattr(model, _STATE, None)
    return state.options.grad_accum_steps if state is not None else 1


def reducer_of(model):
    """The reducer of a `distributed` model's `fit` (its local SGD or
    PowerSGD state), or None before the first train function / without
    `distributed`."""
    state = getattr(model, _STATE, None)
    return None if state is None else state.reducer


def communication(model) -> dict:
    """All-reduce calls and payload bytes a `distributed` model's `fit` has
    issued on this worker so far (zeros before the first `fit`)."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError(f"`model` {model.name!r} was not made by "
                         "tfmulti.keras.distributed(model).")
    if state.reducer is None:
        return {key: 0 for key in communication_lib.TRAFFIC_KEYS}
    return state.reducer.traffic.result()


def distributed(model, *, grad_accum_steps: int = 1,
                clip_global_norm: float | None = None,
                allreduce_dtype: str | None = None,
                jit_compile: bool = False, sync=None, compression=None):
    """Makes `model.fit` train with tfmulti's step under the model's strategy.

    Call after `model.compile(...)` under `strategy.scope()`; then call
    `model.fit`, `model.evaluate` and `model.predict` as usual, with any
    `steps_per_execution`. Changes only this instance: its
    `make_train_function` and `make_test_function` (and `fit`, to learn
    where each call starts in the epoch); returns the same model. The
    optimizer's own cross-replica reduction is replaced (see
    `tfmulti.training.disable_optimizer_reduction`), so the optimizer's
    `clipnorm` / `global_clipnorm` act on the reduced gradient too. Mixed
    precision follows the model's dtype policy: under "mixed_float16"
    `compile` wraps the optimizer in a LossScaleOptimizer, whose overflow
    check then runs on the reduced gradient.

    With `grad_accum_steps` K, one step of `fit` (and of `steps_per_epoch`)
    is one update over K batches.

    The train function is traced once and kept across `fit` calls. Given
    the same INFINITE dataset object again, `fit` continues from the same
    distributed iterator (no new one, about 0.2-1 s each under a strategy):
    `fit(ds, epochs=1)` twice trains like `fit(ds, epochs=2)`, where plain
    Keras would restart `ds`. Pass a new dataset object to start over;
    finite datasets restart every epoch, as in Keras (`fit_input.py`).

    A `tfmulti.pipeline.PipelinedModel` is taken too: the result is its
    unsplit model, compiled, whose `fit` runs the pipelined step
    (`tfmulti.keras.pipelined`).

    Args:
      model: a Keras 3 model built and compiled under a strategy's scope
        (`tfmulti.create_strategy`: one_device, mirrored or multi_worker),
        or a PipelinedModel.
      grad_accum_steps: K batches per optimizer update, one all-reduce.
      clip_global_norm: clip the REDUCED gradient to this global norm.
      allreduce_dtype: None, "float16" or "bfloat16": gradients on the wire.
      jit_compile: compile each replica's forward and backward with XLA
        (`tfmulti.training.xla`; the all-reduce stays outside). Independent
        of Keras's `compile(jit_compile=...)`, which Keras turns off under a
        strategy.
      sync: None or `tfmulti.LocalSGD(every=H, ...)`: workers synchronise
        every H updates. Its state is not in Keras checkpoints (use the
        Trainer to resume local SGD).
      compression: None or `tfmulti.PowerSGD(rank=r)`.

    Returns:
      `model`.

    Raises:
      ValueError: the model is not compiled, was built without a strategy,
        overrides `train_step`, its
        optimizer uses `gradient_accumulation_steps`, or an option is bad.
    """
    from tfmulti.keras import pipelined
    from tfmulti.pipeline import runner as pipeline_runner
    if pipeline_runner.is_pipelined(model):
        return pipelined.distributed(
            model, grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype, jit_compile=jit_compile,
            sync=sync, compression=compression)
    _check_model(model)
    options = step_lib.GradientOptions(
        grad_accum_steps=grad_accum_steps, clip_global_norm=clip_global_norm,
        allreduce_dtype=allreduce_dtype)
    reducers.check_options(sync, compression,
                            allreduce_dtype=allreduce_dtype)
    setattr(model, _STATE, _DistributedState(
        options, model.distribute_strategy,
        jit_compile=xla_lib.check_jit_compile(jit_compile), sync=sync,
        compression=compression))
    # Instance attributes shadow the class's methods for this model only;
    # `compile` resets the functions to None, so they are made lazily.
    model.make_train_function = functools.partial(_make_train_function,
                                                  model)
    model.make_test_function = functools.partial(_make_test_function, model)
    model.fit = functools.partial(_fit, model)
    # An endless `x` (the training stream) would never finish evaluating.
    model.evaluate = functools.partial(_evaluate, model)
    model._maybe_symbolic_build = functools.partial(_maybe_symbolic_build,
                                                    model)
    model.train_function = None
    model.test_function = None
    return model
