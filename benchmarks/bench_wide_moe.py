"""The wide tiny MoE against the shipped one: same function, and what MoE costs per step.

The wide tiny MoE (:mod:`eldr.capture.wide`) pads every expert FFN of the shipped tiny
MoE from width 32 to ``--width`` with zeros. Measured here, on the shipped prompt set
``benchmarks/data/wide_prompts.jsonl`` (written for this project: 72 prompts in 8
domains):

(a) identity in transformers, float32, one thread: greedy generation of ``--tokens``
    tokens per prompt on both models; the generated ids, every layer's top-k expert ids
    at prefill and at every decode step, the router logits, and the model logits over
    prompt + generated tokens are compared (counts of equal requests, max |diff| of the
    logits).
(b) with ``--engine``: a vLLM-CPU engine on the narrow, then on the wide model, one after
    the other (``eldr cluster``'s engine settings: float32, ``--enforce-eager``,
    ``VLLM_CPU_KVCACHE_SPACE=1``, the eldr plugin with ``ELDR_CAPTURE=all``), each pinned
    to one core; greedy completions (temperature 0, ``--tokens`` tokens) of every prompt,
    one request at a time, compared text for text; the engine's resident memory (RSS
    summed over the API server and its children) once the prompts are served.
(c) the MoE share of a decode step at batch 8 in transformers, float32, one thread: 8
    prompts of the set cut to a common length are prefilled, then one decode step is
    timed (``time.perf_counter``) with forward pre/post hooks timing every layer's MoE
    block (router + experts) inside it; the KV cache is cropped back after every step so
    that each timed step sees the same context. Medians over ``--repeats`` steps.

    taskset -c 1 python benchmarks/bench_wide_moe.py [--width 2048] [--prompts 64] [--engine]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = Path(__file__).resolve().parent / "data" / "wide_prompts.jsonl"


def read_prompts(limit: int) -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return rows[:limit]


def _load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                local_files_only=True).eval()


# -- (a) identity in transformers -----------------------------------------------------------
def greedy_runs(model, ids: list[list[int]], tokens: int):
    """(captured routing per prompt, model logits over prompt + generated, per prompt)."""
    import torch

    from eldr.capture.hf import capture_ids

    runs = capture_ids(model, ids, max_new_tokens=tokens, progress=False)
    logits = []
    with torch.no_grad():
        for p, r in zip(ids, runs, strict=True):
            full = torch.tensor([list(p) + r.output_ids.tolist()])
            logits.append(model(input_ids=full).logits[0].numpy())
    return runs, logits


def identity(narrow, wide, ids: list[list[int]], tokens: int) -> None:
    (na, nl), (wa, wl) = greedy_runs(narrow, ids, tokens), greedy_runs(wide, ids, tokens)
    same = {"greedy ids": 0, "prefill top-k": 0, "decode top-k": 0, "router logits": 0,
            "model logits (bitwise)": 0}
    max_diff = 0.0
    for a, b, la, lb in zip(na, wa, nl, wl, strict=True):
        same["greedy ids"] += np.array_equal(a.output_ids, b.output_ids)
        same["prefill top-k"] += np.array_equal(a.prefill_topk, b.prefill_topk)
        same["decode top-k"] += np.array_equal(a.decode_topk, b.decode_topk)
        same["router logits"] += np.array_equal(a.prefill_logits, b.prefill_logits)
        same["model logits (bitwise)"] += np.array_equal(la, lb)
        if la.shape == lb.shape:
            max_diff = max(max_diff, float(np.abs(la - lb).max()))
    n = len(ids)
    steps = sum(len(a.output_ids) - 1 for a in na)
    print(f"(a) identity, transformers float32, {n} prompts x {tokens} greedy tokens "
          f"({sum(map(len, ids))} prefill tokens, {steps} decode steps, "
          f"{len(na[0].prefill_topk[0])} layers each)")
    for what, k in same.items():
        print(f"  {what:<24} equal in {k} / {n} requests")
    print(f"  model logits: max |narrow - wide| = {max_diff:.3g}")


# -- (b) vLLM-CPU engines -------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines()
                          if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}").joinpath("task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def engine_completions(folder: Path, prompts: list[str], tokens: int, workdir: Path,
                       core: int) -> tuple[list[str], int, float]:
    """(greedy completions, engine RSS in bytes, seconds to ready) of one engine."""
    from eldr.deploy import ChildProcess, ClusterSpec, engine_command, free_port
    from eldr.deploy.local import engine_env, plugin_pythonpath

    port = free_port()
    spec = ClusterSpec(model=str(folder), served_name="tiny")
    env = engine_env(core, plugin_pythonpath(workdir))
    env["ELDR_CAPTURE"] = "all"
    proc = ChildProcess(f"engine-{folder.name}", engine_command(spec, port, None, None), env,
                        workdir / f"{folder.name}.log")
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", time.monotonic() + 600)
        ready = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}/v1/completions"
        texts = [_post(url, {"model": "tiny", "prompt": p, "max_tokens": tokens,
                             "temperature": 0})["choices"][0]["text"] for p in prompts]
        rss = tree_rss(proc.pid)
    finally:
        proc.stop()
    return texts, rss, ready


def engines(narrow_dir: Path, wide_dir: Path, prompts: list[str], tokens: int) -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    with tempfile.TemporaryDirectory(prefix="eldr-wide-bench-") as tmp:
        n_text, n_rss, n_ready = engine_completions(narrow_dir, prompts, tokens, Path(tmp), core)
        w_text, w_rss, w_ready = engine_completions(wide_dir, prompts, tokens, Path(tmp), core)
    same = sum(a == b for a, b in zip(n_text, w_text, strict=True))
    print(f"\n(b) vLLM-CPU engines (float32, eager, 1 core), {len(prompts)} greedy completions "
          f"of {tokens} tokens: identical text in {same} / {len(prompts)}")
    print(f"  narrow: ready in {n_ready:.0f} s, RSS {n_rss / 2**30:.2f} GiB")
    print(f"  wide:   ready in {w_ready:.0f} s, RSS {w_rss / 2**30:.2f} GiB")
    for a, b in zip(n_text, w_text, strict=True):
        if a != b:
            print(f"  first difference: {a!r} vs {b!r}")
            break


# -- (c) MoE share of a decode step ---------------------------------------------------------
def moe_share(model, ids: list[list[int]], repeats: int) -> tuple[float, float, list[int]]:
    """(median step seconds, median MoE seconds within it, distinct experts per layer)."""
    import torch
    from transformers import DynamicCache

    from eldr.capture.hf import RoutingRecorder, find_routers

    n = min(map(len, ids))
    batch = torch.tensor([list(p[:n]) for p in ids])
    blocks = [layer.mlp for layer in model.model.layers]
    spent = [0.0]
    start: list[float] = []

    def pre(_m, _i):
        start.append(time.perf_counter())

    def post(_m, _i, _o):
        spent[0] += time.perf_counter() - start.pop()

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=batch, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        with RoutingRecorder(find_routers(model)) as rec:
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            topk, _ = rec.take()
        cache.crop(-1)
        distinct = [int(np.unique(topk[:, li]).size) for li in range(topk.shape[1])]
        handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre),
                                               b.register_forward_hook(post))]
        steps, moes = [], []
        try:
            for _ in range(repeats):
                spent[0] = 0.0
                t0 = time.perf_counter()
                model(input_ids=nxt, past_key_values=cache, use_cache=True)
                steps.append(time.perf_counter() - t0)
                moes.append(spent[0])
                cache.crop(-1)
        finally:
            for h in handles:
                h.remove()
    return float(np.median(steps)), float(np.median(moes)), distinct


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from eldr.capture import tiny_moe_dir, wide_engine_bytes, wide_tiny_moe_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=64, help="prompts of the set used (max 72)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--repeats", type=int, default=30, help="timed decode steps in (c)")
    p.add_argument("--engine", action="store_true", help="also compare vLLM-CPU engines")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    narrow_dir = tiny_moe_dir()
    t0 = time.monotonic()
    wide_dir = wide_tiny_moe_dir(args.width, args.cache_dir)
    print(f"wide tiny MoE, expert width {args.width}: {wide_dir.name} ready in "
          f"{time.monotonic() - t0:.1f} s; estimated engine memory "
          f"{wide_engine_bytes(args.width) / 2**30:.2f} GiB; torch {torch.__version__}, "
          f"1 thread; {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    rows = read_prompts(args.prompts)
    tok = AutoTokenizer.from_pretrained(narrow_dir)
    ids = [tok(r["prompt"]).input_ids for r in rows]
    narrow, wide = _load(narrow_dir), _load(wide_dir)
    identity(narrow, wide, ids, args.tokens)

    if args.engine:
        engines(narrow_dir, wide_dir, [r["prompt"] for r in rows], args.tokens)

    picks = ids[:: max(1, len(ids) // 8)][:8]  # 8 prompts across the domains
    print(f"\n(c) one decode step at batch 8 (context {min(map(len, picks))} tokens each), "
          f"transformers float32, 1 thread, median of {args.repeats} steps")
    for name, model in (("narrow (32)", narrow), (f"wide ({args.width})", wide)):
        step, moe, distinct = moe_share(model, picks, args.repeats)
        print(f"  {name:<12} step {step * 1e3:7.2f} ms, MoE blocks {moe * 1e3:7.2f} ms = "
              f"{moe / step:5.1%} of the step; distinct experts per layer {distinct}")


if __name__ == "__main__":
    main()
