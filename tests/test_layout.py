"""The package's layout: no import cycle inside lazyload/ (lazy imports inside functions
count too: they are cycles that only bite later), and every module says its one job."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parent.parent / "lazyload"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_nodes(path: Path, name: str) -> Iterator[tuple[list[str], list[str]]]:
    """(candidate module names, imported names) of each import anywhere in `path`, relative
    ones resolved; a `from m import x` may import a module `m.x` or a name x of m."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            yield [target] + [f"{target}.{n}" for n in names], names
        elif isinstance(node, ast.Import):
            yield [alias.name for alias in node.names], []


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """lazyload modules that `path` imports, anywhere in it."""
    return {c for candidates, _ in _import_nodes(path, name) for c in candidates if c in modules and c != name}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    # A package's __init__ hands on its modules' names; its modules never import it back.
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_below_the_entry_point_imports_it():
    """Only the package and the one-line `load_model` built on top sit above it."""
    graph = import_graph()
    importers = sorted(n for n, deps in graph.items() if "lazyload.checkpoint" in deps)
    assert importers == ["lazyload", "lazyload.auto"], importers


def test_every_module_has_a_docstring():
    for path in PACKAGE.rglob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} says nothing about its job"


def private_imports() -> list[str]:
    """`module <- other: _name` for each private (underscore, not dunder) name a lazyload
    module imports from another one: a name another module needs is an interface, public."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = []
    for name, path in sorted(paths.items()):
        for candidates, names in _import_nodes(path, name):
            source = candidates[0]
            if source in paths and source != name:
                found += [f"{name} <- {source}: {n}" for n in names
                          if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
                          and f"{source}.{n}" not in paths]
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_formats_import_nothing_from_tensor_parallel():
    """Formats are a source for the Index; tensor parallel is the Plan stage's. The name
    tables both read live below both (`lazyload.names`)."""
    graph = import_graph()
    found = {n: sorted(d for d in deps if d == "lazyload.tp" or d.startswith("lazyload.tp."))
             for n, deps in graph.items() if n == "lazyload.formats" or n.startswith("lazyload.formats.")}
    assert {n: d for n, d in found.items() if d} == {}


MAX_FUNCTION_LINES = 60



def function_lengths() -> dict[str, int]:
    """Every function in lazyload/ -> its lines, signature to end, its docstring not counted."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = node.body[0] if ast.get_docstring(node) else None
                lines = node.end_lineno - node.lineno + 1 - (doc.end_lineno - doc.lineno + 1 if doc else 0)
                lengths[f"{path.relative_to(PACKAGE.parent).as_posix()}::{node.name}"] = lines
    return lengths


def test_no_function_is_longer_than_60_lines():
    long = {name: n for name, n in function_lengths().items() if n > MAX_FUNCTION_LINES}
    assert long == {}


def lazyload_attributes(source: str) -> tuple[set[str], set[str], set[str]]:
    """(read, set, read with a default) `_lazyload_*` attributes in `source`: `x._lazyload_a`
    loaded or stored, `getattr`/`setattr`/`hasattr` with the name, and the name as a string
    (`"_lazyload_a" in x.__dict__`), which reads it guarded, as state an earlier call may have left."""
    reads, writes, guarded = set(), set(), set()
    named = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_lazyload_"):
            (writes if isinstance(node.ctx, (ast.Store, ast.Del)) else reads).add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_lazyload_")):
            name = node.args[1].value
            named.add(id(node.args[1]))
            if node.func.id in ("setattr", "delattr"):
                writes.add(name)
            else:
                reads.add(name)
                if node.func.id == "hasattr" or len(node.args) == 3:
                    guarded.add(name)
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_lazyload_")
                and id(node) not in named):
            guarded.add(node.value)
    return reads, writes, guarded


def stray_lazyload_attributes() -> list[str]:
    """`module: attribute` for each `_lazyload_*` attribute a lazyload module reads without
    setting it itself, or reads guarded (with a default, or by its name in a `__dict__`): state
    left on the user's modules by another step or an earlier load."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        reads, writes, guarded = lazyload_attributes(path.read_text())
        name = _module_name(path)
        found += [f"{name}: reads {a} that another module sets" for a in sorted(reads - writes)]
        found += [f"{name}: reads {a} as an earlier call may have left it" for a in sorted(guarded)]
    return found


def test_no_module_reads_a_lazyload_attribute_it_did_not_set_in_the_same_load():
    """The plan is the one truth: nothing travels between loads (or between the executor's
    steps) on the user's modules; a step gets what it needs from the LoadPlan."""
    assert stray_lazyload_attributes() == []


def test_the_attribute_check_finds_state_left_between_loads():
    reads, writes, guarded = lazyload_attributes(
        "recorded = getattr(model, '_lazyload_placements', {})\n"
        "style = layer._lazyload_tp_style\n"
        "if '_lazyload_q' not in m.__dict__:\n    m._lazyload_q = {}\n")
    assert reads == {"_lazyload_placements", "_lazyload_tp_style"} and writes == {"_lazyload_q"}
    assert guarded == {"_lazyload_placements", "_lazyload_q"}
