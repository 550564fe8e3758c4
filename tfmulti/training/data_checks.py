"""Training data that does not fit the loop: a clear error, not a raw one.

The structure is checked once, on the element spec, before anything is
traced (an unbatched dataset used to fail deep inside the step with an
`IndexError`). What only shows while running (data that runs out, a label
outside the model's classes, a batch of another shape than the first ones)
is not checked per batch, which would cost every step: the error TensorFlow
raises is translated where it leaves the loop, naming `train_data`, what it
held and the fix.
"""

from __future__ import annotations

import contextlib
import re

import tensorflow as tf

_LABEL = re.compile(r"Received a label value of (-?\d+) which is outside the "
                    r"valid range of \[0, (\d+)\)")
_SHAPE = re.compile(r"(Matrix size-incompatible[^\n]*|Incompatible shapes"
                    r"[^\n]*|Input to reshape is a tensor with[^\n]*)")


def _leaves(element_spec):
    # A multi-replica spec wraps one spec per replica.
    return [getattr(leaf, "_value_specs", (leaf,))[0]
            for leaf in tf.nest.flatten(element_spec)]


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


def check_not_empty(dataset, *, arg: str = "train_data") -> None:
    """Raises if `dataset` is a `tf.data.Dataset` known to hold nothing."""
    if isinstance(dataset, tf.data.Dataset) and int(
            dataset.cardinality()) == 0:
        raise ValueError(
            f"`{arg}` is empty (its cardinality is 0), so there is nothing "
            "to train on. Check the split, and any filter(), take() or "
            "batch(drop_remainder=True) of fewer elements than a batch.")


def _has_unknown_inner_dims(element_spec) -> bool:
    return any(leaf.shape.rank is None or any(
        d is None for d in leaf.shape[1:])
        for leaf in _leaves(element_spec) if hasattr(leaf, "shape"))


@contextlib.contextmanager
def translated(element_spec, *, step, steps: int, batches_per_step: int,
               arg: str = "train_data"):
    """Translates data errors raised by a training loop run inside it.

    Args:
      element_spec: the training data's element spec.
      step: `step()` gives the step count the failing loop started from.
      steps: the total steps asked for.
      batches_per_step: batches one step reads (`grad_accum_steps`).
      arg: the argument's name, for the message.

    Raises:
      ValueError: from the translated `tf.errors.OutOfRangeError` or
        `tf.errors.InvalidArgumentError`, chained to it.
    """
    try:
        yield
    except tf.errors.OutOfRangeError as e:
        raise ValueError(
            f"`{arg}` ran out of batches in the loop starting at step "
            f"{step()}: `steps`={steps} needs {steps} x {batches_per_step} "
            "batch(es). Repeat it (dataset.repeat(); tfmulti."
            "distribute_dataset's training mode repeats), or ask for fewer "
            "`steps`.") from e
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
        if shape and _has_unknown_inner_dims(element_spec):
            raise ValueError(
                f"`{arg}` changed shape while training: its elements are "
                f"({_describe(element_spec)}), with unknown (None) sizes, and "
                f"a batch in the loop starting at step {step()} did not fit the model "
                f"({shape.group(1).strip()}). Make every element the same "
                "shape (resize or pad in the pipeline), or pad each batch to "
                "the size the model expects.") from e
        raise
