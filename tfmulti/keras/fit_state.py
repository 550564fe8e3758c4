"""What `tfmulti.keras.distributed` keeps on a model between Keras's calls,
and what other modules (checkpoints, recipes) read of it."""

from __future__ import annotations

from tfmulti.keras import fit_input as fit_input_lib
from tfmulti.training import communication as communication_lib

# The instance attribute holding this module's state on a model.
STATE = "_tfmulti_fit"


class DistributedState:
    """What `distributed` keeps on a model between Keras's calls: its
    options, the kept input and reducer, and the chunk and evaluation in
    progress."""

    def __init__(self, options, strategy, *, jit_compile=False, sync=None,
                 compression=None, shard_optimizer_state=0):
        self.options = options
        # ZeRO-1: the `optimizer_sharding.ShardedOptimizer` of the train
        # function (made with it, for the compiled optimizer).
        self.shard_optimizer_state = shard_optimizer_state
        self.sharding = None
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
        # Extra keys of an overridden `compute_metrics` (a replica_logs.Logs).
        self.train_extras = None
        # A custom `test_step`'s extra logs (a Logs), captured per batch.
        self.test_logs = None
        self.warned_weighting = False
        # A fit_balance.FitBalance under `balance`, else None.
        self.balance = None
        # The `fit_input.StreamPosition` of the kept endless iterator the
        # current `fit` reads (set by each `fit`), else None.
        self.stream = None


def of(model) -> DistributedState:
    """The state of a model made by `distributed`."""
    return getattr(model, STATE)


def batches_per_step(model) -> int:
    """Batches one step of `model.fit` reads: K for a model made by
    `distributed(model, grad_accum_steps=K)`, else 1."""
    state = getattr(model, STATE, None)
    return state.options.grad_accum_steps if state is not None else 1


def stream_of(model):
    """The `fit_input.StreamPosition` of the endless stream a `distributed`
    model's current `fit` reads from a kept iterator, or None (a finite
    dataset: Keras starts each epoch afresh; not `distributed`)."""
    state = getattr(model, STATE, None)
    return None if state is None else state.stream


def reducer_of(model):
    """The reducer of a `distributed` model's `fit` (its local SGD or
    PowerSGD state), or None before the first train function / without
    `distributed`."""
    state = getattr(model, STATE, None)
    return None if state is None else state.reducer


def sharding_of(model):
    """The `optimizer_sharding.ShardedOptimizer` of a `distributed(model,
    shard_optimizer_state=True)` model's train function, or None (not
    sharded, or before the first `fit`). Its `assign_to(model.optimizer)`
    gathers the state into the optimizer a checkpoint saves."""
    state = getattr(model, STATE, None)
    return None if state is None else state.sharding


def balance_of(model):
    """The `fit_balance.FitBalance` of a `distributed(model, balance=...)`
    model (its `history` of shares per call), or None."""
    state = getattr(model, STATE, None)
    return None if state is None else state.balance


def communication(model) -> dict:
    """All-reduce calls and payload bytes a `distributed` model's `fit` has
    issued on this worker so far (zeros before the first `fit`)."""
    state = getattr(model, STATE, None)
    if state is None:
        raise ValueError(f"`model` {model.name!r} was not made by "
                         "tfmulti.keras.distributed(model).")
    if state.reducer is None:
        return {key: 0 for key in communication_lib.TRAFFIC_KEYS}
    return state.reducer.traffic.result()
