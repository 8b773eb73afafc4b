"""No import cycle among the modules of synapse_nb/ and cli/ (issue 29).

The rule tested: every import statement of a module is an edge to the module it names, wherever
the statement is (at module level, or inside a function or method: a lazy import defers the
cycle to run time, it does not remove it); so is importlib.import_module with a literal name. Only the imports inside an ``if TYPE_CHECKING:``
block are exempt (they never run). An edge goes to the module named: ``from .a import b`` is an
edge to ``a.b`` when that is a module, else to ``a``; ``import a.b`` is an edge to ``a.b``. The
packages above a module (whose ``__init__`` Python runs first) are not edges of their own: a
package's ``__init__`` re-exporting its submodules is not a cycle. Read with ast: nothing is
imported, so the test takes no time and needs no Numba.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("synapse_nb", "cli")


def _modules() -> dict:
    """Dotted module name -> source path, for every .py file under PACKAGES."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_module_call(node: ast.AST):
    """An ImportFrom equivalent to importlib.import_module("name" or ".name", ...), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    f = node.func
    if not ((isinstance(f, ast.Attribute) and f.attr == "import_module") or
            (isinstance(f, ast.Name) and f.id == "import_module")):
        return None
    name = node.args[0].value
    level = len(name) - len(name.lstrip("."))
    mod, _, last = name[level:].rpartition(".")
    return ast.ImportFrom(module=mod or None, names=[ast.alias(name=last)], level=level)


def _imports(tree: ast.AST):
    """The Import / ImportFrom nodes of tree (importlib.import_module calls with a literal name
    as ImportFrom), outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        call = _import_module_call(node)
        if call is not None:
            yield call
        stack.extend(ast.iter_child_nodes(node))


def _edges(name: str, path: Path, mods: dict) -> set:
    """The modules of `mods` that module `name` (source at `path`) imports."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                if node.module:
                    base.append(node.module)
                mod = ".".join(base)
            else:
                mod = node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        out.update(t for t in targets if t in mods and t != name)
    return out


def import_graph() -> dict:
    mods = _modules()
    return {name: _edges(name, path, mods) for name, path in mods.items()}


def find_cycle(graph: dict):
    """One cycle of graph (a list of module names, first == last), or None."""
    colour = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    path = []

    def visit(n):
        colour[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if colour[m] == 1:
                return path[path.index(m):] + [m]
            if colour[m] == 0:
                found = visit(m)
                if found:
                    return found
        path.pop()
        colour[n] = 2
        return None

    for n in sorted(graph):
        if colour[n] == 0:
            found = visit(n)
            if found:
                return found
    return None


def test_graph_sees_the_packages():
    graph = import_graph()
    assert "synapse_nb.session" in graph and "cli.main" in graph
    assert "synapse_nb.model" in graph["synapse_nb.session"]  # a module-level import is an edge


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_rule_counts_lazy_imports_and_exempts_type_checking():
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
           "def f():\n    from .c import y\n")
    nodes = list(_imports(ast.parse(src)))
    assert sorted(n.module for n in nodes if isinstance(n, ast.ImportFrom)) == ["c", "typing"]
    call = _import_module_call(ast.parse('importlib.import_module(".perplexity", __name__)').body[0].value)
    assert (call.level, call.module, call.names[0].name) == (1, None, "perplexity")
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
