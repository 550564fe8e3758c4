"""A pipelined model's optimizer state in the unsplit optimizer's format.

A `PipelinedModel` has one optimizer per (group, stage), each built on its
stage's variables on its stage's device. tfmulti's one checkpoint format
(`training/checkpoints.py`) saves `model=` and `optimizer=`; for a pipeline
`model` is the unsplit model (group 0 trains its variables in place) and
`optimizer` is `optimizer_view`: a trackable with the children a Keras 3
optimizer built on the whole model has (`_iterations`, `_learning_rate`,
`_trainable_variables/i`, `_variables/j`: the slots, variable by variable
in model order), whose values are group 0's stage optimizers' variables. So
a pipelined checkpoint restores into a one-device model and optimizer, and
the reverse, without building a whole-model optimizer on any device.

Where the stage optimizers' slots do not have that layout (an optimizer
that keeps other state), the view holds the stage optimizers themselves as
`stage_0`, `stage_1`, ... instead: still saved and resumed exactly, but
only into the same number of stages (`layout` says which was used).
"""

from __future__ import annotations

import keras
import tensorflow as tf

UNSPLIT = "unsplit"
PER_STAGE = "per_stage"


def _scalars(optimizer):
    """The optimizer's step counter and (if a variable) learning rate."""
    lr = getattr(optimizer, "_learning_rate", None)
    return [optimizer.iterations] + (
        [lr] if isinstance(lr, keras.Variable) else [])


def _slots_by_variable(optimizer, variables):
    """{id(variable): its slots in creation order}, or None when the
    optimizer's variables are not K slots per variable, variable by
    variable, each named after its variable (Keras 3's layout)."""
    scalar_ids = {id(v) for v in _scalars(optimizer)}
    slots = [v for v in optimizer.variables if id(v) not in scalar_ids]
    if not variables or len(slots) % len(variables):
        return None
    per = len(slots) // len(variables)
    result = {}
    for i, variable in enumerate(variables):
        mine = slots[i * per:(i + 1) * per]
        prefix = variable.path.replace("/", "_") + "_"
        if not all(s.name.startswith(prefix) for s in mine):
            return None
        result[id(variable)] = mine
    return result


class OptimizerView(tf.__internal__.tracking.AutoTrackable):
    """Saved as `optimizer=`; its tracked children are the checkpoint's."""

    @property
    def variables(self) -> list:
        """Every variable it saves (the non-finite check reads them)."""
        if hasattr(self, "_variables"):
            return list(self._variables)
        return [v for name in sorted(vars(self)) if name.startswith("stage_")
                for v in getattr(self, name).variables]


def optimizer_view(model, stage_variables, stage_optimizers):
    """The trackable to save as `optimizer=` for a pipelined model.

    Args:
      model: the unsplit Keras model (its variables are group 0's).
      stage_variables: group 0's trainable variables, per stage.
      stage_optimizers: group 0's optimizer, per stage.

    Returns:
      `(view, layout)`: layout is `UNSPLIT` (the view matches a Keras
      optimizer built on `model.trainable_variables`) or `PER_STAGE`.
    """
    view = OptimizerView()
    slots = {}
    for variables, optimizer in zip(stage_variables, stage_optimizers):
        if not variables:
            continue
        found = _slots_by_variable(optimizer, variables)
        if found is None:
            slots = None
            break
        slots.update(found)
    trainable = list(model.trainable_variables)
    if slots is None or any(id(v) not in slots for v in trainable):
        for s, optimizer in enumerate(stage_optimizers):
            setattr(view, f"stage_{s}", optimizer)
        return view, PER_STAGE
    first = next(o for o, v in zip(stage_optimizers, stage_variables) if v)
    scalars = _scalars(first)
    view._iterations = scalars[0]
    if len(scalars) > 1:
        view._learning_rate = scalars[1]
    view._trainable_variables = trainable
    view._variables = scalars + [slot for v in trainable
                                 for slot in slots[id(v)]]
    return view, UNSPLIT


def copy_optimizer_state(source, target) -> None:
    """Assigns `source`'s variables to `target`'s (same class and layout)."""
    for a, b in zip(source.variables, target.variables):
        b.assign(a.value)
