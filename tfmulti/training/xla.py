"""XLA for the replica step: each replica's forward and backward compiled.

Only the replica-local work is compiled (`tf.function(jit_compile=True)`);
the gradient all-reduce and the optimizer update stay outside, where
TensorFlow's collectives run (XLA cannot reach them on CPU).

One compiled function per replica, not one shared: a shared function is
traced on the first replica and placed there, and the second replica's call
then fails with "Trying to access resource .../replica_1/... located in
device CPU:1 from device CPU:0" (measured, TF 2.21, MirroredStrategy on
logical CPUs; Keras 3 turns XLA off under tf.distribute for this reason).

An op XLA cannot compile fails when the train function first runs, with
TensorFlow's "Detected unsupported operations" error; `named_compile_errors`
turns it into `XlaCompileError` naming the layer whose op it is.
"""

from __future__ import annotations

import contextlib
import re

import tensorflow as tf

from tfmulti import compat

_UNSUPPORTED = "Detected unsupported operations when trying to compile"
# "... compile graph NAME on XLA_CPU_JIT: PyFunc (No registered ...
#  {{node sequential_1/odd_one_1/PyFunc}}".
_OP = re.compile(r"compile graph \S+ on (\S+): (\w+) \(")
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


class XlaCompileError(ValueError):
    """An op of the model cannot be compiled with XLA.

    Attributes:
      layer: the name of the layer the op belongs to (None: not found).
      op: the op type XLA rejected (None: not found in TF's message).
    """

    def __init__(self, message, *, layer=None, op=None):
        super().__init__(message)
        self.layer = layer
        self.op = op


class PerReplicaCompiled:
    """`fn` compiled with XLA, one `tf.function` per replica.

    Call it in replica context (inside `strategy.run`), as `fn` itself.
    """

    def __init__(self, fn):
        self._fn = fn
        self._compiled = {}

    def __call__(self, *args):
        context = tf.distribute.get_replica_context()
        replica = None if context is None else tf.get_static_value(
            context.replica_id_in_sync_group)
        key = None if replica is None else int(replica)
        if key not in self._compiled:
            self._compiled[key] = tf.function(self._fn, jit_compile=True)
        return self._compiled[key](*args)


def _layer_of(node, model):
    """The innermost layer of `model` whose name scope `node` is in."""
    if model is None:
        return None
    scopes = node.split("/")[:-1]
    names = {layer.name: layer for layer in compat.flatten_layers(model)}
    # Name scopes are made unique with "_1", "_2" suffixes when a layer is
    # called more than once in a process.
    for scope in reversed(scopes):
        for candidate in (scope, re.sub(r"_\d+$", "", scope)):
            if candidate in names:
                return names[candidate]
    return None


@contextlib.contextmanager
def named_compile_errors(model):
    """Turns XLA's "unsupported operations" error into `XlaCompileError`
    naming the layer of `model` (a Keras model, or None) and the op."""
    try:
        yield
    except tf.errors.InvalidArgumentError as e:
        if _UNSUPPORTED not in e.message:
            raise
        op_match, node_match = _OP.search(e.message), _NODE.search(e.message)
        op = op_match.group(2) if op_match else None
        device = op_match.group(1) if op_match else "XLA"
        node = node_match.group(1) if node_match else ""
        layer = _layer_of(node, model)
        where = (f"layer {layer.name!r} ({type(layer).__name__})"
                 if layer is not None else f"node {node!r}")
        raise XlaCompileError(
            f"`jit_compile=True`: {where} uses op {op or '?'}, which XLA "
            f"cannot compile on {device}. Pass jit_compile=False, or "
            "replace that op in the layer (e.g. tf.numpy_function / "
            "tf.py_function and string ops have no XLA kernel).",
            layer=None if layer is None else layer.name, op=op) from e


def check_jit_compile(value) -> bool:
    """`jit_compile` as given to the Trainer or `distributed`: a bool."""
    if not isinstance(value, bool):
        raise ValueError(
            f"`jit_compile` should be True or False, got {value!r}. True "
            "compiles each replica's forward and backward with XLA.")
    return value
