"""The discrete-event loop: arrivals → prefill pool → KV transfer → decode pool.

One heap of events ``(time, seq, kind, x)``; ``seq`` is a global counter, so events at the
same time run in the order they were scheduled (deterministic). Four kinds:

- ``ARRIVAL``: request ``x`` arrives; the prefill router picks a prefill worker by prefix
  affinity (:mod:`eldr.sim.pools`) and queues it; the next arrival is scheduled.
- ``PREFILL_DONE``: prefill worker ``x`` finished its batch; each request is routed to a
  decode worker by the policy (loads = in-flight requests per decoder, counted from this
  dispatch to the request's last token) and its KV transfer starts.
- ``KV_DONE``: request ``x``'s KV reached its decode worker; it joins the waiting queue.
- ``STEP_DONE``: decode worker ``x`` finished a step; every running request emitted one
  token; finished requests leave; the next step starts if any work is left.

A decode step admits waiting requests first (continuous batching: up to ``max_batch``
running, one token each within ``max_batch_tokens``, and their full KV — prompt + output —
must fit the worker's KV capacity), then computes its union of experts and its time
(:mod:`eldr.sim.steptime`). The simulation runs until every request has finished.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from eldr._progress import Progress
from eldr.routing import Policy, RouteRequest
from eldr.sim.config import SimConfig
from eldr.sim.metrics import SimResult
from eldr.sim.pools import DecodeWorker, PrefillRouter, PrefillWorker
from eldr.sim.steptime import StepModel, rank_masks, union_distinct
from eldr.sim.tokens import TokenBank
from eldr.traces.trace import Trace

__all__ = ["EVENT_NAMES", "make_arrivals", "simulate"]

ARRIVAL, PREFILL_DONE, KV_DONE, STEP_DONE = 0, 1, 2, 3
EVENT_NAMES = ("arrival", "prefill_done", "kv_done", "step_done")


def make_arrivals(config: SimConfig, num_trace_requests: int) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrival times in [0, warmup + duration) and the trace request of each.

    Trace requests are drawn without replacement, cycling through seeded permutations
    when more arrivals than trace requests are needed. Same config → same arrivals, for
    every policy (paired comparisons). Returns (times (N,) float64, index (N,) int64).
    """
    if num_trace_requests < 1:
        raise ValueError("the trace has no requests")
    rng = np.random.default_rng((config.seed, 0xA221))
    horizon = config.horizon_s
    expected = config.qps * horizon
    n = int(expected + 6 * np.sqrt(expected) + 16)
    gaps = rng.exponential(1.0 / config.qps, size=n)
    times = np.cumsum(gaps)
    while times[-1] < horizon:  # astronomically rare; keep drawing
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / config.qps,
                                                                             size=n))])
    times = times[times < horizon]
    reps = -(-times.size // num_trace_requests)
    index = np.concatenate([rng.permutation(num_trace_requests) for _ in range(max(reps, 1))])
    return times, index[: times.size].astype(np.int64)


def _check_inputs(trace, config, policy, signatures, decode_patterns, placement):
    from eldr.traces.models import get_preset

    model = get_preset(config.model)
    m = trace.meta
    if (m.num_layers, m.num_experts) != (model.num_layers, model.num_experts):
        raise ValueError(f"trace is (L, E) = ({m.num_layers}, {m.num_experts}) but model "
                         f"{model.name} has ({model.num_layers}, {model.num_experts})")
    if policy.num_workers != config.num_decode:
        raise ValueError(f"policy {policy.name!r} routes to {policy.num_workers} workers, "
                         f"config has num_decode={config.num_decode}")
    R = trace.num_requests
    for name, arr in (("signatures", signatures), ("decode_patterns", decode_patterns)):
        if arr is not None and (arr.ndim != 2 or arr.shape[0] != R):
            raise ValueError(f"{name} must be (R={R}, d), got shape {arr.shape}")
    if placement is None:
        if config.ep > 1:  # vLLM's default linear layout: contiguous blocks of E/ep
            E = m.num_experts
            layout = np.broadcast_to(np.arange(E) // (E // config.ep), (m.num_layers, E))
            return rank_masks(layout, config.ep)[None]
        return None
    p = np.asarray(placement)
    if p.ndim == 2:
        p = p[None]
    if p.ndim != 3 or p.shape[1:] != (m.num_layers, m.num_experts) or \
            p.shape[0] not in (1, config.num_decode):
        raise ValueError(f"placement must be (L, E) or (num_decode, L, E), got {p.shape}")
    return np.stack([rank_masks(x, config.ep) for x in p])  # (1 or K, ep, L, W)


def simulate(
    trace: Trace,
    config: SimConfig,
    policy: Policy,
    *,
    signatures: np.ndarray | None = None,
    decode_patterns: np.ndarray | None = None,
    profiles=None,
    placement: np.ndarray | None = None,
    arrivals: tuple[np.ndarray, np.ndarray] | None = None,
    tokens: TokenBank | None = None,
    encoder=None,
    record_events: bool = False,
    progress: bool = False,
) -> SimResult:
    """Simulate ``config`` serving requests of ``trace`` with decode router ``policy``.

    signatures: (R, d) float32 unit rows per trace request (``eldr`` policies);
    decode_patterns: (R, d') rows for ``oracle_signature``; profiles: the (L, E) predicted
    per-token expert profile of trace request r, as ``profiles(r)`` or an (R, L, E) array
    (``eldr_cost``); placement: EP rank of every
    expert, (L, E) for one global layout or (num_decode, L, E) per decoder (``None``:
    contiguous blocks when ``ep > 1``); arrivals: explicit (times, trace index) instead of
    Poisson; tokens: a :class:`TokenBank` shared across runs (seeded by ``config.seed``
    otherwise); encoder: the fitted SignatureEncoder, needed when
    ``config.signature_source`` is ``fresh`` or ``sigcache`` (:mod:`eldr.sim.signatures`).
    ``record_events`` keeps a log of (time, event, request, worker).
    """
    wall0 = time.perf_counter()
    masks = _check_inputs(trace, config, policy, signatures, decode_patterns, placement)
    sm = StepModel(config)
    bank = tokens if tokens is not None else TokenBank(trace, seed=config.seed)
    if bank.trace is not trace:
        raise ValueError("tokens: the TokenBank was built for another trace")
    if arrivals is None:
        arrivals = make_arrivals(config, trace.num_requests)
    t_arr = np.asarray(arrivals[0], dtype=np.float64)
    tidx = np.asarray(arrivals[1], dtype=np.int64)
    N = t_arr.size
    if tidx.shape != (N,) or (N and (tidx.min() < 0 or tidx.max() >= trace.num_requests)):
        raise ValueError("arrivals: trace indices must be (N,) and within the trace")
    if N > 1 and (np.diff(t_arr) < 0).any():
        raise ValueError("arrivals: times must be non-decreasing")

    prompt = trace.prompt_lens[tidx]
    n_out = trace.output_lens[tidx]
    need_kv = np.array([sm.model.kv_bytes(int(p + o)) for p, o in zip(prompt, n_out, strict=True)])
    if N and need_kv.max() > sm.kv_capacity_bytes:
        i = int(np.argmax(need_kv))
        raise ValueError(f"request {i} needs {need_kv[i] / 1e9:.2f} GB of KV, more than a "
                         f"decode worker holds ({sm.kv_capacity_bytes / 1e9:.2f} GB)")
    K, P = config.num_decode, config.num_prefill
    domains = trace.domains
    rec = {  # per arrival; NaN / -1 until the event happens
        "t_arrival": t_arr,
        "trace_index": tidx,
        "prompt_len": prompt,
        "n_out": n_out,
        "prefill_worker": np.full(N, -1, np.int64),
        "cached_tokens": np.zeros(N, np.int64),
        "t_prefill_start": np.full(N, np.nan),
        "t_prefill_end": np.full(N, np.nan),
        "decoder": np.full(N, -1, np.int64),
        "t_kv_done": np.full(N, np.nan),
        "t_admit": np.full(N, np.nan),
        "t_first": np.full(N, np.nan),
        "t_last": np.full(N, np.nan),
        "tokens_out": np.zeros(N, np.int64),
        "finishes": np.zeros(N, np.int64),
    }
    online = None
    if config.signature_source != "trace":
        from eldr.sim.signatures import OnlineSignatures

        online = OnlineSignatures(trace, config.signature_source, encoder, config.num_prefill,
                                  config.prefix_cache_blocks)
        rec["signature_exact"] = np.zeros(N, dtype=bool)
    profile_of = None
    if profiles is not None and "profile" in getattr(policy, "inputs", ()):
        profile_of = profiles if callable(profiles) else profiles.__getitem__
    router = PrefillRouter(trace, config)
    prefills = [PrefillWorker(config) for _ in range(P)]
    decoders = [DecodeWorker() for _ in range(K)]
    loads = np.zeros(K, dtype=np.float64)
    events: list | None = [] if record_events else None
    heap: list = []
    seq = 0
    warm, horizon = config.warmup_s, config.horizon_s
    max_run = min(config.max_batch, config.max_batch_tokens)
    window = [0]  # output tokens emitted inside the measured window
    sliding = sm.sliding_window

    def start_prefill(w: int, now: float) -> None:
        nonlocal seq
        pw = prefills[w]
        batch, fresh = pw.take_batch(router, tidx, prompt, rec["cached_tokens"])
        distinct = int(union_distinct(bank.prefill[tidx[batch]]).sum())
        dt = sm.prefill_time(distinct, fresh)
        rec["t_prefill_start"][batch] = now
        heapq.heappush(heap, (now + dt, seq, PREFILL_DONE, w))
        seq += 1

    def start_step(d: int, now: float) -> None:
        nonlocal seq
        dw = decoders[d]
        s = dw.step
        while dw.waiting and len(dw.ids) < max_run:
            i = dw.waiting[0]
            if dw.kv_bytes + need_kv[i] > sm.kv_capacity_bytes:
                break
            dw.waiting.popleft()
            dw.admit(i, bank.decode(int(tidx[i])), int(prompt[i]), int(n_out[i]), need_kv[i])
            rec["t_admit"][i] = now
            if events is not None:
                events.append((now, "admit", i, d))
        rows = np.stack([b[s - s0] for b, s0 in zip(dw.bits, dw.starts, strict=True)])
        if masks is None:
            per_layer = union_distinct(rows)
            distinct = int(per_layer.sum())
            moe_distinct = distinct
        else:
            m = masks[d] if masks.shape[0] > 1 else masks[0]  # (ep, L, W)
            u = np.bitwise_or.reduce(rows, axis=0)
            per_rank = np.bitwise_count(u[None] & m).sum(axis=-1, dtype=np.int64)  # (ep, L)
            distinct = int(per_rank.sum())
            moe_distinct = int(per_rank.max(axis=0).sum())
        B = len(dw.ids)
        ctx = dw.prompt_sum - dw.start_sum + B * s  # Σ (prompt + tokens emitted so far)
        slide = 0
        if sliding is not None:
            slide = sum(min(p + s - s0, sliding)
                        for p, s0 in zip(dw.prompts, dw.starts, strict=True))
        dt = sm.decode_step_time(moe_distinct, ctx, slide)
        dw.busy = True
        dw.cur_batch, dw.cur_distinct = B, distinct
        heapq.heappush(heap, (now + dt, seq, STEP_DONE, d))
        seq += 1

    bar = Progress(N, f"simulate {policy.name} {config.qps:g} req/s",
                   enabled=None if progress else False)
    done = 0
    if N:
        heapq.heappush(heap, (t_arr[0], seq, ARRIVAL, 0))
        seq += 1
    with bar:
        while heap:
            now, _, kind, x = heapq.heappop(heap)
            if kind == STEP_DONE:
                dw = decoders[x]
                s = dw.step
                if warm <= now < horizon:
                    window[0] += dw.cur_batch
                    dw.win_steps += 1
                    dw.win_batch += dw.cur_batch
                    dw.win_distinct += dw.cur_distinct
                for i in dw.new:
                    rec["t_first"][i] = now
                dw.new = []
                finished = dw.finish_at.pop(s, None)
                if finished:
                    for i, s0 in finished:
                        rec["t_last"][i] = now
                        rec["tokens_out"][i] = s - s0 + 1
                        rec["finishes"][i] += 1
                        loads[x] -= 1.0
                        policy.on_release(str(i), "completed")
                        if events is not None:
                            events.append((now, "finish", i, x))
                    dw.remove({i for i, _ in finished}, need_kv)
                    done += len(finished)
                    bar.update(len(finished))
                dw.step = s + 1
                dw.busy = False
                if events is not None:
                    events.append((now, "step_done", dw.cur_batch, x))
                if dw.ids or dw.waiting:
                    start_step(x, now)
            elif kind == ARRIVAL:
                i = x
                if i + 1 < N:
                    heapq.heappush(heap, (t_arr[i + 1], seq, ARRIVAL, i + 1))
                    seq += 1
                w = router.choose(int(tidx[i]), prefills)
                rec["prefill_worker"][i] = w
                prefills[w].enqueue(i, int(prompt[i]))
                if events is not None:
                    events.append((now, "arrival", i, w))
                if not prefills[w].busy:
                    prefills[w].busy = True
                    start_prefill(w, now)
            elif kind == PREFILL_DONE:
                pw = prefills[x]
                for i in pw.batch:
                    r = int(tidx[i])
                    sig = None if signatures is None else signatures[r]
                    if online is not None and sig is not None:
                        exact = sig
                        sig = online.signature(x, r, int(rec["cached_tokens"][i]),
                                               router.hashes(r))
                        rec["signature_exact"][i] = np.allclose(sig, exact, rtol=0, atol=1e-6)
                    req = RouteRequest(
                        str(i),
                        signature=sig,
                        domain=None if domains is None else int(domains[r]),
                        decode_pattern=None if decode_patterns is None else decode_patterns[r],
                        profile=None if profile_of is None else profile_of(r),
                        context_tokens=int(prompt[i]),
                    )
                    d = policy.choose(req, loads)
                    policy.on_dispatch(req, d)
                    loads[d] += 1.0
                    rec["decoder"][i] = d
                    rec["t_prefill_end"][i] = now
                    heapq.heappush(heap, (now + sm.kv_transfer_time(int(prompt[i])), seq,
                                          KV_DONE, i))
                    seq += 1
                    if events is not None:
                        events.append((now, "prefill_done", i, x))
                pw.finish_batch()
                if pw.queue:
                    start_prefill(x, now)
                else:
                    pw.busy = False
            else:  # KV_DONE
                i = x
                d = int(rec["decoder"][i])
                rec["t_kv_done"][i] = now
                decoders[d].waiting.append(i)
                if events is not None:
                    events.append((now, "kv_done", i, d))
                if not decoders[d].busy:
                    start_step(d, now)
    wall = time.perf_counter() - wall0
    return SimResult(
        config=config,
        policy=policy.name,
        requests=rec,
        decoder_steps=np.array([dw.win_steps for dw in decoders], dtype=np.int64),
        decoder_batch_sum=np.array([dw.win_batch for dw in decoders], dtype=np.int64),
        decoder_distinct_sum=np.array([dw.win_distinct for dw in decoders], dtype=np.int64),
        num_layers=sm.num_layers,
        window_tokens=window[0],
        total_steps=int(sum(dw.step for dw in decoders)),
        wall_s=wall,
        events=events,
        num_fallbacks=int(policy.num_fallbacks),
    )
