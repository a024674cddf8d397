"""``eldr capture``: record real expert routing from a Hugging Face MoE model as a trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "Capture per-token expert routing of a transformers MoE model on prompts into a trace."

_DTYPES = ("float32", "bfloat16", "float16", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a local Hugging Face model folder (config.json + weights + tokenizer), "
                   "or 'tiny' for the tiny MoE shipped with eldr")
    p.add_argument("--prompts", required=True,
                   help='JSON lines, one {"prompt": str, "domain": str (optional)} per request')
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens generated per prompt (default 32; stops early at EOS)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="keep only the first N prompt tokens (default: whole prompt)")
    p.add_argument("--limit", type=int, default=None, help="capture only the first N prompts")
    p.add_argument("--dtype", choices=_DTYPES, default="float32",
                   help="weights dtype for the capture (default float32; 'auto' = as stored)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")


def read_prompts(path: str | Path) -> tuple[list[str], list[str] | None]:
    """Prompts and domain labels (None if no row has one) from a JSON-lines file."""
    prompts: list[str] = []
    domains: list[str | None] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            if not row["prompt"]:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            domain = row.get("domain")
            if domain is not None and not isinstance(domain, str):
                raise ValueError(f"{path}:{lineno}: 'domain' must be a string, got {domain!r}")
            prompts.append(row["prompt"])
            domains.append(domain)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    labelled = [d is not None for d in domains]
    if any(labelled) and not all(labelled):
        raise ValueError(f"{path}: line {labelled.index(False) + 1} has no 'domain' while "
                         "others do: label all prompts or none")
    return prompts, (domains if all(labelled) else None)  # type: ignore[return-value]


def resolve_model_dir(model: str) -> Path:
    if model == "tiny":
        from eldr.capture import tiny_moe_dir

        return tiny_moe_dir()
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json there (a local model folder is "
                         "needed; nothing is downloaded)")
    return path


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts, domains = read_prompts(args.prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
        domains = None if domains is None else domains[: args.limit]
    model_dir = resolve_model_dir(args.model)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"eldr capture needs the 'capture' extra "
                         f"(pip install 'eldr[capture]'): {exc}") from exc

    from eldr.capture.hf import capture_texts
    from eldr.traces.trace import save

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    trace = capture_texts(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                          domains=domains, model_name=model_dir.name,
                          max_prompt_tokens=args.max_prompt_tokens)
    save(trace, args.output)
    print(f"wrote {args.output}: {trace.describe()}")
    return 0
