"""The package layout's import rules, checked on the source and by importing every module.

- No import cycle among the modules of ``specdec``, ``deployments`` and ``benchmarks``
  (function-local imports included: a cycle through a lazy import still couples the modules).
- The core never imports the serving layer or the benchmarks (``specdec.*`` -> ``deployments.*``
  / ``benchmarks.*``), and the serving layer never imports the benchmarks.
- Every module imports on its own (no hidden dependence on what was imported before it), and
  importing the whole core loads neither Ray nor gRPC.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "deployments", "benchmarks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """``module name -> file`` for every module of :data:`PACKAGES`."""
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> modules of PACKAGES it imports`` (every import statement in the file).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``;
    relative imports are resolved against the importing module's package.
    """
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                # the module itself, else the nearest enclosing module of ours (a.b.attr -> a.b)
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_check_sees_cycles_and_local_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    modules = all_modules()
    graph = import_graph(modules)
    # function-local imports count: Target.__init__ imports the TP workers inside the method
    assert "deployments.tp_worker" in graph["deployments.target"]
    # `from specdec.models import demo` is an edge to the module specdec.models.demo
    assert "specdec.models.demo" in graph["specdec.models.loader"]


def test_no_import_cycles():
    graph = import_graph(all_modules())
    assert cycles(graph) == []


def test_core_imports_neither_serving_nor_benchmarks():
    graph = import_graph(all_modules())
    bad = sorted(
        (src, dst)
        for src, dsts in graph.items()
        for dst in dsts
        if (src.split(".")[0] == "specdec" and dst.split(".")[0] in ("deployments", "benchmarks"))
        or (src.split(".")[0] == "deployments" and dst.split(".")[0] == "benchmarks")
    )
    assert bad == []


_IMPORT_EACH = r"""
import importlib, json, sys, traceback
names = json.loads(sys.argv[1])
ours = ("specdec", "deployments", "benchmarks")
failed = {}
for name in names:
    for m in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps(failed))
"""

_IMPORT_CORE = r"""
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"ray", "grpc", "deployments", "benchmarks"})))
"""


def _run(code: str, names: list[str]) -> object:
    out = subprocess.run([sys.executable, "-c", code, json.dumps(names)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_module_imports_alone():
    # One process; before each module every module of ours is dropped from sys.modules, so each
    # is imported from a clean state (third-party modules stay cached, to keep this cheap).
    assert _run(_IMPORT_EACH, sorted(all_modules())) == {}


def test_core_loads_without_ray_grpc_or_serving():
    core = sorted(m for m in all_modules() if m.split(".")[0] == "specdec")
    assert len(core) > 25
    assert _run(_IMPORT_CORE, core) == []


def test_serving_and_bench_subcommands_are_registered_not_imported(capsys):
    """``specdec serve|client|bench`` come from entry points (pyproject.toml), not from imports."""
    import importlib
    import tomllib
    from importlib.metadata import entry_points

    from specdec import cli

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.COMMANDS_GROUP]
    assert sorted(declared) == ["bench", "client", "serve"]
    for name, target in declared.items():
        module, _, attr = target.partition(":")
        assert isinstance(getattr(importlib.import_module(module), attr), cli.Command), name
    # the installed metadata (pip install -e . after a change of pyproject's entry points)
    assert {"bench", "client", "serve"} <= {ep.name for ep in entry_points(group=cli.COMMANDS_GROUP)}
    assert sorted(cli.registered_commands()) == ["bench", "client", "serve"]
    for name in ("serve", "client", "bench"):
        try:
            cli.main([name, "--help"])
        except SystemExit as e:
            assert e.code == 0
        assert capsys.readouterr().out.startswith(f"usage: specdec {name} ")
