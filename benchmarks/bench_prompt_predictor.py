"""Benchmark the prompt predictor (issue 23; docs/fit-and-routing.md, "The prompt predictor").

1. Held-out quality on a CAPTURED trace (synthetic traces draw token ids uniformly, so a
   prompt predictor has nothing to learn there: they are refused). The trace is split in
   two (seeded); the signature encoder and the predictor are fitted on one half; on the
   other half, for the predicted signature (``prompt``), the real prefill signature
   (``prefill``) and the raw TF-IDF of the prompt's tokens (``tfidf``): ρ against decode
   patterns, and routed locality: the held-out requests grouped into ``--groups``
   decoders by balanced K-means on each signature, the expected distinct experts per layer
   of one decode step of each decoder's batch, against round robin (random balanced
   splits) (:mod:`eldr.fit.prompt_eval`). R² of the predicted prefill profile.
2. Size: the ``prompt.npz`` an artifact fitted on the whole trace gains, and the largest a
   48 × 128 predictor may be (the fit's 24 MiB budget; the table and basis are half floats).
3. Prediction cost: ``PromptPredictor.predict`` for a 48 × 128 top-8 model and a
   2,048-token prompt (ids from a 151,936-token vocabulary, Qwen3's), p50 / p99 over
   ``--calls`` calls after warm-up, at (bits, rank) = (16, 32), (18, 32) and the largest
   rank within budget at 2**18 buckets (44), for the tf/token path (one gather of the
   n-grams' rows) and the tfidf path (which aggregates repeated n-grams first), each by
   the numpy kernel and the compiled one (numba, when installed; :mod:`eldr.fit.prompt_kernel`); and
   ``route_inputs_from_prompt`` (prediction + signature + cost-policy profile) at (16, 32);
   then the three steps over memory that bound a prediction, each alone (hashing, the
   gather and sum of the n-grams' rows, the basis product) of the numpy kernel. Wall clock
   and this thread's CPU time: on a shared machine the wall clock's p99 is mostly waiting.
4. ``--simulate``: the simulator on the tiny-MoE CPU preset (docs/simulator.md, the
   comparison there: 8 prefill and 4 decode workers, 10 s warm-up + 60 s): ``eldr`` and
   ``eldr_cost`` routed on the prefill signature/profile and on the prompt predictions
   (:func:`eldr.sim.signatures.prompt_inputs`), and jsq, p2c, round_robin, at ``--qps``,
   seeds ``--seeds``; means over seeds of the median TPOT.

Run: ``python benchmarks/bench_prompt_predictor.py [--trace T.npz] [--simulate]``; the
default trace is the shipped tiny-MoE prompt trace (``tiny_moe_prompts.npz``, a capture that
kept its prompt token ids, docs/capture.md); ``--skip-quality`` runs the cost section alone.

``--baseline-kernel FILE``: another version of ``eldr/fit/prompt_kernel.py`` (e.g. ``git show
HEAD~1:src/eldr/fit/prompt_kernel.py > /tmp/kernel.py``), loaded beside this tree's and timed
against it on the tfidf and token paths in ``--blocks`` alternating blocks of 300 calls
(this thread's CPU time; one after the other, the machine's drift between the halves is
larger than the effects measured here): p50 / p99 of each and the per-block ratio, for one
prompt repeated and for 256 prompts in turn.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from eldr.fit.prompt import PromptPredictor


def quality(trace, args) -> None:
    from eldr.fit.prompt_eval import evaluate_prompt_predictor

    t0 = time.perf_counter()
    ev = evaluate_prompt_predictor(trace, heldout=args.heldout, num_groups=args.groups,
                                   random_state=args.seed)
    p = ev.predictor
    print(f"\n1. held-out quality: fitted on {ev.num_fit}, evaluated on {ev.num_heldout} "
          f"requests, {args.groups} decoders ({time.perf_counter() - t0:.1f} s)")
    print(f"   predictor chosen by 3-fold CV on the fit half: 2**{p.bits_} buckets, "
          f"{p.weighting_}, rank {p.rank_}, alpha {p.alpha_:g} (CV R^2 {p.cv_r2_:.3f}, fit "
          f"{p.fit_seconds_:.1f} s)")
    print(f"   R^2 of the predicted prefill profile: {ev.r2:.3f}")
    rr = next(iter(ev.locality.values())).round_robin
    print(f"   {'routing input':<22} {'rho':>7} {'distinct/layer/step':>20} "
          f"{'vs round robin':>15}")
    names = {"prompt": "prompt predictor", "prefill": "prefill signature",
             "tfidf": "token TF-IDF"}
    for key, name in names.items():
        loc = ev.locality[key]
        print(f"   {name:<22} {ev.rho[key]:7.3f} {loc.clustered:20.2f} "
              f"{-100 * loc.reduction:+14.1f}%")
    print(f"   {'round robin':<22} {'':>7} {rr:20.2f}")


def size(trace, args) -> None:
    from eldr.fit import artifact

    tok = None
    if trace.meta.model == "tiny_moe":
        from eldr.capture import tiny_moe_dir

        tok = tiny_moe_dir()
    art = artifact.fit_artifact(trace, worker_ids=[f"d{i}" for i in range(4)],
                                tokenizer=tok, random_state=args.seed)
    with tempfile.TemporaryDirectory() as d:
        out = artifact.save(art, os.path.join(d, "art"))
        added = os.path.getsize(out / "prompt.npz")
        rest = os.path.getsize(out / "arrays.npz") + os.path.getsize(out / "artifact.json")
    p = art.prompt_predictor
    rank = _largest_rank(18, 48 * 128)
    largest = PromptPredictor()._size(18, rank, 48 * 128)
    print(f"\n2. artifact size: the whole-trace fit chose 2**{p.bits_} buckets, rank "
          f"{p.rank_}: prompt.npz adds {added / 2**20:.2f} MiB to {rest / 2**20:.3f} MiB; a "
          f"48x128 predictor is at most {largest / 2**20:.1f} MiB (2**18 x rank {rank}, the "
          f"fit's {PromptPredictor().max_bytes / 2**20:.0f} MiB budget)")


def _largest_rank(bits: int, num_targets: int) -> int:
    """The largest rank whose predictor fits the fit's default byte budget."""
    p = PromptPredictor()
    rank = 1
    while p._size(bits, rank + 1, num_targets) <= p.max_bytes:
        rank += 1
    return rank


def _random_predictor(bits: int, rank: int, L: int, E: int, k: int, vocab: int,
                      rng) -> PromptPredictor:
    doc = {"hash": "mul64-unigram-bigram-v1", "num_layers": L, "num_experts": E,
           "top_k": k, "vocab_size": vocab, "tokenizer_fingerprint": "", "bits": bits,
           "weighting": "tfidf", "rank": rank, "alpha": 0.1}
    mean = rng.dirichlet(np.ones(E), size=L).astype(np.float32) * k
    basis = rng.standard_normal((rank, L, E)).astype(np.float32)
    basis -= basis.mean(axis=2, keepdims=True)
    arrays = {"idf": (1 + rng.random(1 << bits)).astype(np.float32),
              "weights": (0.01 * rng.standard_normal((1 << bits, rank))).astype(np.float32),
              "basis": basis.reshape(rank, L * E), "mean": mean.reshape(-1)}
    return PromptPredictor.from_state(doc, arrays)


def _percentiles(fn, calls: int) -> str:
    """p50 / p99 of wall clock and of this thread's CPU time (µs) over ``calls`` calls:
    on a shared machine the wall clock also counts time spent waiting for a core."""
    for _ in range(min(200, calls)):
        fn()
    wall, cpu = np.empty(calls), np.empty(calls)
    for i in range(calls):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        cpu[i], wall[i] = time.thread_time_ns() - c0, time.perf_counter_ns() - t0
    w50, w99, c50, c99 = (float(np.percentile(x, q) / 1e3) for x in (wall, cpu)
                          for q in (50, 99))
    return (f"p50 {w50:7.1f} us, p99 {w99:8.1f} us wall; CPU p50 {c50:7.1f} us, "
            f"p99 {c99:8.1f} us")


def cost(args) -> None:
    from eldr.fit.artifact import RoutingArtifact
    from eldr.fit.signature import SignatureEncoder

    L, E, k, vocab, P = 48, 128, 8, 151_936, 2048
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, vocab, P)
    print(f"\n3. prediction cost, {L}x{E} top-{k}, a {P}-token prompt, {args.calls} calls "
          "(wall clock, after 200 warm-up calls)")
    from eldr.fit.prompt import compiled_kernels

    kernels = ["numpy"] + (["compiled"] if compiled_kernels() is not None else [])
    if len(kernels) == 1:
        print("   (numba is not installed: the numpy kernel only)")
    for bits, rank in ((16, 32), (18, 32), (18, _largest_rank(18, L * E))):
        p = _random_predictor(bits, rank, L, E, k, vocab, rng)
        for weighting in ("token", "tfidf"):  # tf predicts exactly as token does
            p.weighting_ = weighting
            for kernel in kernels:
                figs = _percentiles(lambda p=p, k=kernel: p.predict(ids, kernel=k),
                                    args.calls)
                print(f"   predict, 2**{bits} x rank {rank} ({p.nbytes / 2**20:4.1f} MiB), "
                      f"{'tf/token' if weighting == 'token' else weighting:<8} "
                      f"{kernel:<8}: {figs}")
    # the figures above repeat ONE prompt, so the rows it reads stay in the cache; a router
    # sees different prompts, whose rows come from memory: 256 prompts in turn
    prompts = [rng.integers(0, vocab, P) for _ in range(256)]
    for bits, weighting in ((16, "token"), (16, "tfidf"), (18, "token")):
        p = _random_predictor(bits, 32, L, E, k, vocab, rng)
        p.weighting_ = weighting
        for kernel in kernels:
            turn = itertools.cycle(prompts)
            figs = _percentiles(lambda p=p, k=kernel, t=turn: p.predict(next(t), kernel=k),
                                args.calls)
            name = "tf/token" if weighting == "token" else weighting
            print(f"   predict, 2**{bits} x rank 32, {name:<8}, 256 prompts in turn, "
                  f"{kernel:<8}: {figs}")
    p = _random_predictor(16, 32, L, E, k, vocab, rng)
    enc = SignatureEncoder.from_state({
        "representation": "count_idf", "num_layers": L, "num_experts": E,
        "layers": list(range(0, L, 3)), "idf": rng.random((L, E)), "rho": 0.5})
    art = RoutingArtifact(model="bench", num_layers=L, num_experts=E, top_k=k, encoder=enc,
                          centroids=np.eye(4, 16 * E, dtype=np.float32),
                          worker_ids=("a", "b", "c", "d"), tau=0.1, profile_alpha=0.2,
                          profile_mean=np.full((L, E), k / E, dtype=np.float32),
                          prompt_predictor=p)
    p.weighting_ = "token"
    figs = _percentiles(lambda: art.route_inputs_from_prompt(ids), args.calls)
    print(f"   route_inputs_from_prompt, 2**16 x 32 token, 16-layer mask ({kernels[-1]}): "
          f"{figs}")
    short = ids[:256]
    for kernel in kernels:
        figs = _percentiles(lambda k=kernel: p.predict(short, kernel=k), args.calls)
        print(f"   predict, a 256-token prompt, 2**16 x 32 token, {kernel:<8}: {figs}")
    _floor(p, ids, args.calls)


def _floor(p: PromptPredictor, ids: np.ndarray, calls: int) -> None:
    """What bounds a prediction (2**16 x 32, the 2,048-token prompt): its three steps
    over memory, each timed alone: hashing the 2P - 1 n-grams into buckets, gathering and
    summing one weight row per n-gram (np.take + a BLAS dot, from the float32 rows the
    numpy path widens once), and the basis product (rank x L·E, the basis widened once at
    load); the rest of predict is the id check and the clip (a few numpy calls)."""
    from eldr.fit.prompt import ngram_hashes

    shift = np.uint64(64 - p.bits_)
    rows = (ngram_hashes(ids) >> shift).astype(np.int64)
    ones = np.ones(rows.size, dtype=np.float32)
    table, basis = p._numpy_arrays()

    def gather():
        return ones @ np.take(table, rows, axis=0)

    z = gather()
    steps = {f"hash {rows.size} n-grams": lambda: ngram_hashes(ids) >> shift,
             f"gather+sum {rows.size} rows": gather,
             f"basis product {p.rank_}x{p.basis_.shape[1]}": lambda: z @ basis}
    for name, fn in steps.items():
        print(f"     step alone, {name:<26}: {_percentiles(fn, calls)}")
    from eldr.fit.prompt import compiled_kernels

    if compiled_kernels() is None:
        return
    # the compiled kernel's own three loops, each alone (numba compiles these private
    # helpers once more for a call from Python: a second or two, before the timing)
    from eldr.fit import prompt_kernel as kern

    ids64 = np.ascontiguousarray(ids, dtype=np.int64)
    shift, vocab = 64 - p.bits_, p.id_limit
    buckets, _ = kern._buckets(ids64, shift, vocab)
    z = kern._sum_rows(p._row_bits, buckets, None, buckets.size)
    scale = np.float32(p.weights_scale_) * np.float32(1.0 / ids64.size)
    steps = {f"hash {buckets.size} n-grams": lambda: kern._buckets(ids64, shift, vocab),
             f"gather+sum {buckets.size} rows": lambda: kern._sum_rows(
                 p._row_bits, buckets, None, buckets.size),
             f"basis product {p.rank_}x{p.basis_.shape[1]} + clip": lambda: kern._finish(
                 z, scale, p._basis_bits, p.mean_, p.num_layers, p.top_k)}
    for name, fn in steps.items():
        print(f"     compiled step alone, {name:<26}: {_percentiles(fn, calls)}")


def simulate(trace, args) -> None:
    from eldr.reproduce.setup import fit_setup
    from eldr.sim import SimConfig
    from eldr.sim import simulate as run
    from eldr.sim.signatures import prompt_inputs
    from eldr.sim.steptime import routing_resources

    baselines = ["jsq", "p2c", "round_robin"]
    rows: dict = {}
    t0 = time.perf_counter()
    for seed in args.seeds:
        setup = fit_setup(trace, "task", calib_requests=min(1000, trace.num_requests // 2),
                          seed=seed, selection_max_pairs=20_000, max_pairs=50_000)
        cal = setup.calibration
        # held-out ids the calibration never saw are hashed (source ``calibration``)
        vocab = int(max(setup.calib.prompt_token_ids.max(),
                        setup.eval.prompt_token_ids.max())) + 1
        pred = PromptPredictor(random_state=seed).fit(setup.calib, vocab_size=vocab,
                                                      vocab_source="calibration")
        sigs, profs = prompt_inputs(setup.eval, setup.encoder, pred,
                                    profile_alpha=cal.profile_alpha,
                                    profile_mean=cal.profile_mean)
        for qps in args.qps:
            cfg = SimConfig(model="tiny-moe", hardware="cpu", num_prefill=8, num_decode=4,
                            qps=qps, warmup_s=args.warmup, duration_s=args.duration,
                            seed=seed)
            for name in [*baselines, "eldr", "eldr_cost"]:
                variants = [None, (sigs, profs)] if name.startswith("eldr") else [None]
                for predicted in variants:
                    pol = setup.policy(name, 4, tau=0.1, seed=seed, **routing_resources(cfg))
                    inputs = setup.inputs(pol)
                    if predicted is not None:
                        if "signatures" in inputs:
                            inputs["signatures"] = predicted[0]
                        if "profiles" in inputs:
                            inputs["profiles"] = predicted[1]
                    res = run(setup.eval, cfg, pol, tokens=setup.tokens, **inputs)
                    key = name if predicted is None else f"{name}@prompt"
                    rows.setdefault((qps, key), []).append(res.summary()["tpot_median_ms"])
        print(f"   seed {seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n4. simulator, tiny-MoE CPU preset, 8 prefill / 4 decode, {args.warmup:g} s + "
          f"{args.duration:g} s, seeds {args.seeds}: median TPOT (ms), mean over seeds")
    keys = [*baselines, "eldr", "eldr@prompt", "eldr_cost", "eldr_cost@prompt"]
    print(f"   {'req/s':>6} " + " ".join(f"{k:>16}" for k in keys)
          + f" {'cost wins?':>11} {'prompt - prefill':>17}")
    for qps in args.qps:
        m = {k: float(np.mean(rows[(qps, k)])) for k in keys}
        best = min(m[b] for b in baselines)
        wins = m["eldr_cost"] < best
        gap = 100 * (m["eldr_cost@prompt"] - m["eldr_cost"]) / m["eldr_cost"]
        print(f"   {qps:>6g} " + " ".join(f"{m[k]:16.3f}" for k in keys)
              + f" {'yes' if wins else 'no':>11} {gap:+16.2f}%")


def _load_kernel(path: str):
    """The module at ``path`` (another version of :mod:`eldr.fit.prompt_kernel`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_prompt_kernel", path)
    module = importlib.util.module_from_spec(spec)
    # registered first: numba's on-disk cache names the module its kernels were compiled
    # in, and a module it cannot import again made the second run on one FILE fail
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def versus(args) -> None:
    """This tree's compiled tfidf kernel against ``--baseline-kernel``'s, alternating."""
    from eldr.fit import prompt as prompt_mod
    from eldr.fit.prompt import compiled_kernels

    ours = compiled_kernels()
    if ours is None:
        raise SystemExit("--baseline-kernel needs numba (pip install -e '.[serve]')")
    base = _load_kernel(args.baseline_kernel)
    L, E, k, vocab, P = 48, 128, 8, 151_936, 2048
    rng = np.random.default_rng(args.seed)
    p = _random_predictor(16, 32, L, E, k, vocab, rng)
    one = rng.integers(0, vocab, P)
    turn = [rng.integers(0, vocab, P) for _ in range(256)]
    counts = prompt_mod._bucket_counts(p.bits_)

    def call(kernel, ids, *extra):
        return kernel.predict_tfidf(ids, p._row_bits, np.float32(p.weights_scale_), p.idf_,
                                    64 - p.bits_, p.id_limit, p._basis_bits, p.mean_, L, k,
                                    *extra)

    def bag(kernel, ids):  # the tf / token models' kernel (token: per_token)
        return kernel.predict_bag(ids, p._row_bits, np.float32(p.weights_scale_),
                                  64 - p.bits_, p.id_limit, True, p._basis_bits, p.mean_, L,
                                  k)

    try:  # an older kernel took no scratch
        call(base, one, counts)
        base_extra = (counts,)
    except TypeError:
        base_extra = ()
    kernels = {"tfidf": {"baseline": lambda x: call(base, x, *base_extra),
                         "this tree": lambda x: call(ours, x, counts)},
               "token": {"baseline": lambda x: bag(base, x),
                         "this tree": lambda x: bag(ours, x)}}
    gap = max(float(np.abs(f["baseline"](one)[0] - f["this tree"](one)[0]).max())
              for f in kernels.values())
    print(f"\n5. tfidf and token kernels, this tree against {args.baseline_kernel}, 2**16 x "
          f"32, {L}x{E}, a {P}-token prompt, {args.blocks} alternating blocks of 300 calls "
          f"(CPU time); max |difference| of the two profiles {gap:.1e}")
    for model, mode in itertools.product(kernels, ("one prompt repeated",
                                                   "256 prompts in turn")):
        fns = kernels[model]
        med: dict[str, list] = {n: [] for n in fns}
        every: dict[str, list] = {n: [] for n in fns}
        for blk in range(args.blocks):
            for name, fn in fns.items():
                ts = np.empty(300)
                for i in range(300):
                    x = one if mode.startswith("one") else turn[(blk * 300 + i) % 256]
                    c0 = time.thread_time_ns()
                    fn(x)
                    ts[i] = time.thread_time_ns() - c0
                med[name].append(np.median(ts) / 1e3)
                every[name].append(ts)
        ratio = np.array(med["this tree"]) / np.array(med["baseline"])
        figs = ", ".join(f"{n} p50 {np.percentile(np.concatenate(v), 50) / 1e3:.1f} / p99 "
                         f"{np.percentile(np.concatenate(v), 99) / 1e3:.1f} us"
                         for n, v in every.items())
        print(f"   {model}, {mode}: {figs}; this tree / baseline per block: median "
              f"{np.median(ratio):.3f} (range {ratio.min():.2f}-{ratio.max():.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", help="a captured trace with prompt_token_ids (default: the "
                    "shipped tiny-MoE prompt trace)")
    ap.add_argument("--heldout", type=float, default=0.5)
    ap.add_argument("--groups", type=int, default=8, help="decoders for routed locality")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=5000, help="timed calls per cost figure")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--simulate", action="store_true", help="also run section 4")
    ap.add_argument("--qps", type=float, nargs="+", default=[40, 100, 160, 220, 260])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--baseline-kernel", metavar="FILE",
                    help="another prompt_kernel.py: its tfidf kernel timed against this "
                         "tree's, alternating (section 5)")
    ap.add_argument("--blocks", type=int, default=30, help="alternating blocks (section 5)")
    args = ap.parse_args()
    if not args.skip_quality or args.simulate:
        from eldr.traces.trace import load

        if args.trace is None:
            from eldr.capture import tiny_moe_prompt_trace_path

            args.trace = tiny_moe_prompt_trace_path()
        trace = load(args.trace)
        print(trace.describe())
        if trace.meta.source.startswith("synthetic"):
            raise SystemExit("synthetic traces draw token ids uniformly: a prompt predictor "
                             "cannot be evaluated on one; give a captured trace")
        if trace.prompt_token_ids is None:
            raise SystemExit(
                f"{args.trace} has no prompt_token_ids: use the shipped prompt trace (the "
                "default) or capture one, e.g. python "
                "scripts/prepare_tiny_moe_data.py ... then eldr capture --model tiny "
                "--prompts out/tinymoe_data/prompts.jsonl --max-new-tokens 64 "
                "--max-prompt-tokens 256 -o recap.npz, and pass --trace recap.npz")
    if not args.skip_quality:
        quality(trace, args)
        size(trace, args)
    if args.baseline_kernel:
        versus(args)
    else:
        cost(args)
    if args.simulate:
        simulate(trace, args)


if __name__ == "__main__":
    main()
