"""The project stands on its own: no pointers to files its users do not have, no absolute
paths of a development machine, and every docs page and section it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCANNED = ("src", "docs", "scripts", "benchmarks")
SKIP_DIRS = {"__pycache__", "build", "dist"}
BINARY_SUFFIXES = {".npz", ".npy", ".safetensors", ".png", ".pyc", ".so", ".whl", ".gz"}

FORBIDDEN = {
    "design.md": re.compile(r"design\.md"),
    "../shared": re.compile(r"\.\./shared"),
    "absolute /work/ path": re.compile(r"(?<![\w.-])/work/"),
}
# docs/page.md or docs/page.md#anchor anywhere; page.md#anchor as a relative Markdown link.
DOCS_REF = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([\w-]+\.md)?(?:#([^)\s]+))?\)")


def _text_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if any(p in SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info")
                   for p in parts):
                continue
            if path.is_file() and path.suffix not in BINARY_SUFFIXES:
                files.append(path)
    return files


def _read(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


TEXT_FILES = _text_files()


def test_scan_finds_the_project():
    names = {p.relative_to(ROOT).as_posix() for p in TEXT_FILES}
    assert {"README.md", "docs/method.md", "src/eldr/cli.py"} <= names


@pytest.mark.parametrize("label", sorted(FORBIDDEN))
def test_no_pointers_outside_the_project(label):
    pattern = FORBIDDEN[label]
    hits = []
    for path in TEXT_FILES:
        text = _read(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not hits, f"{label} found (cite docs/; use relative paths):\n" + "\n".join(hits)


def _readme_pages() -> set[str]:
    return {m.group(1) for m in DOCS_REF.finditer((ROOT / "README.md").read_text("utf-8"))}


def test_readme_docs_links_exist():
    pages = _readme_pages()
    assert "method.md" in pages
    missing = sorted(p for p in pages if not (DOCS / p).is_file())
    assert not missing, f"README.md links missing docs pages: {missing}"


def test_readme_indexes_every_docs_page():
    unlisted = sorted(p.name for p in DOCS.glob("*.md") if p.name not in _readme_pages())
    assert not unlisted, f"docs pages missing from README.md's index: {unlisted}"


def _references() -> list[tuple[str, str, str | None]]:
    """(where, page, anchor) for every docs page or section cited in the project."""
    refs = []
    for path in TEXT_FILES:
        text = _read(path)
        if text is None:
            continue
        where = path.relative_to(ROOT).as_posix()
        for m in DOCS_REF.finditer(text):
            refs.append((where, m.group(1), m.group(2)))
        if path.parent == DOCS and path.suffix == ".md":
            for m in MD_LINK.finditer(text):
                if m.group(1) or m.group(2):
                    refs.append((where, m.group(1) or path.name, m.group(2)))
    return refs


def test_cited_docs_pages_and_sections_exist():
    refs = _references()
    assert any(anchor for _, _, anchor in refs)
    anchors: dict[str, set[str]] = {}
    bad = []
    for where, page, anchor in refs:
        target = DOCS / page
        if not target.is_file():
            bad.append(f"{where}: docs/{page} does not exist")
            continue
        if anchor is not None:
            known = anchors.setdefault(page, _anchors(target))
            if anchor not in known:
                bad.append(f"{where}: docs/{page}#{anchor} is no section of that page")
    assert not bad, "\n".join(bad)


def test_slug_matches_github():
    assert _slug("Quality objective (Eq. 1)") == "quality-objective-eq-1"
    assert _slug("Hardware presets (`eldr.sim.config`)") == "hardware-presets-eldrsimconfig"
    assert _slug("Step-time model") == "step-time-model"
