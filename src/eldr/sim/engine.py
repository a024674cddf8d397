"""The discrete-event loop: arrivals → prefill pool → KV transfer → decode pool.

Vidur's shape: a :class:`Simulation` holds the cluster's state and one handler per event
kind; a handler handles one event and returns the events it causes, as ``(time, kind,
subject)``. The loop (:meth:`Simulation.run`) pops the earliest event of a heap, sets the
clock, calls its handler and pushes what it returned. Heap entries are ``(time, seq, kind,
subject)`` with ``seq`` a global counter, so events at the same time run in the order they
were scheduled (deterministic). Four kinds:

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
from eldr.sim.records import RequestRecord, Requests
from eldr.sim.steptime import StepModel, rank_masks, union_distinct
from eldr.sim.tokens import TokenBank
from eldr.traces.trace import Trace

__all__ = ["EVENT_NAMES", "Simulation", "make_arrivals", "simulate"]

ARRIVAL, PREFILL_DONE, KV_DONE, STEP_DONE = 0, 1, 2, 3
# steps a decoder plans at once (Simulation.plan); an admission drops the rest of a plan,
# so longer plans waste more when requests arrive often
PLAN_STEPS = 32
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


Event = tuple[float, int, int]  # (time, kind, subject) as a handler returns it


class Simulation:
    """State of one run and its four event handlers (module docstring).

    Built by :func:`simulate` from checked inputs; ``run()`` drives it to completion.
    ``records[i]`` is arrival i's :class:`~eldr.sim.records.RequestRecord`.
    """

    def __init__(self, trace: Trace, config: SimConfig, policy: Policy, *, sm: StepModel,
                 bank: TokenBank, t_arr: np.ndarray, tidx: np.ndarray, need_kv: np.ndarray,
                 masks: np.ndarray | None, signatures, decode_patterns, profile_of, online,
                 record_events: bool, bar: Progress) -> None:
        self.config, self.policy, self.sm, self.bank = config, policy, sm, bank
        self.t_arr, self.tidx, self.need_kv, self.masks = t_arr, tidx, need_kv, masks
        # Python lists of what the per-step code reads one element at a time (indexing a
        # list is several times faster than an array; the values are the same)
        self.tidx_list, self.kv_list = tidx.tolist(), need_kv.tolist()
        self.flat = bank.flat_rows()  # (Σ n_out, L·W) every token's row; None: too large
        self.signatures, self.decode_patterns = signatures, decode_patterns
        self.profile_of, self.online, self.bar = profile_of, online, bar
        self.domains = trace.domains
        self.prompt = trace.prompt_lens[tidx]
        self.n_out = trace.output_lens[tidx]
        self.prompt_list, self.n_out_list = self.prompt.tolist(), self.n_out.tolist()
        # Σ_l D_l of each trace request's prompt alone (a prefill batch of one request)
        self.prefill_distinct = np.bitwise_count(bank.prefill).sum(axis=(1, 2),
                                                                   dtype=np.int64).tolist()
        self.records = [RequestRecord(int(r), float(t), int(p), int(o)) for r, t, p, o in
                        zip(tidx, t_arr, self.prompt, self.n_out, strict=True)]
        self.router = PrefillRouter(trace, config)
        self.prefills = [PrefillWorker(config) for _ in range(config.num_prefill)]
        self.decoders = [DecodeWorker() for _ in range(config.num_decode)]
        self.loads = np.zeros(config.num_decode, dtype=np.float64)  # in flight per decoder
        self.events: list | None = [] if record_events else None  # (time, what, req, worker)
        self.warm, self.horizon = config.warmup_s, config.horizon_s
        self.max_run = min(config.max_batch, config.max_batch_tokens)
        self.moe_fixed = sm.num_layers * sm.a  # the a-part of StepModel.moe_time
        self.step_range = np.arange(PLAN_STEPS, dtype=np.int64)
        self.window_tokens = 0  # output tokens emitted by steps ending inside the window
        self.num_done = 0
        self.now = 0.0
        self.handlers = (self.on_arrival, self.on_prefill_done, self.on_kv_done,
                         self.on_step_done)  # indexed by event kind

    def run(self) -> None:
        """Pop the earliest event, set the clock, handle it, push the events it returns.

        A handler that returns one event (most do: a step's end starts the next step)
        pushes and pops in one ``heappushpop``, which hands the event straight back
        when it is the earliest (the same order as a push and a pop)."""
        if not self.t_arr.size:
            return
        heap: list = []
        item = (self.t_arr[0], 0, ARRIVAL, 0)
        seq, handlers = 1, self.handlers
        heappush, heappop, heappushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
        while True:
            self.now, _, kind, x = item
            out = handlers[kind](x, self.now)
            if len(out) == 1:
                t, k, y = out[0]
                item = heappushpop(heap, (t, seq, k, y))
                seq += 1
                continue
            for t, k, y in out:
                heappush(heap, (t, seq, k, y))
                seq += 1
            if not heap:
                return
            item = heappop(heap)

    def log(self, now: float, what: str, i: int, worker: int) -> None:
        if self.events is not None:
            self.events.append((now, what, i, worker))

    # -- handlers: each handles one event and returns the events it causes ------------------
    def on_arrival(self, i: int, now: float) -> list[Event]:
        """Route arrival ``i`` to a prefill worker; schedule the next arrival."""
        out: list[Event] = []
        if i + 1 < self.t_arr.size:
            out.append((self.t_arr[i + 1], ARRIVAL, i + 1))
        w = self.router.choose(self.tidx_list[i], self.prefills)
        self.records[i].prefill_worker = w
        pw = self.prefills[w]
        pw.enqueue(i, self.prompt_list[i])
        if self.events is not None:
            self.events.append((now, "arrival", i, w))
        if not pw.busy:
            pw.busy = True
            out.append(self.start_prefill(w, now))
        return out

    def on_prefill_done(self, w: int, now: float) -> list[Event]:
        """Prefill worker ``w``'s batch is done: route each request, start its KV transfer."""
        pw, policy, rec, events = self.prefills[w], self.policy, self.records, self.events
        out: list[Event] = []
        for i in pw.batch:
            r = self.tidx_list[i]
            prompt = self.prompt_list[i]
            sig = None if self.signatures is None else self.signatures[r]
            if self.online is not None and sig is not None:
                exact = sig
                sig = self.online.signature(w, r, rec[i].cached_tokens, self.router.hashes(r))
                rec[i].signature_exact = bool(np.allclose(sig, exact, rtol=0, atol=1e-6))
            req = RouteRequest(
                str(i),
                signature=sig,
                domain=None if self.domains is None else int(self.domains[r]),
                decode_pattern=None if self.decode_patterns is None
                else self.decode_patterns[r],
                profile=None if self.profile_of is None else self.profile_of(r),
                context_tokens=prompt,
            )
            d = policy.choose(req, self.loads)
            policy.on_dispatch(req, d)
            self.loads[d] += 1.0
            rec[i].decoder = d
            rec[i].t_prefill_end = now
            out.append((now + self.sm.kv_transfer_time(prompt), KV_DONE, i))
            if events is not None:
                events.append((now, "prefill_done", i, w))
        pw.finish_batch()
        if pw.queue:
            out.append(self.start_prefill(w, now))
        else:
            pw.busy = False
        return out

    def on_kv_done(self, i: int, now: float) -> list[Event]:
        """Request ``i``'s KV reached its decoder: it waits there; start a step if idle."""
        d = self.records[i].decoder
        self.records[i].t_kv_done = now
        dw = self.decoders[d]
        dw.waiting.append(i)
        if self.events is not None:
            self.events.append((now, "kv_done", i, d))
        return [] if dw.busy else [self.start_step(d, now)]

    def on_step_done(self, d: int, now: float) -> list[Event]:
        """Decoder ``d``'s step is done: one token each, finished requests leave."""
        dw = self.decoders[d]
        s, batch = dw.step, dw.cur_batch
        if self.warm <= now < self.horizon:
            self.window_tokens += batch
            dw.win_steps += 1
            dw.win_batch += batch
            dw.win_distinct += dw.cur_distinct
        if dw.new:
            rec = self.records
            for i in dw.new:
                rec[i].t_first = now
            dw.new = []
        events = self.events
        finished = dw.finish_at.pop(s, None)
        if finished:
            rec, loads, release = self.records, self.loads, self.policy.on_release
            for i, s0 in finished:
                r = rec[i]
                r.t_last = now
                r.tokens_out = s - s0 + 1
                r.finishes += 1
                loads[d] -= 1.0
                release(str(i), "completed")
                if events is not None:
                    events.append((now, "finish", i, d))
            dw.remove({i for i, _ in finished})
            self.num_done += len(finished)
            self.bar.update(len(finished))
        dw.step = s + 1
        if events is not None:
            events.append((now, "step_done", batch, d))
        if dw.waiting:
            return [self.start_step(d, now)]
        if not dw.ids:
            dw.busy = False
            return []
        # start_step without admissions, inline (the per-step path)
        if not dw.plan_dt:
            self.plan(dw, d)
        dw.cur_batch, dw.cur_distinct = len(dw.ids), dw.plan_distinct.pop()
        return [(now + dw.plan_dt.pop(), STEP_DONE, d)]

    # -- work starts: each returns the event that ends it ------------------------------------
    def start_prefill(self, w: int, now: float) -> Event:
        """Worker ``w`` takes its next prefill batch."""
        batch, cached, fresh = self.prefills[w].take_batch(self.router, self.tidx_list,
                                                           self.prompt_list)
        rec = self.records
        for i, c in zip(batch, cached, strict=True):
            rec[i].cached_tokens = c
            rec[i].t_prefill_start = now
        if len(batch) == 1:  # most batches: the request's own count, computed once
            distinct = self.prefill_distinct[self.tidx_list[batch[0]]]
        else:
            distinct = int(union_distinct(self.bank.prefill[self.tidx[batch]]).sum())
        return now + self.sm.prefill_time(distinct, fresh), PREFILL_DONE, w

    def start_step(self, d: int, now: float) -> Event:
        """Decoder ``d`` admits what fits, then runs one step of its batch.

        The step's time and expert count come from the decoder's plan (:meth:`plan`),
        made again whenever the running set has changed."""
        dw = self.decoders[d]
        if dw.waiting and len(dw.ids) < self.max_run:
            self.admit(dw, d, now)
        if not dw.plan_dt:
            self.plan(dw, d)
        dw.busy = True
        dw.cur_batch, dw.cur_distinct = len(dw.ids), dw.plan_distinct.pop()
        return now + dw.plan_dt.pop(), STEP_DONE, d

    def admit(self, dw: DecodeWorker, d: int, now: float) -> None:
        """Decoder ``d`` admits waiting requests (FIFO) while its batch has room and their
        full KV fits."""
        kv, capacity, flat, bank = self.kv_list, self.sm.kv_capacity_bytes, self.flat, self.bank
        events = self.events
        while dw.waiting and len(dw.ids) < self.max_run:
            i = dw.waiting[0]
            if dw.kv_bytes + kv[i] > capacity:
                break
            dw.waiting.popleft()
            r = self.tidx_list[i]
            rows = bank.decode(r) if flat is None else bank.row_start(r)
            dw.admit(i, rows, self.prompt_list[i], self.n_out_list[i], kv[i])
            self.records[i].t_admit = now
            if events is not None:
                events.append((now, "admit", i, d))

    def plan(self, dw: DecodeWorker, d: int) -> None:
        """Times and Σ_l D_l of decoder ``d``'s next steps while its running set stays as
        it is: from this step to the first one at which a request finishes, at most
        ``PLAN_STEPS`` of them (an admission may change the set sooner; the rest of the
        plan is then dropped).

        The hot path: one gather of the plan's rows from the flat slab (request j's row
        of step t is ``offs[j] + t``), else np.array of the row views; the union of each
        step is an OR-reduce over the running requests, Σ_l D_l one popcount sum. The
        step times are :meth:`StepModel.decode_step_time`'s sum, term by term in the
        same order, in float64 arrays: the same bits as the scalar formula."""
        s, B, sm = dw.step, len(dw.ids), self.sm
        if B == 0:
            dw.plan_distinct, dw.plan_dt = [0], [sm.decode_step_time(0, 0, 0)]
            return
        m = min(min(dw.ends) - s + 1, PLAN_STEPS)
        steps = self.step_range[:m] + s  # (m,) int64 step indices
        if self.flat is not None:
            idx = np.add.outer(np.array(dw.offs, dtype=np.int64), steps)  # (B, m)
            rows = self.flat.take(idx.ravel(), axis=0).reshape(B, m, -1)
        else:
            rows = np.array([b[s - s0:s - s0 + m] for b, s0 in
                             zip(dw.bits, dw.starts, strict=True)]).reshape(B, m, -1)
        u = np.bitwise_or.reduce(rows, axis=0)  # (m, L·W) union of each step's tokens
        masks = self.masks
        if masks is None:
            distinct = moe_distinct = np.bitwise_count(u).sum(axis=1, dtype=np.int64)
        else:
            mk = masks[d] if masks.shape[0] > 1 else masks[0]  # (ep, L, W)
            u = u.reshape(m, 1, *mk.shape[1:])
            per_rank = np.bitwise_count(u & mk).sum(axis=-1, dtype=np.int64)  # (m, ep, L)
            distinct = per_rank.sum(axis=(1, 2))  # Σ_l D_l
            moe_distinct = per_rank.max(axis=1).sum(axis=1)  # Σ_l max_r D_{l,r}
        ctx = (dw.prompt_sum - dw.start_sum) + B * steps  # Σ (prompt + tokens emitted so far)
        slide = 0
        if sm.sliding_window is not None:
            past = np.array(dw.prompts, dtype=np.int64) - np.array(dw.starts, dtype=np.int64)
            slide = np.minimum(np.add.outer(past, steps), sm.sliding_window).sum(axis=0)
        dt = sm.t_fixed + (self.moe_fixed + sm.b * moe_distinct)
        dt = dt + sm.dense_s
        dt = dt + ctx * sm.kv_s_per_token
        dt = dt + slide * sm.kv_sliding_s_per_token
        dw.plan_dt, dw.plan_distinct = dt[::-1].tolist(), distinct[::-1].tolist()


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
    (read only when the policy declares ``"profile"`` in its ``inputs``: ``eldr_cost``);
    placement: EP rank of every
    expert, (L, E) for one global layout or (num_decode, L, E) per decoder (``None``:
    contiguous blocks when ``ep > 1``); arrivals: explicit (times, trace index) instead of
    Poisson; tokens: a :class:`TokenBank` shared across runs (seeded by ``config.seed``
    otherwise); encoder: the fitted SignatureEncoder, needed when
    ``config.signature_source`` is ``fresh`` or ``sigcache`` (:mod:`eldr.sim.signatures`).
    ``record_events`` keeps a log of (time, event, request, worker).

    The policy hears ``choose(req, loads)`` and ``on_dispatch(req, d)`` when a request's
    prefill ends (``req.request_id`` = its arrival index as a string, ``context_tokens`` =
    its prompt length; loads = requests in flight per decoder) and
    ``on_release(request_id, "completed")`` at its last token.
    """
    wall0 = time.perf_counter()
    masks = _check_inputs(trace, config, policy, signatures, decode_patterns, placement)
    sm = StepModel(config)
    bank = tokens if tokens is not None else TokenBank(trace, seed=config.seed)
    if bank.trace is not trace:
        raise ValueError("tokens: the TokenBank was built for another trace")
    t_arr, tidx, need_kv = _checked_arrivals(trace, config, sm, arrivals)
    N = t_arr.size
    online = None
    if config.signature_source != "trace":
        from eldr.sim.signatures import OnlineSignatures

        online = OnlineSignatures(trace, config.signature_source, encoder, config.num_prefill,
                                  config.prefix_cache_blocks)
    profile_of = None
    if profiles is not None and "profile" in getattr(policy, "inputs", ()):
        profile_of = profiles if callable(profiles) else profiles.__getitem__
    bar = Progress(N, f"simulate {policy.name} {config.qps:g} req/s",
                   enabled=None if progress else False)
    sim = Simulation(trace, config, policy, sm=sm, bank=bank, t_arr=t_arr, tidx=tidx,
                     need_kv=need_kv, masks=masks, signatures=signatures,
                     decode_patterns=decode_patterns, profile_of=profile_of, online=online,
                     record_events=record_events, bar=bar)
    with bar:
        sim.run()
    return _result(sim, config, policy, sm, wall0)


def _checked_arrivals(trace: Trace, config: SimConfig, sm: StepModel, arrivals
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times (N,), trace indices (N,), KV bytes each request needs (N,)) of the arrivals
    (Poisson from ``config`` when None), checked: indices within the trace, times in
    order, every request's KV within one decode worker."""
    if arrivals is None:
        arrivals = make_arrivals(config, trace.num_requests)
    t_arr = np.asarray(arrivals[0], dtype=np.float64)
    tidx = np.asarray(arrivals[1], dtype=np.int64)
    N = t_arr.size
    if tidx.shape != (N,) or (N and (tidx.min() < 0 or tidx.max() >= trace.num_requests)):
        raise ValueError("arrivals: trace indices must be (N,) and within the trace")
    if N > 1 and (np.diff(t_arr) < 0).any():
        raise ValueError("arrivals: times must be non-decreasing")
    need_kv = np.array([sm.model.kv_bytes(int(p + o)) for p, o in
                        zip(trace.prompt_lens[tidx], trace.output_lens[tidx], strict=True)])
    if N and need_kv.max() > sm.kv_capacity_bytes:
        i = int(np.argmax(need_kv))
        raise ValueError(f"request {i} needs {need_kv[i] / 1e9:.2f} GB of KV, more than a "
                         f"decode worker holds ({sm.kv_capacity_bytes / 1e9:.2f} GB)")
    return t_arr, tidx, need_kv


def _result(sim: Simulation, config: SimConfig, policy: Policy, sm: StepModel,
            wall0: float) -> SimResult:
    """The :class:`SimResult` of a finished simulation (``wall0``: its start)."""
    decoders = sim.decoders
    return SimResult(
        config=config,
        policy=policy.name,
        requests=Requests(sim.records),
        decoder_steps=np.array([dw.win_steps for dw in decoders], dtype=np.int64),
        decoder_batch_sum=np.array([dw.win_batch for dw in decoders], dtype=np.int64),
        decoder_distinct_sum=np.array([dw.win_distinct for dw in decoders], dtype=np.int64),
        num_layers=sm.num_layers,
        window_tokens=sim.window_tokens,
        total_steps=int(sum(dw.step for dw in decoders)),
        wall_s=time.perf_counter() - wall0,
        events=sim.events,
        num_fallbacks=int(policy.num_fallbacks),
    )
