"""The package's import order, checked from the source (no import runs).

The layers are written down once, in README's "Layout" section; this test
holds the same list. A module may import from its own layer or a layer
above it (earlier in `LAYERS`), never from a layer below, and the modules
of tfmulti must not import each other in a circle. Imports inside
functions count too: a lazy import hides an upward dependency, it does not
remove it.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfmulti"

# Top to bottom; a prefix names a module or a whole subpackage.
LAYERS = (
    ("base", ("compat", "devices", "scheduler_env", "cluster", "startup",
              "startup_watchdog", "watchdog", "rundir", "progress",
              "exit_codes",
              "quiet_logging", "reaper", "schedules", "replica_statistics",
              "balance", "zero_stage")),
    ("strategies", ("strategies", "parameter_server", "initial_values",
                    "chief_writes", "peer_failure")),
    ("data", ("data",)),
    ("training", ("training",)),
    ("pipeline", ("pipeline",)),
    ("keras", ("keras",)),
    ("experiment", ("models", "experiment_config", "run_end", "experiment")),
    ("entry points", ("flags", "launch_processes", "launch", "doctor", "bench",
                      "__main__")),
)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name, path, modules):
    """The tfmulti modules `name` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from tfmulti.training import checkpoints` imports the module;
            # `from tfmulti.training import Trainer` imports the package.
            targets = [f"{source}.{alias.name}"
                       if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("tfmulti") and target != name:
                found.add(target)
    return found


def _layer(name):
    relative = name.split(".")[1:]
    if not relative:
        return None  # tfmulti/__init__.py: the public API, imports anything
    for index, (_, prefixes) in enumerate(LAYERS):
        if relative[0] in prefixes:
            return index
    raise AssertionError(
        f"`tfmulti.{'.'.join(relative)}` is in no layer: add it to LAYERS "
        "here and to README's layout section")


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_upward_imports():
    upward = []
    for name, targets in _graph().items():
        own = _layer(name)
        for target in sorted(targets):
            theirs = _layer(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{name} ({LAYERS[own][0]}) imports {target} "
                              f"({LAYERS[theirs][0]})")
    assert not upward, "imports from a lower layer:\n" + "\n".join(upward)


def _find_circle(graph):
    """One import circle as a list of modules, or None."""
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            # A package imports its own submodules to re-export them; the
            # submodule importing a sibling through the package is the
            # circle, and it shows as package -> sub -> package.
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            if circle:
                return circle
    return None


def test_no_import_circle():
    circle = _find_circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
])
def test_circle_finder_finds_circles(graph, expected):
    assert _find_circle(graph) == expected


def test_layers_find_an_upward_import(tmp_path):
    """The resolver sees a lazy `from tfmulti.keras import x` in a function."""
    source = tmp_path / "strategies.py"
    source.write_text("def f():\n    from tfmulti.keras import chief_writes\n")
    modules = {"tfmulti.strategies": source, "tfmulti.keras": source,
               "tfmulti.keras.chief_writes": source}
    targets = _imports("tfmulti.strategies", source, modules)
    assert targets == {"tfmulti.keras.chief_writes"}
    assert _layer("tfmulti.keras.chief_writes") > _layer("tfmulti.strategies")


def _readme_layout():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout\n"):]
    return section[:section.index("```\n", section.index("```\n") + 4)]


def test_readme_layout_names_every_module():
    """README's map of the package matches the code: each top-level module
    and subpackage, and each module of the training layer, is on it."""
    layout = _readme_layout()
    missing = [p.name for p in PACKAGE.glob("*.py")
               if p.name != "__init__.py" and p.name not in layout
               and p.stem != "__main__"]
    missing += [f"{p.name}/" for p in PACKAGE.iterdir()
                if (p / "__init__.py").exists() and f"{p.name}/" not in layout]
    missing += [f"training/{p.stem}" for p in (PACKAGE / "training").glob("*.py")
                if p.stem != "__init__" and p.stem not in layout]
    assert not missing, f"README's Layout section does not name {missing}"
