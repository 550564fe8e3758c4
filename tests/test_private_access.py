"""No private Keras/TensorFlow access outside tfmulti/compat/.

tfmulti/compat/ is where tfmulti touches private Keras and TensorFlow API,
each site with its upstream reference and a guard test
(`tests/test_compat.py::test_private_names_tfmulti_reads_still_exist` and
the others there). This test fails on any site outside it: add an accessor
there and call that instead.

What counts, found by parsing every module outside compat/: an import from
`tensorflow.python` or `keras.src`, an attribute starting with one
underscore, and a `getattr`/`hasattr`/`setattr` of such a name, unless a
tfmulti module outside compat/ defines or assigns that name itself (then it
is tfmulti's own). A name tfmulti assigns can hide a private use of the
same name, so this is a guard against new sites, not a proof that none
remain.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfmulti"
PRIVATE_MODULES = ("tensorflow.python", "keras.src")

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


def _private(name, own):
    return (name.startswith("_") and not name.startswith("__")
            and name not in own)


def _named_attribute(node):
    """The attribute name of `getattr(x, "name")` and the like, or None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


def private_sites(trees, root=ROOT):
    outside = {p: t for p, t in trees.items() if not p.relative_to(
        root).as_posix().startswith("tfmulti/compat/")}
    own = _own_names(outside)
    sites = set()
    for path, tree in outside.items():
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr, own)
                    and not _standard_library(node)):
                sites.add((where, node.attr))
            named = _named_attribute(node)
            if named is not None and _private(named, own):
                sites.add((where, named))
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            sites.update((where, m) for m in modules
                         if m.startswith(PRIVATE_MODULES))
    return sites


def test_no_private_access_outside_compat():
    sites = sorted(private_sites(_trees()))
    assert not sites, (
        f"private Keras/TensorFlow access outside tfmulti/compat/: {sites}. "
        "Add an accessor to the tfmulti/compat/ module of its area (with its "
        "upstream reference and a guard test in tests/test_compat.py) and "
        "call that instead.")


def test_the_check_sees_each_kind_of_site(tmp_path):
    """The detector itself: each kind of private access outside compat/ is
    found, the same inside compat/ is not, and tfmulti's own names pass."""
    source = ("from keras.src import ops\n"
              "import tensorflow.python.eager\n"
              "def f(model, strategy):\n"
              "    model._compile_loss\n"
              "    getattr(strategy, '_extended_private', None)\n"
              "    model._tfmulti_state = 1\n"
              "    return model._tfmulti_state\n")
    package = tmp_path / "tfmulti"
    (package / "compat").mkdir(parents=True)
    (package / "user.py").write_text(source)
    (package / "compat" / "x.py").write_text(source.replace("f(", "g("))
    trees = {p: ast.parse(p.read_text()) for p in package.rglob("*.py")}
    assert private_sites(trees, root=tmp_path) == {
        ("tfmulti/user.py", "keras.src"),
        ("tfmulti/user.py", "tensorflow.python.eager"),
        ("tfmulti/user.py", "_compile_loss"),
        ("tfmulti/user.py", "_extended_private")}
