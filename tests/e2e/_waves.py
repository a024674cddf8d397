"""Routing compared in WAVES on real decode engines (used by the self-calibrating e2e).

A wave is 2·B requests sent at once (B of each of two domains, in the order A B B A …: a
strict A B A B would hand JSQ's alternation the domain split for free), all with the same
``max_tokens``, ``ignore_eos`` and temperature 0; the next wave starts when the whole wave
has completed. Each decoder then decodes exactly the requests routed to it, together, for
the same number of steps: the batch sizes are the routing split, recorded per wave
(``X-Eldr-Decoder``), and the per-decoder figure (the engine's measured mean distinct
experts per MoE layer per decode step, ``eldr_decoder_distinct_experts`` ``_sum /
_count`` read around the wave) compares like with like on B/B waves.

The per-request decode counts of answers sent straight to the decoders also give, offline,
the expected distinct experts per step of any split (``Σ_e 1 − Π_r (1 − p_re)``, p_re = a
request's selections of expert e per decode token, requests taken as independent): a
timing-free figure for each router's actual split.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _engines import MODEL_NAME, _metric, _request


def empty_store(kv_dir) -> None:
    """Each phase prefills from scratch: the ExampleConnector's store would otherwise let a
    later phase's prefills hit (other arrival times at the decoders: not the same traffic)."""
    for path in kv_dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}


def expected(p: np.ndarray) -> float:
    """Expected distinct experts per layer per step (mean over layers) of one batch.

    p: (R, L, E) each request's selections of each expert per decode token (its
    probability of using the expert at a step, the requests taken as independent).
    """
    return float((1.0 - np.prod(1.0 - p, axis=0)).sum(axis=1).mean())


def direct_wave(decoders: list[str], wave: list, assign: list[int], max_tokens: int
                ) -> tuple[dict, dict]:
    """Send the wave straight to the decoders (request i to ``decoders[assign[i]]``; the
    router's decode-leg mark asks for the payload): ({decoder: mean measured distinct},
    {prompt: p (L, E)})."""
    from eldr.capture.decode import decode_decode_payload

    def one(i):
        doc = {**body(wave[i][1], max_tokens), "kv_transfer_params": {"eldr_report": True}}
        status, _, raw = _request(decoders[assign[i]] + "/v1/completions", doc)
        assert status == 200, raw[:300]
        return decode_decode_payload(json.loads(raw)["kv_transfer_params"]["eldr_decode"])

    with ThreadPoolExecutor(len(wave)) as pool:
        reports = list(pool.map(one, range(len(wave))))
    measured = {d: float(np.mean([r.mean_distinct
                                  for r, a in zip(reports, assign, strict=True) if a == d]))
                for d in sorted(set(assign))}
    return measured, {w[1]: r.counts / r.tokens for w, r in zip(wave, reports, strict=True)}


def _decoder_sums(url: str, names: list[str]) -> list[tuple[float, float]]:
    _, _, page = _request(url + "/metrics")
    page = page.decode()
    return [(_metric(page, "eldr_decoder_distinct_experts_sum", decoder=n),
             _metric(page, "eldr_decoder_distinct_experts_count", decoder=n)) for n in names]


def router_wave(url: str, wave: list, names: list[str], max_tokens: int
                ) -> tuple[dict, list[int]]:
    """The whole wave at once through a router whose decoders are ``names``: ({decoder
    index: mean measured distinct}, the decoder index of each request)."""
    def one(item):
        status, headers, raw = _request(url + "/v1/completions", body(item[1], max_tokens))
        assert status == 200, raw[:300]
        return names.index({k.lower(): v for k, v in headers.items()}["x-eldr-decoder"])

    before = _decoder_sums(url, names)
    with ThreadPoolExecutor(len(wave)) as pool:
        assign = list(pool.map(one, wave))
    after = _decoder_sums(url, names)
    measured = {}
    for d in range(len(names)):
        n = after[d][1] - before[d][1]
        assert n == assign.count(d), "every request must bring its decode payload"
        if n:
            measured[d] = (after[d][0] - before[d][0]) / n
    return measured, assign


def summary(name: str, waves: list, results: list, p: dict, domains: tuple[str, str],
            per_decoder: int) -> dict:
    """Print a phase's waves and return its figures: the domain purity of the split (1 =
    each decoder got one domain, 0.5 = an even mix), and on B/B waves the measured and the
    expected (from the counts, timing-free) distinct experts per layer per step."""
    purity, measured, exp_bb, rows = [], [], [], []
    for wave, (meas, assign) in zip(waves, results, strict=True):
        split = [assign.count(d) for d in (0, 1)]
        on = [[(dom, pr) for (dom, pr), a in zip(wave, assign, strict=True) if a == d]
              for d in (0, 1)]  # the (domain, prompt) each decoder got
        purity.append(sum(max(sum(1 for dom, _ in on[d] if dom == x) for x in domains)
                          for d in (0, 1)) / len(wave))
        exp = {d: expected(np.stack([p[pr] for _, pr in on[d]])) for d in (0, 1) if split[d]}
        if split == [per_decoder, per_decoder]:
            measured.append(np.mean(list(meas.values())))
            exp_bb.append(np.mean(list(exp.values())))
        doms = " | ".join("".join(dom[0] for dom, _ in on[d]) for d in (0, 1))
        rows.append(f"{split[0]}/{split[1]} [{doms}] measured "
                    + " ".join(f"{meas[d]:.2f}" for d in sorted(meas)) + " expected "
                    + " ".join(f"{exp[d]:.2f}" for d in sorted(exp)))
    out = {"purity": float(np.mean(purity)), "bb": len(measured),
           "measured": float(np.mean(measured)) if measured else float("nan"),
           "expected": float(np.mean(exp_bb)) if exp_bb else float("nan"),
           "all": [x for meas, _ in results for x in meas.values()]}
    print(f"{name}: purity {out['purity']:.2f}, B/B waves {out['bb']}/{len(waves)}, "
          f"measured {out['measured']:.2f}, expected {out['expected']:.2f}; waves: "
          + "; ".join(rows))
    return out
