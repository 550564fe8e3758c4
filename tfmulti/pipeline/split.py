"""Cutting a Keras functional or Sequential model into pipeline stages.

A cut after layer L puts L and every layer before it (in `model.layers`
order, which Keras keeps topological) into the earlier stage. Each stage
becomes a Keras functional sub-model over the SAME layer objects, so the
stages share the unsplit model's variables: saving the model saves the
pipeline, and a checkpoint of either loads into the other.

The tensors that cross a cut are the cut layer's outputs. A skip connection
across a cut (a later layer reading an earlier tensor) is carried through the
intermediate stages only when the caller allows it (`carry_skips=True`),
because it adds a transfer per micro-batch at every cut it crosses.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import keras
import numpy as np

from tfmulti import compat


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
      index: position in the pipeline, from 0.
      layer_names: the model's layers in this stage, in order.
      model: a functional model over those layers, from the tensors that
        enter the stage to the tensors that leave it.
      carried: names of layers (or inputs) whose output passes through this
        stage's end only because a later stage reads it (a carried skip).
    """

    index: int
    layer_names: tuple[str, ...]
    model: keras.Model
    carried: tuple[str, ...] = ()


def _functional(model: keras.Model) -> keras.Model:
    """The functional graph behind `model` (Sequential keeps one inside)."""
    if isinstance(model, keras.Sequential):
        inner = compat.sequential_graph(model)
        if inner is None:
            raise ValueError(
                f"`model` is a Sequential ({model.name!r}) that is not built "
                "yet, so its layers have no connections to cut. Give it an "
                "input shape first: keras.Sequential([keras.Input(shape), "
                "...]) or model.build(input_shape).")
        return inner
    if not compat.has_layer_graph(model):
        raise ValueError(
            f"`model` ({type(model).__name__} {model.name!r}) is a subclassed "
            "model, whose graph is hidden in its Python `call`. The pipeline "
            "cuts a functional or Sequential model: rebuild it with "
            "keras.Model(inputs, outputs).")
    return model


def _graph(model: keras.Model):
    """(ordered ops, {op: input tensors}, model inputs, model outputs)."""
    fn = _functional(model)
    nodes_of = {}
    for node in compat.graph_nodes(fn):
        nodes_of.setdefault(id(node.operation), []).append(node)
    ops, inputs_of = [], {}
    for op in fn.operations:
        if isinstance(op, keras.layers.InputLayer):
            continue
        nodes = nodes_of.get(id(op), [])
        if len(nodes) != 1:
            raise ValueError(
                f"Layer {op.name!r} is called {len(nodes)} times in `model`; "
                "the pipeline places each layer on one device and needs each "
                "called once. Use a separate layer per call.")
        ops.append(op)
        inputs_of[id(op)] = list(nodes[0].input_tensors)
    return ops, inputs_of, list(fn.inputs), list(fn.outputs)


def _producer(tensor) -> str:
    return compat.producer(tensor).name


def layer_names(model: keras.Model) -> list[str]:
    """The names of the model's cuttable layers, in pipeline order."""
    return [op.name for op in _graph(model)[0]]


def _live_after(ops, inputs_of, model_inputs, model_outputs, cut: int):
    """Tensors made at or before op index `cut` that later ops need."""
    position = {id(op): i for i, op in enumerate(ops)}
    needed = []
    for op in ops[cut + 1:]:
        needed.extend(inputs_of[id(op)])
    needed.extend(model_outputs)
    live, seen = [], set()
    made_early = {id(t) for t in model_inputs}
    for op in ops[:cut + 1]:
        made_early.update(id(t) for t in keras.tree.flatten(op.output))
    for t in needed:
        if id(t) in made_early and id(t) not in seen:
            seen.add(id(t))
            live.append(t)
    # The cut layer's own outputs first: they are the chain.
    cut_outputs = {id(t) for t in keras.tree.flatten(ops[cut].output)}
    live.sort(key=lambda t: (id(t) not in cut_outputs,
                             position.get(id(compat.producer(t)), -1)))
    return live, cut_outputs


def _chain_cut_positions(ops, inputs_of, model_inputs, model_outputs):
    """Indexes after which cutting crosses no skip connection."""
    positions = []
    for i in range(len(ops) - 1):
        live, cut_outputs = _live_after(ops, inputs_of, model_inputs,
                                        model_outputs, i)
        if live and all(id(t) in cut_outputs for t in live):
            positions.append(i)
    return positions


def _layer_params(op) -> int:
    return int(sum(np.prod(v.shape) for v in op.weights))


def balanced_cuts(model: keras.Model, num_stages: int, *,
                  carry_skips: bool = False) -> list[str]:
    """Cut layer names that balance `num_stages` stages by parameter count.

    Minimises the largest stage's parameter count over the cut positions
    that cross no skip connection (any position with `carry_skips`), so the
    largest stage holds at most the balanced share plus one layer.

    Args:
      model: a functional or Sequential Keras model.
      num_stages: number of stages, at least 1.
      carry_skips: allow cuts that skip connections cross.

    Returns:
      `num_stages - 1` layer names; each is the last layer of a stage.
    """
    ops, inputs_of, model_inputs, model_outputs = _graph(model)
    if num_stages == 1:
        return []
    allowed = (list(range(len(ops) - 1)) if carry_skips else
               _chain_cut_positions(ops, inputs_of, model_inputs,
                                    model_outputs))
    if len(allowed) < num_stages - 1:
        raise ValueError(
            f"`num_stages`={num_stages} needs {num_stages - 1} cuts, but "
            f"model {model.name!r} has only {len(allowed)} place(s) to cut "
            f"{'' if carry_skips else 'that no skip connection crosses '}"
            f"({[ops[i].name for i in allowed]}). Use fewer stages"
            f"{'' if carry_skips else ' or pass carry_skips=True'}.")
    prefix = np.cumsum([0] + [_layer_params(op) for op in ops])
    n = len(ops)

    def cost(start, end):  # ops[start:end]
        return int(prefix[end] - prefix[start])

    # best[k][i]: the smallest possible largest stage when ops[:i + 1] form
    # k + 1 stages ending with a cut after i (an allowed position).
    ends = allowed + [n - 1]
    best = {(0, i): (cost(0, i + 1), None) for i in ends}
    for k in range(1, num_stages):
        for j_index, j in enumerate(ends):
            if k == num_stages - 1 and j != n - 1:
                continue
            options = []
            for i in ends[:j_index]:
                if (k - 1, i) in best:
                    options.append((max(best[(k - 1, i)][0],
                                        cost(i + 1, j + 1)), i))
            if options:
                best[(k, j)] = min(options)
    cuts, position, k = [], n - 1, num_stages - 1
    while k > 0:
        previous = best[(k, position)][1]
        cuts.append(ops[previous].name)
        position, k = previous, k - 1
    return cuts[::-1]


def split_model(model: keras.Model, cuts: Sequence[str], *,
                carry_skips: bool = False) -> list[Stage]:
    """Cuts `model` after each layer named in `cuts`.

    Args:
      model: a functional or Sequential Keras model, built.
      cuts: names of the last layer of every stage but the last, in order.
      carry_skips: carry tensors that skip connections need across a cut
        (otherwise such a cut is an error that names the layers).

    Returns:
      `len(cuts) + 1` stages.

    Raises:
      ValueError: an unknown or repeated cut name, cuts out of order, or a
        skip connection across a cut without `carry_skips`.
    """
    ops, inputs_of, model_inputs, model_outputs = _graph(model)
    names = [op.name for op in ops]
    index = []
    for cut in cuts:
        if cut not in names:
            raise ValueError(
                f"`cuts` names layer {cut!r}, which is not a layer of model "
                f"{model.name!r}. Its layers, in order: {names}.")
        index.append(names.index(cut))
    if index != sorted(set(index)) or (index and index[-1] == len(ops) - 1):
        raise ValueError(
            f"`cuts`={list(cuts)} should name distinct layers in model "
            "order, not the last layer (each stage needs at least one "
            f"layer). The layers, in order: {names}.")
    stage_of = {}
    bounds = [-1] + index + [len(ops) - 1]
    for s in range(len(bounds) - 1):
        for op in ops[bounds[s] + 1:bounds[s + 1] + 1]:
            stage_of[id(op)] = s
    boundaries = [list(model_inputs)]
    carried_by = []
    for s, cut in enumerate(index):
        live, cut_outputs = _live_after(ops, inputs_of, model_inputs,
                                        model_outputs, cut)
        extra = [t for t in live if id(t) not in cut_outputs]
        if extra and not carry_skips:
            t = extra[0]
            users = [op.name for op in ops[cut + 1:]
                     if any(u is t for u in inputs_of[id(op)])]
            user = users[0] if users else "the model output"
            raise ValueError(
                f"`cuts` is not a chain: layer {user!r} (after the cut at "
                f"{ops[cut].name!r}) reads the output of {_producer(t)!r}, "
                f"which is before the cut, so that tensor would have to "
                f"cross the cut besides {ops[cut].name!r}'s output. Cut "
                "where no skip connection crosses (e.g. after the layer "
                f"that merges it), or pass carry_skips=True to carry "
                f"{_producer(t)!r}'s output through the cut.")
        boundaries.append(live)
        carried_by.append(tuple(_producer(t) for t in extra))
    boundaries.append(list(model_outputs))
    stages = []
    for s in range(len(bounds) - 1):
        stage_model = keras.Model(boundaries[s], boundaries[s + 1],
                                  name=f"{model.name}_stage{s}")
        expected = {op.name for op in ops if stage_of[id(op)] == s}
        got = {op.name for op in _graph(stage_model)[0]}
        if got != expected:
            raise ValueError(
                f"Stage {s} of `model` {model.name!r} would need layers "
                f"{sorted(got - expected)} from other stages; the cuts "
                f"{list(cuts)} do not separate the graph into a chain.")
        stages.append(Stage(
            index=s,
            layer_names=tuple(op.name for op in ops
                              if stage_of[id(op)] == s),
            model=stage_model,
            carried=carried_by[s] if s < len(carried_by) else ()))
    return stages
