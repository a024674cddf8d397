"""The report's "Routing before prefill": the prompt predictor beside the prefill signature
(issue 23; docs/fit-and-routing.md, "The prompt predictor").

Measured on the shipped tiny-MoE capture that keeps its prompt token ids
(:func:`eldr.capture.tiny_moe_prompt_trace_path`), never on a synthetic trace: those draw
token ids uniformly, so a predictor that reads the prompt has nothing to learn there.

1. Held-out quality (:func:`eldr.fit.prompt_eval.evaluate_prompt_predictor`, seed
   ``plan.seed``, half fitted, half held out): for the predicted signature, the real
   prefill signature and the raw TF-IDF of the prompt's tokens, ρ against the decode
   patterns and the distinct experts per layer of one decode step when the held-out
   requests are grouped into 8 decoders by each, against round robin; R² of the
   predicted prefill profile.
2. TPOT in the simulator on the tiny-MoE CPU preset (as the report's tiny-MoE section:
   a third of the trace calibrates, ``plan.tiny_num_prefill`` P ``plan.tiny_num_decode``
   D, ``plan.tiny_warmup_s`` + ``plan.prompt_duration_s``, seed ``plan.seed``, every
   rate of ``plan.prompt_rates``): the policy whose report role is flagged
   ``before_prefill`` (``eldr_cost``) on the prefill signature and profile, the same
   policy on the ones predicted from the prompt (:func:`eldr.sim.signatures.prompt_inputs`,
   predictor fitted on the calibration split), and the ``reference`` balancer (JSQ), on
   the same arrivals (:func:`section_policies`).

The predictor's hyper-parameters are fixed (:data:`PREDICTOR_OPTIONS`, what ``eldr
score``'s full cross-validated grid picks on this trace) so that the section costs seconds,
not the minute of the grid search.
"""

from __future__ import annotations

import time

from eldr.capture import tiny_moe_prompt_trace_path
from eldr.fit.prompt import PromptPredictor
from eldr.fit.prompt_eval import SOURCES, evaluate_prompt_predictor
from eldr.reproduce.plan import Plan
from eldr.reproduce.setup import fit_setup
from eldr.routing.registry import report_flagged
from eldr.sim import SimConfig, simulate
from eldr.sim.signatures import prompt_inputs
from eldr.sim.steptime import routing_resources
from eldr.traces.trace import Trace, load

__all__ = ["NUM_GROUPS", "PREDICTOR_OPTIONS", "before_prefill", "section_policies"]

# 2**17 hashed buckets of token uni- and bigrams, rank 64, ridge 0.01: the choice of
# PromptPredictor's default 3-fold grid on the shipped prompt trace (eldr score); 2 folds
# because one grid point leaves the cross-validation nothing to choose
PREDICTOR_OPTIONS = {"bits": (17,), "weightings": ("token",), "ranks": (64,),
                     "alphas": (0.01,), "folds": 2}
NUM_GROUPS = 8  # decoders the held-out half is grouped into for routed locality
PROMPT = "@prompt"  # suffix of the column of a policy routed on the prompt's prediction


def section_policies() -> tuple[str, str, str]:
    """The TPOT table's columns: the reference balancer, the before-prefill policy, and
    that policy on the prompt's prediction (``name@prompt``), from the registry's report
    flags ``reference`` and ``before_prefill``."""
    (lb,), (policy,) = report_flagged("reference"), report_flagged("before_prefill")
    return lb, policy, policy + PROMPT


def before_prefill(plan: Plan, trace: Trace | None = None) -> dict | None:
    """The section's figures for ``plan`` (None when ``plan.prompt_rates`` is empty).

    ``trace``: a captured trace with prompt token ids (default: the shipped prompt trace).
    Returns ``{"quality": [one row per routing input: source, rho, distinct, reduction],
    "round_robin", "r2", "num_fit", "num_heldout", "tpot": [one row per rate: qps and the
    median TPOT in ms of each of :func:`section_policies`, prompt_gap_pct = the policy on
    the prediction vs on the prefill signature, in % of the latter, cost_wins = the policy
    on the prefill signature is faster than the balancer], "seconds"}``.
    """
    if not plan.prompt_rates:
        return None
    t0 = time.perf_counter()
    trace = load(tiny_moe_prompt_trace_path()) if trace is None else trace
    if trace.prompt_token_ids is None or trace.meta.source.startswith("synthetic"):
        raise ValueError(f"routing before prefill needs a captured trace with prompt token "
                         f"ids, got {trace.meta.source} "
                         f"{'without' if trace.prompt_token_ids is None else 'with'} ids")
    ev = evaluate_prompt_predictor(trace, heldout=0.5, num_groups=NUM_GROUPS,
                                   predictor_options=PREDICTOR_OPTIONS,
                                   random_state=plan.seed)
    quality = [{"source": s, "rho": float(ev.rho[s]),
                "distinct": float(ev.locality[s].clustered),
                "reduction_pct": 100.0 * float(ev.locality[s].reduction)} for s in SOURCES]
    out = {"quality": quality, "round_robin": float(ev.locality["prompt"].round_robin),
           "r2": float(ev.r2), "num_fit": ev.num_fit, "num_heldout": ev.num_heldout,
           "tpot": _tpot_rows(plan, trace)}
    out["seconds"] = time.perf_counter() - t0
    return out


def _tpot_rows(plan: Plan, trace: Trace) -> list[dict]:
    """Median TPOT (ms) of each of :func:`section_policies` at every rate of
    ``plan.prompt_rates``."""
    setup = fit_setup(trace, "tiny_moe", calib_requests=trace.num_requests // 3,
                      seed=plan.seed, selection_max_pairs=None, max_pairs=None)
    # the vocabulary the predictor is used on: the held-out prompts may hold ids the
    # calibration split never saw; its source ``calibration`` hashes them, not refuses them
    vocab = int(max(setup.calib.prompt_token_ids.max(), setup.eval.prompt_token_ids.max())) + 1
    pred = PromptPredictor(random_state=plan.seed, **PREDICTOR_OPTIONS).fit(
        setup.calib, vocab_size=vocab, vocab_source="calibration")
    cal = setup.calibration
    signatures, profiles = prompt_inputs(setup.eval, setup.encoder, pred,
                                         profile_alpha=cal.profile_alpha,
                                         profile_mean=cal.profile_mean)
    K = plan.tiny_num_decode
    lb, policy, on_prompt = columns = section_policies()
    rows = []
    for qps in plan.prompt_rates:
        cfg = SimConfig(model="tiny-moe", hardware="cpu", num_prefill=plan.tiny_num_prefill,
                        num_decode=K, qps=float(qps), warmup_s=plan.tiny_warmup_s,
                        duration_s=plan.prompt_duration_s, seed=plan.seed)
        row: dict = {"qps": float(qps)}
        for name in columns:
            pol = setup.policy(name.removesuffix(PROMPT), K, tau=plan.tau, seed=plan.seed,
                               **routing_resources(cfg))
            inputs = setup.inputs(pol, patterns=False)
            if name == on_prompt:
                if "signatures" in inputs:
                    inputs["signatures"] = signatures
                if "profiles" in inputs:
                    inputs["profiles"] = profiles
            res = simulate(setup.eval, cfg, pol, tokens=setup.tokens, **inputs)
            row[name] = float(res.summary()["tpot_median_ms"])
        row["prompt_gap_pct"] = 100.0 * (row[on_prompt] / row[policy] - 1.0)
        row["cost_wins"] = bool(row[policy] < row[lb])
        rows.append(row)
    return rows

