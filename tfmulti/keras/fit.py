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

import keras
import tensorflow as tf

from tfmulti import peer_failure
from tfmulti import strategies
from tfmulti.data import finiteness
from tfmulti.training import agreement
from tfmulti.training import data_checks
from tfmulti.keras import evaluate as evaluate_lib
from tfmulti.keras import fit_balance
from tfmulti.keras import fit_checks as checks
from tfmulti.keras import fit_input as fit_input_lib
from tfmulti.keras import fit_state
from tfmulti.keras import replica_logs as logs_lib
from tfmulti.keras import replica_loss as loss_lib
from tfmulti.training import gradients as gradients_lib
from tfmulti.training import loop as loop_lib
from tfmulti.training import optimizer_sharding, shard_placement
from tfmulti.training import reducers
from tfmulti.training import step as step_lib
from tfmulti.training import trainer_args as args_lib
from tfmulti.training import xla as xla_lib

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


def _make_train_function(model, force=False):
    if model.train_function is not None and not force:
        return model.train_function
    state = fit_state.of(model)
    strategy = model.distribute_strategy
    optimizer = model.optimizer
    checks.check_accumulation(optimizer)
    if not optimizer.built:
        _build_optimizer(model, state)
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
    if state.shard_optimizer_state and (
            state.sharding is None or state.sharding.optimizer is not
            optimizer):
        with strategy.scope():
            state.sharding = optimizer_sharding.ShardedOptimizer(
                strategy, optimizer, model.trainable_variables,
                stage=state.shard_optimizer_state,
                communication_options=communication_options,
                wire_dtype=state.options.allreduce_dtype)
    train_step = step_lib.TrainStep(
        strategy, model, optimizer, loss_lib.compute_loss_fn(model, state),
        options=state.options, communication_options=communication_options,
        reducer=state.reducer, jit_compile=state.jit_compile,
        sharding=state.sharding, timer=fit_balance.timer_of(state.balance))
    train = None
    lengths = {}

    def train_function(iterator):
        nonlocal train
        if not isinstance(iterator, fit_balance.ITERATOR_TYPES):
            raise ValueError(
                "A model made by tfmulti.keras.distributed trains from the "
                f"distributed iterator `fit` makes; got "
                f"{type(iterator).__name__} (train_on_batch is not "
                "supported: use fit).")
        if train is None:
            read = model.get_metrics_result
            if logs_lib.overrides(model, "compute_metrics"):
                # Extra keys of a `compute_metrics` override reach the
                # history, as in Keras; known only by tracing it once.
                specs = logs_lib.discover_logs(
                    model, loss_lib.train_metrics_logs(model),
                    iterator.element_spec)
                state.train_extras = logs_lib.Logs(model, specs,
                                                   specs.keys())
                read = lambda: state.train_extras.read(  # noqa: E731
                    model.get_metrics_result())
            # The logs are read inside the loop's call: one function call
            # per loop, no per-step loss array (the second call and the
            # array cost about 5% of a small model's loop at N=1: fit/bare
            # loop 0.954 [0.907, 1.003] before, 1.005 [0.971, 1.041] after).
            train = loop_lib.create_train_loop(train_step, strategy=strategy,
                                               read=read)
        steps = _steps_this_call(model, state)
        if steps not in lengths:
            lengths[steps] = tf.constant(steps, tf.int32)
        # A label or shape that does not fit is named as in the Trainer;
        # running out of data ends Keras's epoch, as in Keras.
        with data_checks.translated(iterator.element_spec, arg="x"):
            logs = train(iterator, lengths[steps])
        if state.stream is not None:
            state.stream.read(iterator,
                              steps * fit_state.batches_per_step(model))
        return fit_balance.logs_after(state.balance, steps, logs)

    model.train_function = train_function
    return train_function


def _build_optimizer(model, state):
    """Builds the compiled optimizer under the model's strategy; sharded,
    as plain variables on the host: the unsharded form checkpoints hold
    (`shard_placement.host_variables`)."""
    strategy = model.distribute_strategy
    with strategy.scope(), (shard_placement.host_variables(strategy)
                            if state.shard_optimizer_state
                            else contextlib.nullcontext()):
        model.optimizer.build(model.trainable_variables)


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
            fix=evaluate_lib.FINITE_FIX)
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
    state = fit_state.of(model)
    x = bound.arguments.get("x")
    state.stream = None
    if state.balance is not None:
        bound.arguments["x"], bound.arguments["steps_per_epoch"] = (
            state.balance.dataset_for(x, steps_per_epoch=bound.arguments.get(
                "steps_per_epoch")))
        state.stream = state.balance.position
    elif state.input.reusable(
            x, class_weight=bound.arguments.get("class_weight")):
        bound.arguments["x"] = state.input.dataset_for(x)
        state.stream = state.input.position
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
        if state.sharding is not None:
            # model.optimizer then holds the state, for model.save and the
            # like (BackupAndRestore gathers at each of its own saves).
            state.sharding.assign_to(model.optimizer)
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



def distributed(model, *, grad_accum_steps: int = 1,
                clip_global_norm: float | None = None,
                allreduce_dtype: str | None = None,
                jit_compile: bool = False, sync=None, compression=None,
                shard_optimizer_state: bool = False, balance=None):
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
      shard_optimizer_state: the ZeRO stage (`tfmulti.training.
        optimizer_sharding`): True or 1, each replica keeps the optimizer
        state of 1/N of the parameters; 2, also only its 1/N of the reduced
        gradient (reduce-scattered). `model.optimizer` (unbuilt at this call; built
        here in host memory) is the unsharded form:
        `tfmulti.keras.BackupAndRestore` gathers the shards into it before
        each save and loads them from it after a restore, and the end of
        each `fit` gathers them; a ModelCheckpoint during `fit` sees it as
        of the last such gather.
      balance: None (an even split), "auto" or per-replica (or per-worker)
        weights: each replica's share of the global batch
        (`tfmulti.keras.fit_balance`); the updates stay the even split's.

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
        fit_balance.refuse_pipelined(balance)
        args_lib.check_sharding(
            shard_optimizer_state, strategy=None, optimizer=None,
            pipelined=True, sync=sync, compression=compression)
        return pipelined.distributed(
            model, grad_accum_steps=grad_accum_steps,
            clip_global_norm=clip_global_norm,
            allreduce_dtype=allreduce_dtype, jit_compile=jit_compile,
            sync=sync, compression=compression)
    options, sharded = checks.check_arguments(
        model, grad_accum_steps=grad_accum_steps,
        clip_global_norm=clip_global_norm, allreduce_dtype=allreduce_dtype,
        sync=sync, compression=compression,
        shard_optimizer_state=shard_optimizer_state)
    state = fit_state.DistributedState(
        options, model.distribute_strategy,
        jit_compile=xla_lib.check_jit_compile(jit_compile), sync=sync,
        compression=compression, shard_optimizer_state=sharded)
    state.balance = fit_balance.for_model(
        model.distribute_strategy, balance, jit_compile=state.jit_compile)
    if sharded:
        # Now, before Keras's first `fit` builds it mirrored.
        _build_optimizer(model, state)
    setattr(model, fit_state.STATE, state)
    # Instance attributes shadow the class's methods for this model only;
    # `compile` resets the functions to None, so they are made lazily.
    model.make_train_function = functools.partial(_make_train_function,
                                                  model)
    model.make_test_function = functools.partial(
        evaluate_lib.make_test_function, model, state)
    model.fit = functools.partial(_fit, model)
    # An endless `x` (the training stream) would never finish evaluating.
    model.evaluate = functools.partial(evaluate_lib.evaluate, model, state)
    model._maybe_symbolic_build = functools.partial(
        fit_input_lib.maybe_symbolic_build, model, state.input)
    model.train_function = None
    model.test_function = None
    return model
