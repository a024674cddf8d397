"""The router's cost of routing on the prompt: tokenizing a request (text, chat with its
template, token ids) and, with an artifact, the prediction of its routing inputs, per
request, as ``eldr serve`` runs them (eldr.proxy.request.prompts).

    PYTHONPATH=src python benchmarks/bench_prompt_routing.py [--artifact DIR] [--tokens N ...]

Prints p50 / p99 in microseconds for each prompt length. The text is the tiny MoE's own
tokenizer over English prose repeated to length (its tokens per byte are typical of
English); ``--artifact`` (one with a prompt predictor) adds the whole decision input:
tokens -> predicted signature and profile (``predict_reading``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from eldr.proxy.request.prompts import (
    PromptTokenizer,
    RequestPrompt,
    predict_reading,
    tokenizer_dir_for,
)

PROSE = ("The committee reviewed the proposal in detail and asked the authors to clarify "
         "how the measurements were taken, which baseline they compared against, and why "
         "the confidence intervals in the second table are wider than in the first. ")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "<|assistant|>")


def _times(fn, repeat: int) -> np.ndarray:
    fn()  # warm
    out = np.empty(repeat)
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out * 1e6


def _text_of(tok: PromptTokenizer, tokens: int) -> str:
    text = PROSE
    while len(tok.encode(text)) < tokens:
        text += PROSE
    ids = tok.encode(text)[:tokens]
    return tok._tok.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default=None, help="an artifact with a prompt predictor")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chat.jinja"
        template.write_text(TEMPLATE)
        tok = PromptTokenizer(tokenizer_dir_for("tiny_moe"), chat_template=template)
        state = None
        if args.artifact:
            from eldr.proxy.config import ServeConfig
            from eldr.proxy.request.decision import build_state

            state = build_state(ServeConfig(
                prefill_urls=("http://p:1",), decode_urls=("http://d:1", "http://d:2"),
                artifact=args.artifact, policy="eldr", tokenizer=tokenizer_dir_for("tiny_moe"),
                chat_template=str(template)))
        _run(args, tok, state)


def _run(args, tok: PromptTokenizer, state) -> None:
    print(f"{'tokens':>7} {'what':<28} {'p50 us':>9} {'p99 us':>9}")
    for n in args.tokens:
        text = _text_of(tok, n)
        ids = tok.encode(text)
        cases = {
            "completions text": lambda t=text: RequestPrompt(
                {"prompt": t}, "completions").token_ids(tok),
            "chat (template + encode)": lambda t=text: RequestPrompt(
                {"messages": [{"role": "user", "content": t}]}, "chat").token_ids(tok),
            "completions token ids": lambda i=ids: RequestPrompt(
                {"prompt": i}, "completions").token_ids(None),
        }
        if state is not None:
            cases["text -> predicted inputs"] = lambda t=text: predict_reading(
                state, RequestPrompt({"prompt": t}, "completions"))
        for name, fn in cases.items():
            us = _times(fn, args.repeat)
            print(f"{len(ids):>7} {name:<28} {np.percentile(us, 50):>9.1f} "
                  f"{np.percentile(us, 99):>9.1f}")


if __name__ == "__main__":
    main()
