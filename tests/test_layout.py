"""The package tree shows the pipeline, and imports run one way along it:
commands → reproduce / proxy / sim → (learn →) routing → fit → traces (cache beside fit)."""

import ast
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
    assert flat == ["__init__.py", "__main__.py", "_progress.py", "cli.py", "fileio.py"]
    for stage in ("traces", "fit", "routing", "cache", "sim", "reproduce", "capture",
                  "proxy", "deploy", "commands", "learn"):
        assert (SRC / stage / "__init__.py").is_file(), stage
