#!/usr/bin/env python3
"""Train the embedded tiny MoE (Qwen3-MoE architecture) on the local multi-domain corpus.

Run ``scripts/prepare_tiny_moe_data.py`` first (by default it writes ``out/tinymoe_data``
under the repository root), then::

    python scripts/train_tiny_moe.py [--data out/tinymoe_data] [--out src/eldr/data/tiny_moe]

Both defaults are resolved against the repository root, not the working directory.

The result is an ordinary Hugging Face model folder (``config.json`` with
``architectures: ["Qwen3MoeForCausalLM"]``, ``model.safetensors`` in bfloat16,
``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json``) that
transformers loads with ``from_pretrained`` and vLLM serves with ``--model``.

Recipe (defaults): a 4,096-token byte-level BPE trained on a domain-balanced sample;
hidden 128, 6 layers, 4 query / 2 KV heads of width 32, 64 routed experts of width 32,
top-4 with renormalised weights, tied embeddings (5.6 M parameters); AdamW, lr 3e-3
with 30 warm-up steps and cosine decay to 10 %; batches of 8 sequences of 256 tokens.
Every sequence is one window of one domain's token stream (domains drawn uniformly), so a
batch mixes domains but a sequence never does. A small Switch-style load-balancing loss
(coefficient 0.01, transformers' ``router_aux_loss_coef``) keeps all experts in use
without forcing every domain onto every expert. Seeded (``--seed``). By default the run
lasts ``--max-cpu-minutes`` of process CPU time (24 = 12 minutes of 2 idle cores) and the
cosine schedule follows the CPU time used, so a machine shared with other jobs trains
the same amount, only slower in wall-clock terms (the summary records both);
``--steps N`` gives a step-driven schedule that is reproducible on the same machine,
threads and versions. The model is saved every ``--checkpoint-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "out" / "tinymoe_data"  # what prepare_tiny_moe_data.py writes
DEFAULT_OUT = REPO / "src" / "eldr" / "data" / "tiny_moe"  # the model eldr ships


def train_tokenizer(texts_by_domain: dict[str, list[str]], vocab_size: int, sample_chars: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def sample():  # the same number of characters from every domain
        for texts in texts_by_domain.values():
            budget = sample_chars
            for t in texts:
                yield t[:budget]
                budget -= len(t)
                if budget <= 0:
                    break

    tok.train_from_iterator(sample(), trainer=trainer)
    return tok


def encode_streams(tok, texts_by_domain: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """One int32 token stream per domain: documents joined by the end-of-text token."""
    eos = tok.token_to_id("<|endoftext|>")
    out = {}
    for domain, texts in texts_by_domain.items():
        ids = [np.array([*e.ids, eos], dtype=np.int32) for e in tok.encode_batch(texts)]
        out[domain] = np.concatenate(ids)
    return out


def read_jsonl(path: Path) -> dict[str, list[str]]:
    by_domain: dict[str, list[str]] = {}
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            by_domain.setdefault(row["domain"], []).append(row["text"])
    return by_domain


def sample_batch(streams, domains, rng, batch: int, seq_len: int):
    import torch

    rows = []
    for d in rng.choice(len(domains), size=batch):
        s = streams[domains[d]]
        start = int(rng.integers(0, len(s) - seq_len - 1))
        rows.append(s[start : start + seq_len])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def build_model(args, vocab_size: int, eos: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=1024, tie_word_embeddings=True,
        output_router_logits=True, router_aux_loss_coef=args.aux_loss,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0)
    return Qwen3MoeForCausalLM(cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA),
                    help="corpus folder (default: out/tinymoe_data in the repository)")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="model folder (default: src/eldr/data/tiny_moe in the repository)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-width", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--aux-loss", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed number of steps (reproducible schedule); default: train for "
                    "--max-minutes with the schedule driven by elapsed time")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-cpu-minutes", type=float, default=24.0,
                    help="CPU-time budget of the training loop, summed over threads (24 = "
                    "12 wall-clock minutes on 2 idle cores; a shared machine takes longer)")
    ap.add_argument("--checkpoint-every", type=int, default=100,
                    help="save the model to --out every N steps (0: only at the end)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    data = Path(args.data)
    t0 = time.time()
    train_texts = read_jsonl(data / "train.jsonl")
    held_texts = read_jsonl(data / "heldout.jsonl")
    domains = sorted(train_texts)
    tok = train_tokenizer(train_texts, args.vocab, sample_chars=400_000)
    eos = tok.token_to_id("<|endoftext|>")
    streams = encode_streams(tok, train_texts)
    held = encode_streams(tok, {d: held_texts[d] for d in domains if d in held_texts})
    n_tokens = {d: len(s) for d, s in streams.items()}
    print(f"tokenizer + encoding {time.time() - t0:.0f}s; train tokens {n_tokens}", flush=True)

    model = build_model(args, tok.get_vocab_size(), eos)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    eval_rng = np.random.default_rng(args.seed + 1)
    eval_batches = [sample_batch(held, sorted(held), eval_rng, 8, args.seq_len)
                    for _ in range(4)]

    budget_s = 60 * args.max_cpu_minutes
    cpu0 = time.process_time()

    def progress(step: int, cpu: float) -> float:
        """Fraction of the run done: by steps if fixed, else by CPU time used."""
        if args.steps is not None:
            return step / args.steps
        return cpu / budget_s

    def lr_at(step: int, elapsed: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(progress(step, elapsed), 1.0)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(model(input_ids=x, labels=x, output_router_logits=False).loss)
                      for x in eval_batches]
        model.train()
        return float(np.mean(losses))

    log = []
    t_train = time.time()
    stopped_early = False
    model.train()
    out_dir = Path(args.out)
    step = 0
    while True:
        elapsed = time.time() - t_train
        cpu = time.process_time() - cpu0
        if progress(step, cpu) >= 1.0:
            break
        if args.steps is not None and cpu > budget_s:
            stopped_early = True
            print(f"CPU budget of {args.max_cpu_minutes} min reached at step {step}")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cpu)
        x = sample_batch(streams, domains, rng, args.batch, args.seq_len)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            entry = {"step": step, "loss": round(float(out.loss.detach()), 4),
                     "aux": round(float(out.aux_loss.detach()), 4),
                     "lr": round(lr_at(step, cpu), 6), "minutes": round(elapsed / 60, 2),
                     "cpu_minutes": round(cpu / 60, 2)}
            if step % 200 == 0:
                entry["heldout_loss"] = round(evaluate(), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save(model, tok, out_dir, eos, {"checkpoint_step": step})
    train_minutes = (time.time() - t_train) / 60
    cpu_minutes = (time.process_time() - cpu0) / 60
    final_heldout = evaluate()
    recipe = {k: v for k, v in vars(args).items() if k not in ("data", "out")}
    summary = {"recipe": recipe, "parameters": n_params, "train_minutes": round(train_minutes, 2),
               "train_cpu_minutes": round(cpu_minutes, 2),
               "steps_done": step, "stopped_early": stopped_early,
               "final_heldout_loss": round(final_heldout, 4), "train_tokens": n_tokens,
               "domains": domains, "torch": torch.__version__, "log": log}
    save(model, tok, out_dir, eos, summary)
    print(f"done: {train_minutes:.1f} min ({cpu_minutes:.1f} CPU min), held-out loss "
          f"{final_heldout:.3f}", flush=True)
    return 0


def save(model, tok, out_dir: Path, eos: int, summary: dict) -> None:
    """Write a bfloat16 copy of the model, the tokenizer and ``training_summary.json``."""
    import copy

    import torch
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    export = copy.deepcopy(model).to(torch.bfloat16)  # training continues in float32
    export.config.output_router_logits = False  # inference does not need the aux loss
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(export.generation_config, name, eos)
    export.generation_config.do_sample = False
    export.save_pretrained(out_dir)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.model_max_length = 1024
    fast.save_pretrained(out_dir)
    tmp = out_dir / "training_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out_dir / "training_summary.json")


if __name__ == "__main__":
    raise SystemExit(main())
