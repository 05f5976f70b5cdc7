"""The library never imports the app: importing every library module loads no ``app`` module."""

import pkgutil
import subprocess
import sys

import pytest

import pyro_gradroute

LIBRARY = sorted(
    m.name
    for m in pkgutil.walk_packages(pyro_gradroute.__path__, "pyro_gradroute.")
    if not m.name.startswith("pyro_gradroute.app") and not m.name.endswith("__main__")
)


@pytest.mark.slow
def test_library_modules_do_not_import_the_app():
    assert "pyro_gradroute.infer" in LIBRARY and "pyro_gradroute.diagnostics" in LIBRARY
    code = (
        "import importlib, sys\n"
        f"for name in {LIBRARY!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('pyro_gradroute.app')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- the import graph
def _modules() -> dict[str, tuple[str, bool]]:
    """``{module name: (path, is_package)}`` of every module of the package."""
    import pathlib

    root = pathlib.Path(pyro_gradroute.__file__).parent
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (str(path), is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, function-local imports included (from the AST)."""
    import ast

    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        here = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # a name that is a submodule is an import of that submodule
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
                ]
            else:
                continue
            for t in targets:
                while (
                    t and t not in modules
                ):  # import a.b.c of a package module: its nearest module
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("pyro_gradroute"):
                    deps.add(t)
        graph[name] = deps
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "app"  # the command's entry point
    return parts[1] if len(parts) > 1 else ""


FORBIDDEN = {  # layer -> the layers it never imports
    "distributions": {"poutine", "infer", "app"},
    "routing": {"poutine", "infer", "app"},
    "poutine": {"infer", "app"},
}


@pytest.mark.slow
def test_every_layer_imports_only_downward():
    graph = import_graph()
    assert "pyro_gradroute.poutine.stick_the_landing_messenger" in graph
    bad = []
    for module, deps in graph.items():
        layer = _layer(module)
        forbidden = FORBIDDEN.get(layer, set()) | ({"app"} if layer != "app" else set())
        bad += [f"{module} -> {d}" for d in sorted(deps) if _layer(d) in forbidden]
    assert bad == []


def test_no_import_cycles_among_the_package_modules():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    library = [c for c in cycles if any(_layer(m) != "app" for m in c)]
    assert library == []
    # the app's one known cycle (app/models/problem.py imports its own package lazily, to
    # find the bundled models): it must not grow
    app = [c for c in cycles if c not in library]
    assert all(all(m.startswith("pyro_gradroute.app.models") for m in c) for c in app), app


def test_the_import_graph_sees_function_local_imports():
    """(The check above would miss a lazy import if the graph did not read function bodies.)"""
    graph = import_graph()
    # diagnostics/gradients.py imports the handler at module level; app/models lazily
    assert any(
        d.startswith("pyro_gradroute.poutine")
        for d in graph["pyro_gradroute.diagnostics.gradients"]
    )
