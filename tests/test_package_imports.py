"""The package's imports: no cycle among kernels_lib's modules, and nothing from ``studies/`` (our performance
studies live outside the package; the package never reaches into them).

The graph is read from the source (no module is imported): an edge ``a → b`` for every ``import b``,
``from b import name`` (``b.name`` where that is a module), relative imports resolved, at any depth of the
file (a function's import counts: it runs when the function does), and ``importlib.import_module("b")``
with a literal name. A package's own ``__init__`` is not an edge of its submodules (Python runs it first
whatever they import), so a cycle here is one a reader of the modules would have to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kernels_lib"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules ``name`` (at ``path``) imports: of the package where they are its modules, else as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            found.update(submodules or [target])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = imports_of(name, path, set(known))
        edges[name] = {t for t in targets if t in known and t != name and not name.startswith(t + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_package():
    """The reader finds the modules and their imports (a graph without edges would pass the next test)."""
    edges = graph()
    assert "kernels_lib.fused_linear_cross_entropy" in edges and "kernels_lib.kernels.logits_logsumexp" in edges
    assert "kernels_lib._flce.class_major" in edges["kernels_lib.fused_linear_cross_entropy"]
    assert "kernels_lib._validate" in edges["kernels_lib.kernels.logits_logsumexp"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles among kernels_lib's modules: " + "; ".join(" ↔ ".join(c) for c in found)


def test_the_package_imports_nothing_from_studies():
    known = modules()
    offenders = {name: sorted(t for t in imports_of(name, path, set(known)) if t == "studies" or t.startswith("studies."))
                 for name, path in known.items()}
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, f"kernels_lib imports from studies/ (the studies stay outside the package): {offenders}"
