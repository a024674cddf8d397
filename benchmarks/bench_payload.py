"""Payload sizes and encode/decode times: version 1 (base64 + zlib) against version 2
(base-91 digits, dense or sparse, optionally the layer mask), in the same run.

    python benchmarks/bench_payload.py [--repeat 2000]

Counts are drawn like a real MoE's: each token picks top-k distinct experts per layer
from skewed per-layer popularities (gamma(0.5) weights, seeded). "encode" is the engine's
side (counts → JSON-able dict), "decode" the router's (dict → validated (L, E) int32
counts); the JSON document itself is parsed by the router's HTTP layer either way, so its
size is printed. Times are the best of 5 rounds, per call.
"""

from __future__ import annotations

import argparse
import json
import timeit
from functools import partial

import numpy as np

from eldr.capture.payload import (
    decode_counts,
    decode_payload,
    encode_counts,
    encode_payload,
    topk_to_counts,
)


def _counts(tokens: int, L: int, E: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logw = np.log(rng.gamma(0.5, size=(L, E)) + 1e-9)
    out = np.zeros((L, E), dtype=np.int32)
    for lo in range(0, tokens, 512):  # chunks keep the (T, L, E) Gumbel draw small
        n = min(512, tokens - lo)
        ids = np.argsort(-(logw[None] + rng.gumbel(size=(n, L, E))), axis=2)[:, :, :k]
        out += topk_to_counts(ids, E)
    return out


def _us(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000, help="calls per timing round")
    args = ap.parse_args(argv)
    cases = [("Qwen3-30B-A3B-like 48x128 top-8", 48, 128, 8, (512, 2048, 8192)),
             ("tiny MoE 6x64 top-4", 6, 64, 4, (40, 200))]
    print(f"{'model':34} {'tokens':>6} {'payload':>13} {'JSON bytes':>10} "
          f"{'encode us':>9} {'decode us':>9} {'sum us':>7}")
    for name, L, E, k, lengths in cases:
        mask = list(range(0, L, 3)) if L > 6 else [2, 3]  # a third of the layers
        for tokens in lengths:
            c = _counts(tokens, L, E, k)
            for label, obj, enc, dec in _variants(c, tokens, mask):
                got = dec(obj)
                rows_sent = obj.get("layers", list(range(L)))
                assert (got[rows_sent] == c[rows_sent]).all(), label  # exact round trip
                t_enc = _us(enc, args.repeat)
                t_dec = _us(partial(dec, obj), args.repeat)
                detail = f" {obj['enc']} w={obj['w']}" if obj["v"] == 2 else ""
                print(f"{name:34} {tokens:>6} {label:>13} {len(json.dumps(obj)):>10} "
                      f"{t_enc:>9.1f} {t_dec:>9.1f} {t_enc + t_dec:>7.1f}{detail}")
    _router_side(args.repeat)


def _router_side(repeat: int) -> None:
    """The router's signature path before the decision: payload decode + signature encode
    (count_idf over a 16-of-48 layer mask, as RoutingState.encode does it)."""
    from eldr.fit.signature import SignatureEncoder

    L, E, tokens = 48, 128, 2048
    c = _counts(tokens, L, E, 8)
    mask = np.arange(0, L, 3)
    idf = np.random.default_rng(1).random((L, E)) + 0.1
    masked = SignatureEncoder.from_state({"representation": "count_idf",
                                          "num_layers": mask.size, "num_experts": E,
                                          "layers": np.arange(mask.size), "idf": idf[mask]})
    print(f"\nrouter side, {L}x{E}, {tokens} tokens: payload decode + signature encode "
          f"(count_idf, {mask.size}-layer mask)")
    for label, obj, _enc, dec in _variants(c, tokens, mask.tolist()):
        def path(obj=obj, dec=dec):
            return masked.transform(dec(obj)[mask])
        t_sig = _us(partial(masked.transform, c[mask]), repeat)
        print(f"  {label:13} {_us(path, repeat):7.1f} us  (signature encode alone "
              f"{t_sig:.1f} us)")


def _variants(c: np.ndarray, tokens: int, mask: list[int]):
    """(label, payload as parsed off the wire, encode(), decode(obj) -> (L, E) counts)."""
    L, E = c.shape

    def dec_v1(obj):
        return decode_counts(obj, num_layers=L, num_experts=E)

    def dec_v2(obj):
        return decode_payload(obj, num_layers=L, num_experts=E).counts

    encoders = [("v1 zlib+b64", lambda: {**encode_counts(c), "tokens": tokens}, dec_v1),
                ("v2", partial(encode_payload, c, tokens=tokens), dec_v2),
                (f"v2 mask {len(mask)}", partial(encode_payload, c, tokens=tokens,
                                                 layers=mask), dec_v2)]
    for label, enc, dec in encoders:
        yield label, json.loads(json.dumps(enc())), enc, dec

if __name__ == "__main__":
    main()
