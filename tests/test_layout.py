"""The package layout: every module imports on its own, and no module takes part in an import circle.

The import graph is read from the source with ``ast``, not from a running interpreter, so it holds
every ``omni_accum.*`` import wherever it is written: at module level, under ``if TYPE_CHECKING:``,
inside a function (a deferred import hides a circle, it does not remove it), and
``importlib.import_module("omni_accum....")`` with a literal name. An import names a module when
it resolves to one (``from omni_accum.bench import runner`` is an edge to ``omni_accum.bench.runner``);
otherwise it is an edge to the module that defines the name (``from omni_accum.policy import Policy``
is an edge to the package ``omni_accum.policy``, i.e. its ``__init__``). Importing a submodule
also runs its parent packages' ``__init__``; those implicit edges are not counted (every module
would otherwise sit in a circle with ``omni_accum/__init__.py``), but the fresh-interpreter imports
below catch any circle they cause at run time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import CI

import omni_accum

ROOT = Path(omni_accum.__file__).resolve().parent
PACKAGE = "omni_accum"


def _source_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``root`` (packages as their ``__init__.py``).

    Read from the file system (``pkgutil.walk_packages`` would import every subpackage to find it).
    """
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        folders = [root.joinpath(*rel[:i]) for i in range(len(rel))]
        if not all((f / "__init__.py").is_file() for f in folders) or "__pycache__" in rel:
            continue  # not inside a package (build folders, stray scripts)
        if rel[-1] == "__init__":
            rel = rel[:-1]
        found[".".join((package, *rel))] = path
    return found


def _installed_modules() -> dict[str, Path]:
    """The package's modules, plus the built-in strategies (``strategies/``, installed as ``omni_accum.strategies``)."""
    mods = _source_modules()
    import omni_accum.strategies

    mods.update(_source_modules(Path(omni_accum.strategies.__file__).resolve().parent, f"{PACKAGE}.strategies"))
    return mods


def _resolve(modules: set[str], name: str) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (None outside it)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _relative_base(module: str, is_package: bool, level: int, target: str | None) -> str:
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module in ``modules``, read with ``ast``."""
    names = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _relative_base(module, is_package, node.level, node.module) if node.level else (node.module or "")
                )
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    # ``from pkg import submodule`` names the submodule; ``from pkg import name`` the package.
                    targets.append(full if full in names else base)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            for target in targets:
                if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                    continue
                resolved = _resolve(names, target)
                if resolved is not None and resolved != module:
                    graph[module].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module, each as one circle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
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
                components.append(comp)

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return [_cycle_path(graph, set(comp)) for comp in components]


def _cycle_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One circle through a strongly connected component: ``[a, b, ..., a]`` (shortest from its first module)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)  # unreachable for a strongly connected component


def _format(cycles: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(c) for c in cycles)


# ---------------------------------------------------------------------------------------------- #
# The checks
# ---------------------------------------------------------------------------------------------- #


def test_no_import_circle_among_the_package_modules():
    graph = import_edges(_installed_modules())
    assert len(graph) > 30, sorted(graph)  # the walk found the package
    cycles = find_cycles(graph)
    assert not cycles, "import circles among omni_accum's modules:\n" + _format(cycles)


def documented_layers(text: str) -> dict[str, set[str]]:
    """``{source: names it may import}`` from the fenced block of docs/architecture.md's "Dependencies between the
    parts": ``a, b -> c, d (a comment), e`` lines, names relative to the package (``omni_accum``: the package)."""
    block = text.split("## Dependencies between the parts", 1)[1].split("```", 2)[1]
    full = lambda n: PACKAGE if n == PACKAGE else f"{PACKAGE}.{n}"  # noqa: E731
    layers: dict[str, set[str]] = {}
    for line in block.splitlines():
        if "->" not in line:
            continue
        left, right = (re.sub(r"\([^)]*\)", "", side) for side in line.split("->", 1))
        for src in (n.strip() for n in left.split(",")):
            layers.setdefault(full(src), set()).update(full(n.strip()) for n in right.split(",") if n.strip())
    return layers


def undocumented_imports(graph: dict[str, set[str]], layers: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a module of another part (its second name: ``bench``, ``errors``) that no
    line of ``layers`` whose source is ``a`` or a package above it allows."""
    under = lambda m, n: m == n or (n != PACKAGE and m.startswith(n + "."))  # noqa: E731
    part = lambda m: m.split(".")[:2]  # noqa: E731
    bad = []
    for m, targets in sorted(graph.items()):
        allowed = set().union(*(v for k, v in layers.items() if under(m, k)))
        for t in sorted(targets):
            if part(t) != part(m) and not any(under(t, n) for n in allowed):
                bad.append(f"{m} -> {t}")
    return bad


def test_every_import_between_parts_is_in_the_documented_table():
    """docs/architecture.md's dependency table is what the code imports (a new edge goes into the table first)."""
    layers = documented_layers((ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8"))
    modules = _installed_modules()
    unknown = sorted({*layers, *(n for names in layers.values() for n in names)} - set(modules))
    assert not unknown, f"the table names modules that do not exist: {unknown}"
    bad = undocumented_imports(import_edges(modules), layers)
    assert not bad, "imports docs/architecture.md's dependency table does not list:\n  " + "\n  ".join(bad)


def test_the_table_check_names_an_import_it_does_not_allow():
    doc = "## Dependencies between the parts\n```\nbench -> tuner.stats (a comment), errors\n```\n"
    layers = documented_layers(doc)
    graph = {"omni_accum.bench.a": {"omni_accum.tuner.stats", "omni_accum.tuner.core", "omni_accum.bench.b"}}
    assert undocumented_imports(graph, layers) == ["omni_accum.bench.a -> omni_accum.tuner.core"]


def test_the_checker_finds_a_circle_and_names_its_path(tmp_path):
    """A deferred import inside a function closes a circle too; the report names the path."""
    pkg = tmp_path / "omni_accum"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from omni_accum.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from omni_accum.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("thing = 1\n\ndef later():\n    from omni_accum.c import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import omni_accum.a\nx = 1\n")
    (pkg / "d.py").write_text("import importlib\nimportlib.import_module('omni_accum.e')\n")
    (pkg / "e.py").write_text("from omni_accum import d\n")
    graph = import_edges(_source_modules(pkg, "omni_accum"))
    assert graph["omni_accum.a"] == {"omni_accum.sub.b"}
    assert graph["omni_accum.sub"] == {"omni_accum.sub.b"}
    cycles = find_cycles(graph)
    assert sorted(map(tuple, cycles)) == [
        ("omni_accum.a", "omni_accum.sub.b", "omni_accum.c", "omni_accum.a"),
        ("omni_accum.d", "omni_accum.e", "omni_accum.d"),
    ]
    assert "omni_accum.a -> omni_accum.sub.b -> omni_accum.c -> omni_accum.a" in _format(cycles)


def _needs_vllm_omni(name: str) -> bool:
    return name.startswith(f"{PACKAGE}.integrations.vllm_omni")


def _vllm_omni_importable() -> bool:
    try:
        import vllm_omni  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means the integration cannot be imported here
        return False
    return True


#: Run in a new interpreter: imports the third-party libraries once (not omni_accum), then forks one
#: child per module (a few at once), which imports that module alone: no omni_accum module is loaded.
_FRESH_IMPORTS = textwrap.dedent(
    """
    import importlib, os, sys, time, traceback
    for lib in sys.argv[1].split(","):
        try:
            importlib.import_module(lib)
        except Exception:
            pass
    assert not [m for m in sys.modules if m == "omni_accum" or m.startswith("omni_accum.")], "preloaded omni_accum"
    failed, running, todo = [], {}, list(sys.argv[2:])
    while todo or running:
        while todo and len(running) < max(2, os.cpu_count() or 1):
            name = todo.pop(0)
            pid = os.fork()
            if pid == 0:
                try:
                    importlib.import_module(name)
                except BaseException:
                    print(f"{name}: " + traceback.format_exc().strip().splitlines()[-1], flush=True)
                    os._exit(1)
                os._exit(0)
            running[pid] = name
        time.sleep(0.02)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                name = running.pop(pid)
                if status:
                    failed.append(name)
    sys.exit(1 if failed else 0)
    """
)
_PRELOAD = "torch,pydantic,yaml,pluggy,hypothesis,vllm,vllm_omni"


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module alone, with no omni_accum module loaded before it: a circle through a package
    ``__init__`` (which the graph check does not count) fails here as a partially initialised module."""
    names = sorted(_installed_modules())
    skip_vllm = not _vllm_omni_importable() and not CI
    todo = [n for n in names if not (skip_vllm and _needs_vllm_omni(n)) and not n.endswith(".__main__")]
    r = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORTS, _PRELOAD, *todo], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, "modules that do not import on their own:\n" + r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize(
    "module,names",
    [
        (
            "omni_accum.engine",
            ["WIRE_MARKER", "Sender", "Receiver", "RequestView", "GroupView"],
        ),
        (
            "omni_accum.policy",
            [
                "Policy",
                "Rule",
                "StrategyChoice",
                "TunedCell",
                "TunedTable",
                "PROTOCOL_REPLACE_KEYS",
                "is_glob",
                "load_policy",
                "dump_policy",
                "preset_names",
                "ENV_POLICY",
            ],
        ),
        (
            "omni_accum.bench.replay",
            ["THROUGH", "UPSTREAM", "WIRE_FLOOR", "Arm", "ArmResult", "Engine", "iter_leaves", "measure"]
            + ["VllmOmniUnavailable"],
        ),
        ("omni_accum.strategy", ["Accumulator", "KeyInfo", "value_nbytes"]),
        ("omni_accum.context", ["StreamContext", "KeyMeta", "DEFAULT_CONTEXT"]),
        ("omni_accum.cli", ["main", "build_parser"]),
    ],
)
def test_the_seams_export_their_names(module, names):
    mod = __import__(module, fromlist=["_"])
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


#: The modules that stay at the top level: the public API and what strategy plugins import.
TOP_LEVEL = [
    "__init__.py",
    "context.py",
    "errors.py",
    "hookspecs.py",
    "kit_values.py",  # the conformance kit's value helpers (plugins' tests import them through testing.py)
    "manager.py",
    "plugin_checks.py",  # the manager's checks on what a plugin hands it (split from manager.py: 450 lines)
    "pytest_plugin.py",
    "samehost.py",  # the private directory of the same-host files (the arena and the peer hellos share it)
    "strategy.py",
    "switches.py",  # the on/off OMNI_ACCUM_* switches and the log handler: the manager, the CLI, the integration
    "testing.py",
]


def test_the_top_level_shows_the_parts():
    parts = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"engine", "policy", "bench", "tuner", "cli", "integrations"} <= parts, parts
    extra = sorted({p.name for p in ROOT.glob("*.py")} - set(TOP_LEVEL))
    assert not extra, (
        f"new top-level module(s) {extra}: put each in the part it belongs to (docs/architecture.md), "
        "or, if strategy plugins import it, add it to TOP_LEVEL here and to docs/architecture.md"
    )


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if "integrations" not in p.parts and (n := len(p.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert not long, f"modules over 450 lines (split them by concept): {long}"


def test_every_subpackage_is_in_the_distribution():
    """A folder of the package missing from ``[tool.setuptools] packages`` is left out of the wheel."""
    import tomllib

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join((PACKAGE, *p.parent.relative_to(ROOT).parts))
        for p in ROOT.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(on_disk - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
