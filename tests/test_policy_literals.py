"""No policy-name literal in src/eldr, outside eldr.routing (where policies are registered)
and eldr.commands (the command lines), is used to branch on a policy or to list policies
(issue 33): the report, the grid, the plots and the sweeps ask the registry's report roles
(docs/adding-a-policy.md). Tests and benchmarks may name policies.

A string constant equal to a registered policy's name is flagged where it picks or lists
policies: an operand of a comparison (``==``, ``in``), an element of a tuple, list or set
display, a dict key, a subscript (``POLICIES["eldr"]``, ``row["jsq"]``) or a ``match``
case. A default value (``policy: str = "eldr_cost"``, ``.get("policy", "eldr_cost")``)
configures, it does not branch, and is not flagged. Docstrings are prose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eldr.routing import POLICIES

SRC = Path(__file__).resolve().parents[1] / "src" / "eldr"
EXEMPT = ("routing", "commands")  # packages of src/eldr that may name policies
# (module under src/eldr, literal) -> why the literal there is not a policy's name; a
# policy's name that is also a word of another vocabulary
ALLOWED = {
    ("deploy/local.py", "eldr"): "the module of `python -m eldr` (the package)",
    ("integrations/ray/app.py", "eldr"): "the `eldr` section of the Ray app's arguments",
    ("fit/locality.py", "domain"): "the routing input `domain` (the trace's labels)",
    ("traces/importers.py", "domain"): "the `domain` field of an imported request record",
    ("fit/prompt_eval.py", "round_robin"): "the locality measure's round-robin grouping, "
                                           "a key of its results (eldr.fit.locality)",
    ("reproduce/before_prefill.py", "round_robin"): "the same key, in the section's figures",
    ("reproduce/report.py", "round_robin"): "the same key, read back for the section",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def _selecting(tree: ast.AST) -> list[ast.AST]:
    """The expressions that pick or list: comparison operands, collection elements, dict
    keys, subscripts, match values."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            out += [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out += node.elts
        elif isinstance(node, ast.Dict):
            out += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            out.append(node.slice)
        elif isinstance(node, ast.MatchValue):
            out.append(node.value)
    return out


def policy_literals(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every policy-name literal of ``path`` used to pick or list."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    found = set()
    for expr in _selecting(tree):
        for node in ast.walk(expr):  # a tuple inside a comparison, ...
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in names and id(node) not in docs:
                found.add((node.lineno, node.value))
    return sorted(found)


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py")
                  if p.relative_to(SRC).parts[0] not in EXEMPT)


def test_no_policy_name_picks_or_lists_policies_outside_routing_and_commands():
    names = set(POLICIES)
    found = []
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        found += [f"src/eldr/{rel}:{line}: {lit!r}" for line, lit in
                  policy_literals(path, names) if (rel, lit) not in ALLOWED]
    assert not found, ("policy names used to pick or list policies; ask the registry's "
                       "report roles instead (docs/adding-a-policy.md):\n" + "\n".join(found))


def test_every_allowed_literal_is_still_there():
    """An allow-list entry whose literal is gone goes too (the list stays the exceptions
    that exist)."""
    names = set(POLICIES)
    stale = [key for key in ALLOWED
             if key[1] not in {lit for _, lit in policy_literals(SRC / key[0], names)}]
    assert not stale, stale


@pytest.mark.parametrize("code, flagged", [
    ("if policy == 'jsq':\n    pass", True),
    ("GROUP = ('eldr', 'eldr_cost')", True),
    ("x = POLICIES['eldr']", True),
    ("ok = name in {'p2c'}", True),
    ("cols = {'oracle_signature': 1}", True),
    ("match p:\n    case 'domain':\n        pass", True),
    ("policy: str = 'eldr_cost'", False),  # a default configures, it does not branch
    ("d.get('policy', 'eldr_cost')", False),
    ("def f():\n    'jsq'", False),  # a docstring
    ("label = f'{p} vs jsq'", False),
], ids=lambda v: str(v)[:24])
def test_the_scan_sees_what_picks_and_lists(tmp_path, code, flagged):
    path = tmp_path / "m.py"
    path.write_text(code + "\n")
    assert bool(policy_literals(path, set(POLICIES))) == flagged
