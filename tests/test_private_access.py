"""Private Keras/TensorFlow access outside compat.py, held to a known list.

compat.py is where tfmulti touches private Keras and TensorFlow API, each
site with its upstream reference and a guard test. The sites below predate
that rule and are still to move there; this test fails on any NEW site
(move it into compat.py instead) and on a listed one that is gone (delete
its entry, so the list only shrinks).

What counts, found by parsing every module but compat.py: an import from
`tensorflow.python` or `keras.src`, and an attribute starting with one
underscore that no tfmulti module defines itself (a name tfmulti also
assigns or defines is its own, so this cannot see every private use: it is
a guard against new ones, not a proof that none remain).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfmulti"
PRIVATE_MODULES = ("tensorflow.python", "keras.src")

# (module path, private name or module): still outside compat.py.
KNOWN = {
    ("tfmulti/keras/replica_loss.py", "_aggregate_additional_loss"),
    ("tfmulti/keras/fit_input.py", "_symbolic_build"),
    ("tfmulti/keras/fit_input.py", "_compile_loss"),
    ("tfmulti/keras/fit_input.py", "_compile_metrics"),
    ("tfmulti/keras/fit_input.py", "_flatten_layers"),
    ("tfmulti/pipeline/options.py", "_flatten_layers"),
    ("tfmulti/pipeline/placement.py", "_initialize"),
    ("tfmulti/pipeline/split.py", "_keras_history"),
    ("tfmulti/pipeline/split.py", "_nodes_by_depth"),
    ("tfmulti/scheduler_env.py", "tensorflow.python.distribute.cluster_resolver"),
    ("tfmulti/strategies.py", "tensorflow.python.distribute"),
    ("tfmulti/training/async_trainer.py", "tensorflow.python.distribute"),
    ("tfmulti/training/communication.py", "_replica_id"),
    ("tfmulti/training/communication.py", "tensorflow.python.distribute"),
    ("tfmulti/training/coordinator_watch.py", "_is_dead_with_error"),
    ("tfmulti/training/xla.py", "_flatten_layers"),
    ("tfmulti/watchdog.py", "tensorflow.python.eager"),
}


def _trees():
    return {p: ast.parse(p.read_text(), str(p))
            for p in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees):
    """Every name tfmulti defines, assigns, takes as an argument or imports."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(
                    node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx,
                                                           ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                own.update(a.asname or a.name.split(".")[0]
                           for a in node.names)
    return own


def _standard_library(node):
    """`os._exit` and the like: Python's documented API, not Keras's."""
    return isinstance(node.value, ast.Name) and node.value.id in ("os", "sys")


def private_sites(trees, root=ROOT):
    own = _own_names(trees)
    sites = set()
    for path, tree in trees.items():
        if path.relative_to(root).as_posix() == "tfmulti/compat.py":
            continue
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and node.attr not in own
                    and not _standard_library(node)):
                sites.add((where, node.attr))
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            sites.update((where, m) for m in modules
                         if m.startswith(PRIVATE_MODULES))
    return sites


def test_no_new_private_access_outside_compat():
    new = sorted(private_sites(_trees()) - KNOWN)
    assert not new, (
        f"private Keras/TensorFlow access outside tfmulti/compat.py: {new}. "
        "Add an accessor to compat.py (with its upstream reference and a "
        "guard test in tests/test_compat.py) and call that instead.")


def test_known_list_only_shrinks():
    gone = sorted(KNOWN - private_sites(_trees()))
    assert not gone, f"no longer outside compat.py, delete from KNOWN: {gone}"


def test_finds_a_private_attribute_and_import(tmp_path):
    package = tmp_path / "tfmulti"
    package.mkdir()
    source = package / "x.py"
    source.write_text("from keras.src import ops\n"
                      "def f(model):\n    return model._unknown_private\n")
    sites = private_sites({source: ast.parse(source.read_text())},
                          root=tmp_path)
    assert sites == {("tfmulti/x.py", "_unknown_private"),
                     ("tfmulti/x.py", "keras.src")}
