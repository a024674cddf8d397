"""The package tree shows the pipeline, and imports run one way along it:
commands → reproduce / proxy / sim → (learn →) routing → fit → traces (cache beside fit).

Over the whole of ``src/eldr`` (read with ``ast``, nothing imported): no import circles at
run time, deferred imports included; no private name imported from another package; each
package's ``__init__`` exports a sorted ``__all__`` whose names are pinned here."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "eldr"
# stage → stages it must never import (directly or lazily)
FORBIDDEN = {
    "traces": ("fit", "routing", "cache", "sim", "reproduce", "proxy", "commands", "capture",
               "learn"),
    "cache": ("fit", "routing", "sim", "reproduce", "proxy", "commands", "learn"),
    "fit": ("routing", "sim", "reproduce", "proxy", "commands", "learn"),
    "routing": ("sim", "reproduce", "proxy", "commands", "capture", "learn"),
    "sim": ("reproduce", "proxy", "commands", "learn"),
    "learn": ("sim", "reproduce", "proxy", "commands", "capture", "cache", "deploy"),
    "proxy": ("reproduce", "commands", "sim"),
    "deploy": ("reproduce", "commands", "sim", "proxy", "routing", "learn"),
    "integrations": ("reproduce", "commands", "sim", "learn"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_imports_run_one_way(stage):
    bad = []
    for path in sorted((SRC / stage).rglob("*.py")):
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "eldr" and len(parts) > 1 and parts[1] in FORBIDDEN[stage]:
                bad.append(f"{path.relative_to(SRC)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_flat_modules_left_but_the_entry_points():
    flat = sorted(p.name for p in SRC.glob("*.py"))
    # entry points and two shared numpy utilities (files, intervals)
    assert flat == ["__init__.py", "__main__.py", "_progress.py", "cli.py", "fileio.py",
                    "intervals.py"]
    for stage in ("traces", "fit", "routing", "cache", "sim", "reproduce", "capture",
                  "proxy", "deploy", "commands", "learn"):
        assert (SRC / stage / "__init__.py").is_file(), stage


# -- the whole package's run-time import graph -------------------------------------------------
def _module_name(path: Path) -> str:
    parts = ["eldr", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, *, runtime: bool):
    """Every import statement under ``node``, function-level ones included; with
    ``runtime``, not those of ``if TYPE_CHECKING:`` blocks (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        if runtime and _is_type_checking(child):
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]),
                                         runtime=True)
            continue
        yield from _import_nodes(child, runtime=runtime)


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def _imported(module: str, *, runtime: bool) -> list[tuple[str, str | None]]:
    """(eldr module imported from, name or None) for each import of ``module``."""
    out = []
    for node in _import_nodes(_tree(module), runtime=runtime):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
            continue
        target = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            base = _package(module).split(".")[: len(_package(module).split(".")) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
        out += [(target, a.name) for a in node.names]
    return [(t, n) for t, n in out if t == "eldr" or t.startswith("eldr.")]


def _import_graph(*, runtime: bool = True) -> dict[str, set[str]]:
    """Module → the eldr modules it imports at run time (``runtime=False``: type-checking
    imports too). ``from p import m`` of a submodule
    ``m`` is an edge to ``p.m``; the parent packages Python initialises on the way are not
    edges (every submodule import would close a circle through its package's __init__)."""
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for target, name in _imported(m, runtime=runtime):
            dep = f"{target}.{name}" if f"{target}.{name}" in MODULES else target
            if dep in MODULES and dep != m:
                graph[m].add(dep)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_deferred_imports_and_skips_type_checking_blocks():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import eldr.a\n"
        "if TYPE_CHECKING:\n"
        "    from eldr.b import B\n"
        "else:\n"
        "    from eldr.c import C\n"
        "def f():\n"
        "    from eldr.d import D\n"
    )
    nodes = _import_nodes(ast.parse(source), runtime=True)
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in nodes]
    assert names == ["typing", "eldr.a", "eldr.c", "eldr.d"]
    assert "eldr.reproduce" in _import_graph()["eldr.commands.reproduce"]  # inside run()
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles_at_run_time():
    """No two modules import each other, directly or round a longer loop, deferred
    (function-level) imports included: a circle closed by a deferred import is a cut in the
    wrong place. Put the shared names where both sides can import them one way."""
    found = {"circle: " + " <-> ".join(sorted(c)) for c in _circles(_import_graph())}
    assert not found, "\n".join(sorted(found))


def test_no_import_circles_of_any_kind():
    """Nor through ``if TYPE_CHECKING:`` imports: a module that needs another's type only
    to annotate, while that one imports it, annotates structurally (a Protocol) or the
    type moves where both can import it."""
    found = {"circle: " + " <-> ".join(sorted(c))
             for c in _circles(_import_graph(runtime=False))}
    assert not found, "\n".join(sorted(found))


def test_no_private_name_imported_from_another_package():
    """``eldr.a.x`` never imports ``_y`` from ``eldr.b.z``: a name another package needs is
    public (or lives in that package)."""
    found = set()
    for m in MODULES:
        for target, name in _imported(m, runtime=False):
            if name is None or target not in MODULES:
                continue
            if name.startswith("_") and not name.startswith("__") \
                    and _package(target) != _package(m):
                found.add(f"private: {m} imports {name} from {target}")
    assert not found, "\n".join(sorted(found))


# -- each package's public API ------------------------------------------------------------------
# The names each subpackage's __init__ exports. A change here is a change of the API.
PUBLIC_API = {
    "eldr.cache": set(),
    "eldr.capture": {"tiny_moe_dir", "tiny_moe_prompt_trace_path", "tiny_moe_trace_path",
                     "wide_engine_bytes", "wide_tiny_moe_dir"},
    "eldr.commands": set(),
    "eldr.deploy": {"ChildProcess", "ClusterSpec", "LocalCluster", "engine_command",
                    "free_port"},
    "eldr.fit": set(),
    "eldr.integrations": set(),
    "eldr.integrations.ray": {"TESTED_RAY", "Answer", "DecodeTable", "PDAppConfig", "PDRelay",
                              "RelayConfig", "TableConfig", "build_eldr_pd_app",
                              "check_ray_version", "parse_args"},
    "eldr.learn": set(),
    "eldr.proxy": {"ServeConfig"},
    "eldr.proxy.control": {"AdminToken", "ElasticPool", "ForwardLearning", "JournalLink",
                           "LearnAdmin", "LiveLearning", "ReloadRefused", "Reloader"},
    "eldr.proxy.engines": {"CircuitBreaker", "Instance", "UpstreamPool", "error_kind",
                           "make_session"},
    "eldr.proxy.request": {"KNOWN_ROUTES", "OWN_ROUTES", "DecodeAttempt", "DecodeTarget",
                           "DecodeRelay", "Forwarder", "GuardBuffers", "LearnerHook",
                           "LiveRouting", "PrefixAffinity", "Reading", "RequestFlow",
                           "RequestGuards", "RoutingState", "WorkerMismatch", "build_state",
                           "classify", "is_stream_done", "make_guards", "method_not_allowed",
                           "read_counts", "read_inputs", "split_kv_params"},
    "eldr.proxy.selection": {"PREFIX", "Query", "Selection", "SelectionApi",
                             "SelectionConfig", "SelectionTable", "parse_query"},
    "eldr.proxy.workers": {"PoolJournal", "PoolLink", "SharedLoadTracker", "SharedLoads",
                           "WorkerShare", "reserve_port", "run_workers"},
    "eldr.reproduce": {"DEFAULT", "FULL", "PLANS", "QUICK", "Analysis", "Plan", "Results",
                       "RoutingSetup", "fit_setup", "headline_text", "run_plan",
                       "with_overrides", "write_report"},
    "eldr.routing": {"OUTCOMES", "POLICIES", "ROLES", "SHAPE_RESOURCES", "CostPolicy",
                     "Decision", "DomainPolicy", "EldrPolicy", "ExpertFootprint", "JSQPolicy",
                     "LazyShapePolicy", "NoHealthyWorkerError", "Outcome", "P2CPolicy",
                     "Policy", "PolicyBase", "PolicySpec", "RandomPolicy", "ReportRole",
                     "RoundRobinPolicy", "RouteRequest", "RoutingResources", "decode_patterns",
                     "domain_groups", "filters", "make_policy", "make_unbound_policy",
                     "pickers", "policies_with_role", "prefill_profile", "register_policy",
                     "report_flagged", "report_policies", "scorers"},
    "eldr.sim": {"EVENT_NAMES", "HARDWARE", "Hardware", "RequestRecord", "Requests",
                 "SimConfig", "SimResult", "StepFit", "StepModel", "TokenBank", "deal_bitsets",
                 "fit_step_model", "get_hardware", "load_hardware", "make_arrivals",
                 "moe_constants", "save_hardware", "simulate", "topk_bitsets",
                 "union_distinct", "write_csv", "write_json"},
    "eldr.traces": {"REAL_TRACES", "load_real_trace", "real_trace_path"},
}


def _dunder_all(package: str) -> list[str] | None:
    """The literal ``__all__`` of a package's __init__ (None when it has none)."""
    for node in _tree(package).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    return None


def _bound_names(package: str) -> set[str]:
    """Names an __init__ binds at its top level: imports, definitions, assignments."""
    names = set()
    for node in _tree(package).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _isort_key(name: str) -> tuple:
    """ruff's RUF022 order: CONSTANTS, then Classes, then the rest, each naturally sorted."""
    kind = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    return kind, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def test_every_package_is_pinned():
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py" and m != "eldr"}
    assert set(PUBLIC_API) == packages


@pytest.mark.parametrize("package", sorted(PUBLIC_API))
def test_package_exports_a_sorted_pinned_all(package):
    exported = _dunder_all(package)
    assert exported is not None, f"{package} has no __all__"
    assert exported == sorted(exported, key=_isort_key), f"{package}.__all__ is not sorted"
    assert len(set(exported)) == len(exported)
    assert set(exported) == PUBLIC_API[package]
    assert set(exported) <= _bound_names(package), "exported but not bound"


MAX_FUNCTION_LINES = 80  # a function longer than this is split along its sections


def _long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method of ``tree`` longer than ``limit`` lines,
    counted from its ``def`` to its last line (decorators excluded)."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_the_length_rule_sees_a_long_function_and_a_long_method():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    method = body.replace("    ", "        ")
    src = f"def f():\n{body}\n\nclass C:\n    async def m(self):\n{method}\n"
    assert _long_functions(ast.parse(src), MAX_FUNCTION_LINES) == [("f", 81), ("m", 81)]
    assert _long_functions(ast.parse(src), 81) == []


def test_no_function_is_longer_than_80_lines():
    found = [f"{path.relative_to(SRC.parent)}:{name} ({n} lines)"
             for path in sorted(SRC.rglob("*.py"))
             for name, n in _long_functions(ast.parse(path.read_text()), MAX_FUNCTION_LINES)]
    assert not found, "split these along their sections: " + ", ".join(found)
