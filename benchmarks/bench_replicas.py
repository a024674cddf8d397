"""Several router replicas over shared decoders: does the engines' footprint help? (prints)

Issue 13, item 6. R router replicas (R = 1, 2, 4) each receive a random 1/R of one Poisson
request stream and route it over the same K decoders. Every replica sees the decoders'
loads as a router with ``--scrape-interval`` does: the engines' running count at the last
scrape plus its own dispatches and completions since (other replicas' since then are
invisible). Three routings, each on the same arrivals (common random numbers):

- ``jsq``: least loaded;
- ``cost own``: ``eldr_cost`` on its own share of each decoder's footprint only (today's
  router without engine data);
- ``cost blend``: ``eldr_cost`` with each decoder's engine footprint blended in at every
  scrape (``min(S_own, 1 − f)``, :mod:`eldr.routing.engine_rows`), and, with the online
  memory, its memory term taken from the same reading (``S̄_d = 1 − f``, shared by every
  replica): the policy as shipped;
- ``blend own-mem``: the same blend with each replica's memory term kept its own (the
  policy before the memory term was derived from the engine reading), for comparison;
- ``cost shared`` (a diagnostic, not something the router does): the same blend, but
  with the product of the *predicted* profiles of every request in flight at the decoder
  (all replicas') at the scrape instead of the engine's measured footprint; it separates
  "the replicas lack each other's share" from "the measured footprint is a different
  signal than the predicted one".

Requests are the shipped tiny-MoE trace's (``eldr.capture.tiny_moe_trace_path()``: L = 6,
E = 64, k = 4, 10 domains), drawn with replacement: a request's profile (what the router
routes on) is its prefill counts / prompt tokens (``prefill_profile``), its decode tokens'
real top-k ids (``decode_topk``) are what the decoder's batch selects at each step. A
decode step advances every decoder's batch by one token per request; a request leaves
after its decode tokens. Each decoder's engine keeps the plugin's own
:class:`~eldr.capture.decode.Footprint` (a ring of the last ``--window`` steps), and at each
scrape its reading goes through the wire format (``encode_engine_footprint`` →
``decode_engine_footprint``) into every replica's policy, valid for 3 scrape intervals.

Reported per routing, after a warm-up, mean over seeds: the distinct experts per layer of
one decode step (mean over decoder-steps with a non-empty batch; what a step streams) and
the load imbalance (mean over steps of max / mean batch size). Ratios are against JSQ, and
blend against own and against ``blend own-mem``, in the same run. Nothing is tuned for any
cost variant: all run ``CostPolicy``'s defaults (``--memory`` aside).

Run: ``python benchmarks/bench_replicas.py [--decoders 4] [--batch 8 16] [--steps 2000]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from eldr.capture import tiny_moe_trace_path
from eldr.capture.decode import Footprint, decode_engine_footprint, encode_engine_footprint
from eldr.routing import CostPolicy, RouteRequest, make_policy, prefill_profile
from eldr.traces.trace import load

STEP_S = 0.025  # seconds per decode step (the policies' clock; only ratios matter)
ROUTINGS = ("jsq", "cost own", "blend own-mem", "cost blend", "cost shared")


class _Requests:
    """The trace's requests: profiles (R, L, E) and per-request decode top-k ids."""

    def __init__(self) -> None:
        tr = load(tiny_moe_trace_path())
        m = tr.meta
        self.L, self.E = m.num_layers, m.num_experts
        self.profiles = np.stack([prefill_profile(tr.prefill_counts[r], int(tr.prompt_lens[r]),
                                                  m.top_k) for r in range(tr.num_requests)])
        off = tr.decode_offsets
        self.decode = [tr.decode_topk[off[r]:off[r + 1]] for r in range(tr.num_requests)]
        keep = np.array([len(d) > 0 for d in self.decode])
        self.index = np.flatnonzero(keep)  # requests with decode tokens
        self.mean_len = float(np.mean([len(self.decode[r]) for r in self.index]))


def _policy(name: str, K: int, reqs: _Requests, clock, options: dict):
    if name == "jsq":
        return make_policy("jsq", num_workers=K)
    pol = CostPolicy(K, num_layers=reqs.L, num_experts=reqs.E, clock=clock, **options)
    if name == "blend own-mem":  # the memory term from this replica's dispatches only
        fp = pol.footprint
        fp.added_typical = lambda p: fp.typical_miss @ p.reshape(-1)
    return pol


def run(reqs: _Requests, *, K: int, R: int, batch: float, steps: int, scrape: int,
        window: int, seed: int, warmup: int, options: dict | None = None
        ) -> dict[str, tuple[float, float, float]]:
    """{routing: (distinct experts per layer per decode step, the same weighted by the
    step's tokens, load imbalance)} for one seed; ``options``: CostPolicy keywords."""
    options = options or {}
    rng = np.random.default_rng(seed)
    rate = K * batch / reqs.mean_len  # arrivals per step so that Little gives `batch`
    arrivals = rng.poisson(rate, steps)
    picks = rng.choice(reqs.index, int(arrivals.sum()))
    replica_of = rng.integers(0, R, picks.size)
    out = {}
    for routing in ROUTINGS:
        out[routing] = _simulate(reqs, routing, K=K, R=R, arrivals=arrivals, picks=picks,
                                 replica_of=replica_of, scrape=scrape, window=window,
                                 warmup=warmup, options=options)
    return out


def _simulate(reqs, routing, *, K, R, arrivals, picks, replica_of, scrape, window, warmup,
              options):
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731  (the policies' time: simulated seconds)
    policies = [_policy(routing, K, reqs, clock, options) for _ in range(R)]
    blend = routing in ("cost blend", "blend own-mem")
    shared = routing == "cost shared"
    engines = [Footprint(window, reqs.L, reqs.E) for _ in range(K)]
    running: list[list[list]] = [[] for _ in range(K)]  # per decoder: [rid, req, pos, rep]
    reported = np.zeros((R, K))  # engine loads at the last scrape, per replica
    delta = np.zeros((R, K))  # own dispatches - completions since
    distinct_sum = distinct_n = token_sum = token_n = imbalance_sum = imbalance_n = 0.0
    nxt = 0
    for t, n_new in enumerate(arrivals):
        now[0] = t * STEP_S
        if t % scrape == 0:  # every replica reads every engine
            true = np.array([len(b) for b in running], float)
            reported[:] = true
            delta[:] = 0.0
            if blend:
                for k, fp in enumerate(engines):
                    read = decode_engine_footprint(encode_engine_footprint(fp, now[0]),
                                                   reqs.L, reqs.E, now=now[0])
                    for pol in policies:
                        pol.observe_engine(k, read.freq, read.age, 3 * scrape * STEP_S)
            if shared:  # diagnostic: the replicas' predicted footprints, pooled
                for k, b in enumerate(running):
                    miss = np.prod([1.0 - np.minimum(reqs.profiles[r], 1 - 1e-6)
                                    for _, r, _, _ in b], axis=0) if b else 1.0
                    for pol in policies:
                        pol.observe_engine(k, np.broadcast_to(1.0 - miss, (reqs.L, reqs.E)),
                                           0.0, 3 * scrape * STEP_S)
        for _ in range(n_new):
            r, rep = int(picks[nxt]), int(replica_of[nxt])
            rid = f"q{nxt}"
            nxt += 1
            request = RouteRequest(rid, profile=reqs.profiles[r])
            loads = np.maximum(reported[rep] + delta[rep], 0.0)
            k = policies[rep].choose(request, loads)
            policies[rep].on_dispatch(request, k)
            delta[rep, k] += 1
            running[k].append([rid, r, 0, rep])
        sizes = np.array([len(b) for b in running], float)
        if t >= warmup and sizes.sum() > 0:
            imbalance_sum += sizes.max() / sizes.mean()
            imbalance_n += 1
        for k, b in enumerate(running):  # one decode step of every decoder
            if not b:
                continue
            ids = np.stack([reqs.decode[r][pos] for _, r, pos, _ in b])  # (T, L, k)
            engines[k].push(ids)
            if t >= warmup:
                seen = np.zeros((reqs.L, reqs.E), bool)
                seen[np.arange(reqs.L)[None, :, None], ids] = True
                d = seen.sum() / reqs.L
                distinct_sum += d
                distinct_n += 1
                token_sum += d * len(b)
                token_n += len(b)
            keep = []
            for item in b:
                item[2] += 1
                if item[2] < len(reqs.decode[item[1]]):
                    keep.append(item)
                else:
                    policies[item[3]].on_release(item[0], "completed")
                    delta[item[3], k] -= 1
            running[k] = keep
    return (distinct_sum / max(distinct_n, 1), token_sum / max(token_n, 1),
            imbalance_sum / max(imbalance_n, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=float, nargs="+", default=[8.0, 16.0],
                    help="mean requests in flight per decoder (sets the arrival rate)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--scrape", type=int, default=20, help="decode steps between scrapes")
    ap.add_argument("--window", type=int, default=32, help="engine footprint steps")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--memory", type=float, default=None,
                    help="CostPolicy memory half-life (default: the policy's own, 4; 0: "
                         "no per-replica memory of what each decoder was sent)")
    args = ap.parse_args()
    reqs = _Requests()
    options = {} if args.memory is None else {"memory": args.memory}
    print(f"tiny-MoE trace: {reqs.index.size} requests, L={reqs.L} E={reqs.E}, mean decode "
          f"{reqs.mean_len:.1f} tokens; K={args.decoders} decoders, scrape every "
          f"{args.scrape} steps, engine window {args.window} steps, {args.steps} steps "
          f"({args.warmup} warm-up), {args.seeds} seeds, eldr_cost "
          f"{options or 'defaults'}")
    print("D: distinct experts per layer per decode step; D_tok: the same per decode "
          "token (weighted by batch size: what a token waits for); imb: mean max/mean batch")
    print(f"{'batch':>5} {'R':>2}  " + "  ".join(f"{r:>22}" for r in ROUTINGS)
          + "   D_tok ratios: own/jsq own-mem/jsq blend/jsq blend/own blend/own-mem "
          "[min..max over seeds] shared/own")
    print(f"{'':>8}  " + "  ".join(f"{'D  D_tok   imb':>22}" for _ in ROUTINGS))
    for batch in args.batch:
        for R in args.replicas:
            runs = [run(reqs, K=args.decoders, R=R, batch=batch, steps=args.steps,
                        scrape=args.scrape, window=args.window, seed=s, warmup=args.warmup,
                        options=options)
                    for s in range(args.seeds)]
            mean = {r: np.mean([x[r] for x in runs], axis=0) for r in ROUTINGS}
            tok = {r: np.array([x[r][1] for x in runs]) for r in ROUTINGS}
            cells = "  ".join(f"{m[0]:6.2f} {m[1]:6.2f} {m[2]:5.2f}" for m in
                              (mean[r] for r in ROUTINGS))
            blend_own = np.mean(tok["cost blend"] / tok["cost own"])
            blend_old = tok["cost blend"] / tok["blend own-mem"]
            shared_own = np.mean(tok["cost shared"] / tok["cost own"])
            print(f"{batch:5.0f} {R:2d}  {cells}   {np.mean(tok['cost own'] / tok['jsq']):7.3f} "
                  f"{np.mean(tok['blend own-mem'] / tok['jsq']):11.3f} "
                  f"{np.mean(tok['cost blend'] / tok['jsq']):9.3f} {blend_own:9.3f} "
                  f"{blend_old.mean():13.3f} [{blend_old.min():.3f}..{blend_old.max():.3f}] "
                  f"{shared_own:10.3f}")


if __name__ == "__main__":
    main()
