"""Training data that does not fit the loop: a clear error, not a raw one.

The structure is checked once, on the element spec, before anything is
traced (an unbatched dataset would otherwise fail deep inside the step
with an `IndexError`). What only shows while running (data that runs out, a label
outside the model's classes, a batch of another shape than the first ones)
is not checked per batch, which would cost every step: the error TensorFlow
raises is translated where it leaves the loop, naming the argument, what it
held and the fix. One translation for the Trainer's `fit` and `evaluate` and
for Keras `fit` / `evaluate` under `tfmulti.keras.distributed`.
"""

from __future__ import annotations

import contextlib
import re

import tensorflow as tf

from tfmulti import compat

_LABEL = re.compile(r"Received a label value of (-?\d+) which is outside the "
                    r"valid range of \[0, (\d+)\)")
_SHAPE = re.compile(r"(Matrix size-incompatible[^\n]*|Incompatible shapes"
                    r"[^\n]*|Input to reshape is a tensor with[^\n]*)")


def _leaves(element_spec):
    # A multi-replica spec wraps one spec per replica.
    return [compat.replica_spec(leaf)
            for leaf in tf.nest.flatten(element_spec)]


def batch_size(element_spec):
    """The static leading size of the first component of `element_spec`
    (per replica for a distributed dataset's spec), or None."""
    leaf = _leaves(element_spec)[0]
    shape = getattr(leaf, "shape", None)
    if shape is None or shape.rank in (None, 0):
        return None
    return shape[0]


def _describe(element_spec) -> str:
    return ", ".join(f"{leaf.shape}:{leaf.dtype.name}"
                     for leaf in _leaves(element_spec)
                     if hasattr(leaf, "shape"))


def check_batched(element_spec, *, arg: str = "train_data") -> None:
    """Raises unless every component of `element_spec` has one batch axis.

    Args:
      element_spec: the dataset's (or distributed dataset's) element spec.
      arg: the argument's name, for the message.

    Raises:
      ValueError: a scalar component (an unbatched dataset's label), or
        components whose known leading sizes differ.
    """
    leaves = [leaf for leaf in _leaves(element_spec) if hasattr(leaf, "shape")]
    ranks = [leaf.shape.rank for leaf in leaves]
    leading = {leaf.shape[0] for leaf in leaves
               if leaf.shape.rank and leaf.shape[0] is not None}
    if 0 in ranks or len(leading) > 1:
        raise ValueError(
            f"`{arg}` is not batched: its elements are ({_describe(element_spec)}), "
            "and a batch has one leading batch axis shared by x and y. Batch "
            "it with dataset.batch(global_batch_size, drop_remainder=True), "
            "or pass the unbatched dataset_fn(input_context) with "
            "`global_batch_size` (tfmulti.distribute_dataset batches it).")


def check_not_empty(dataset, *, arg: str = "train_data",
                    purpose: str = "train on") -> None:
    """Raises if `dataset` (a `tf.data.Dataset` or a distributed dataset) is
    known to hold nothing.

    Checked before tracing: a `tf.function` looping over a dataset of
    cardinality 0 traced a loop that never reads (TF 2.21), and the Trainer's
    evaluation reused that trace for every later dataset, which then
    yielded no examples too.
    """
    cardinality = dataset.cardinality() if isinstance(
        dataset, tf.data.Dataset) else getattr(dataset, "cardinality", None)
    if cardinality is not None and int(cardinality) == 0:
        raise ValueError(
            f"`{arg}` is empty (its cardinality is 0), so there is nothing "
            f"to {purpose}. Check the split, and any filter(), take() or "
            "batch(drop_remainder=True) of fewer elements than a batch.")


def _has_unknown_inner_dims(element_spec) -> bool:
    return any(leaf.shape.rank is None or any(
        d is None for d in leaf.shape[1:])
        for leaf in _leaves(element_spec) if hasattr(leaf, "shape"))


@contextlib.contextmanager
def translated(element_spec, *, arg: str = "train_data", step=None,
               steps: int | None = None, batches_per_step: int = 1):
    """Translates data errors raised by a loop over the data run inside it.

    The one translation of the Trainer's `fit` and `evaluate` and of Keras
    `fit` / `evaluate` under `tfmulti.keras.distributed`.

    Args:
      element_spec: the data's element spec (None: unknown; then a shape
        error is not translated, since nothing says the shape may vary).
      arg: the argument's name, for the message.
      step: `step()` gives the step count the failing loop started from;
        None for a loop without steps (evaluation).
      steps: the total steps asked for. None when running out of data is
        how the loop ends (evaluation, and Keras's epochs, which stop on
        it): the `OutOfRangeError` then passes through untouched.
      batches_per_step: batches one step reads (`grad_accum_steps`).

    Raises:
      ValueError: from the translated `tf.errors.OutOfRangeError` or
        `tf.errors.InvalidArgumentError`, chained to it.
    """
    where = "" if step is None else (
        f" in the loop starting at step {step()}")
    try:
        yield
    except tf.errors.OutOfRangeError as e:
        if steps is None:
            raise
        raise ValueError(
            f"`{arg}` ran out of batches{where}: `steps`={steps} needs "
            f"{steps} x {batches_per_step} batch(es). Repeat it (dataset."
            "repeat(); tfmulti.distribute_dataset's training mode repeats), "
            "or ask for fewer `steps`.") from e
    except tf.errors.InvalidArgumentError as e:
        label = _LABEL.search(e.message or "")
        if label:
            value, classes = label.groups()
            raise ValueError(
                f"`{arg}` has a label {value}, outside the model's "
                f"{classes} classes (the loss needs labels in [0, {classes})"
                f"). Fix the labels in the dataset, or give the model "
                f"{int(value) + 1} or more outputs.") from e
        shape = _SHAPE.search(e.message or "")
        if shape and element_spec is not None and _has_unknown_inner_dims(
                element_spec):
            raise ValueError(
                f"`{arg}` changed shape mid-stream: its elements are "
                f"({_describe(element_spec)}), with unknown (None) sizes, and "
                f"a batch{where} did not fit the model "
                f"({shape.group(1).strip()}). Make every element the same "
                "shape (resize or pad in the pipeline), or pad each batch to "
                "the size the model expects.") from e
        raise
