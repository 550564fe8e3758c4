"""`evaluate` of a `distributed` model: Keras's test step on every replica,
`steps_per_execution` batches per call, ending at the end of the data.

Evaluation must see each example exactly once (an endless or unsplit
stream is refused before anything runs) and report a loss of at least one
batch (Keras reports 0.0 for an empty dataset).
"""

from __future__ import annotations

import contextlib
import functools

import tensorflow as tf

from tfmulti import compat, watchdog
from tfmulti.data import eval_padding
from tfmulti.data import finiteness
from tfmulti.keras import replica_logs as logs_lib
from tfmulti.keras import replica_loss as loss_lib
from tfmulti.training import data_checks


FINITE_FIX = ("Pass an exact-once evaluation stream: tfmulti.distribute_"
               "dataset(..., training=False).")



def make_test_function(model, state, force=False):
    """Keras's `make_test_function` for a `distributed` model."""
    if model.test_function is not None and not force:
        return model.test_function
    strategy = model.distribute_strategy
    state.test_logs = None
    own_test_step = model.test_step
    if logs_lib.overrides(model, "test_step"):
        # Its losses are only logged: as one device computes them, not
        # scaled by 1/replicas for a gradient sum (the keras-io guide's
        # `metric.update_state(self.compute_loss(...))`).
        own_test_step = compat.losses_unscaled_in(model.test_step)

    def test_step(batch, masked):
        if masked and len(batch) == 3 and not (
                logs_lib.overrides(model, "test_step") or
                logs_lib.overrides(model, "compute_loss")):
            logs = loss_lib.masked_test_step(model, batch)
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

    results = logs_lib.metrics_function(model)
    custom_read = None

    def test_function(iterator):
        nonlocal custom_read
        if custom_read is None and (
                logs_lib.overrides(model, "test_step") or
                logs_lib.overrides(model, "compute_metrics")):
            # A custom `test_step`'s own logs (or those of Keras's, through
            # a `compute_metrics` override) are what Keras's evaluate
            # returns: keep them (metric names read globally).
            specs = logs_lib.discover_logs(model, own_test_step,
                                   iterator.element_spec)
            logs = logs_lib.Logs(model, specs, specs.keys())
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



def evaluate(model, state, x=None, *args, **kwargs):
    """Keras's `evaluate`, refusing an endless or empty stream."""
    if kwargs.get("steps") is None:
        finiteness.check_finite(x, arg="x", fix=FINITE_FIX + (
            " Or give `steps`."))
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
