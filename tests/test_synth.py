"""Synthetic traces: calibration targets for every model x workload, determinism, validity."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eldr.fit.premises import calibration_report, format_report
from eldr.traces import synth
from eldr.traces.models import PRESETS
from eldr.traces.sampling import aggregate_counts, approx_gate_sums, inclusion_probs, token_topk
from eldr.traces.synth import DEFAULT_TRACE, SynthParams, default_trace, generate, get_params
from eldr.traces.trace import load, save
from eldr.traces.workloads import WORKLOADS, LengthDist

# Short lengths keep the token path fast in the tests that do not check calibration.
SHORT = replace(WORKLOADS["task"], prompt_len=LengthDist(24, 0.5, 4, 64),
                output_len=LengthDist(12, 0.5, 1, 32))


@pytest.mark.parametrize("workload", ["task", "language"])
@pytest.mark.parametrize("model", list(PRESETS))
def test_every_model_and_workload_meets_the_published_premises(model, workload):
    trace = generate(model, workload, num_requests=300, seed=5, keep_topk=False)
    rows = calibration_report(trace, rho_max_requests=300, rho_max_pairs=20_000)
    assert len(rows) == 4
    assert all(r.ok is True for r in rows), "\n" + format_report(rows)


@pytest.mark.slow
def test_token_path_meets_the_premises_too():
    trace = generate("qwen3-30b-a3b", "task", num_requests=120, seed=2, keep_topk=True)
    rows = calibration_report(trace, with_rho=False)
    assert rows[1].detail.endswith("decode_topk")
    assert all(r.ok is True for r in rows), "\n" + format_report(rows)


def _arrays(t):
    names = ("prefill_counts", "decode_counts", "prompt_lens", "output_lens", "domains",
             "prefill_gate_prob", "prefill_gate_logit", "prefill_topk", "decode_topk",
             "prompt_token_ids")
    return {n: getattr(t, n) for n in names if getattr(t, n) is not None}


@pytest.mark.parametrize("keep_topk", [True, False])
def test_same_seed_same_arrays_different_seed_different(keep_topk):
    a = generate("gpt-oss-120b", SHORT, num_requests=30, seed=7, keep_topk=keep_topk)
    b = generate("gpt-oss-120b", SHORT, num_requests=30, seed=7, keep_topk=keep_topk)
    c = generate("gpt-oss-120b", SHORT, num_requests=30, seed=8, keep_topk=keep_topk)
    arr_a, arr_b, arr_c = _arrays(a), _arrays(b), _arrays(c)
    assert arr_a.keys() == arr_b.keys()
    for name in arr_a:
        np.testing.assert_array_equal(arr_a[name], arr_b[name], err_msg=name)
    assert not np.array_equal(arr_a["decode_counts"], arr_c["decode_counts"])
    assert a.meta == b.meta and a.meta.source.endswith("seed=7")


@pytest.mark.parametrize("keep_topk", [True, False])
def test_without_gate_sums_every_other_array_is_the_same(keep_topk):
    full = generate("gpt-oss-120b", SHORT, num_requests=30, seed=7, keep_topk=keep_topk)
    bare = generate("gpt-oss-120b", SHORT, num_requests=30, seed=7, keep_topk=keep_topk,
                    gate_sums=False)
    assert bare.prefill_gate_prob is None and bare.prefill_gate_logit is None
    arr_full, arr_bare = _arrays(full), _arrays(bare)
    assert arr_full.keys() - arr_bare.keys() == {"prefill_gate_prob", "prefill_gate_logit"}
    for name in arr_bare:
        np.testing.assert_array_equal(arr_full[name], arr_bare[name], err_msg=name)


def test_approx_gate_sums_without_values_takes_the_same_draws():
    z = np.random.default_rng(0).standard_normal((70, 32))
    n = np.arange(70) + 1
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    approx_gate_sums(a, z, n, gate_scale=0.35)
    assert approx_gate_sums(b, z, n, gate_scale=0.35, values=False) == (None, None)
    assert a.bit_generator.state == b.bit_generator.state
    np.testing.assert_array_equal(a.random(5), b.random(5))



def test_token_path_counts_and_gates_are_consistent_with_the_topk(tmp_path):
    t = generate("qwen3-30b-a3b", SHORT, num_requests=40, seed=3, keep_topk=True)
    L, E, k = 48, 128, 8
    assert t.prefill_topk.dtype == np.int16 and t.decode_topk.shape == (
        int(t.decode_lens.sum()), L, k)
    off = t.prefill_offsets
    for r in (0, 17, 39):
        rows = t.prefill_topk[off[r]:off[r + 1]]
        for layer in (0, 47):
            np.testing.assert_array_equal(
                np.bincount(rows[:, layer].ravel(), minlength=E), t.prefill_counts[r, layer])
    doff = t.decode_offsets
    for r in (0, 39):
        rows = t.decode_topk[doff[r]:doff[r + 1]]
        np.testing.assert_array_equal(
            np.bincount(rows[:, 5].ravel(), minlength=E), t.decode_counts[r, 5])
    # each token's softmax sums to 1: summed gate probabilities = prompt tokens
    np.testing.assert_allclose(t.prefill_gate_prob.sum(axis=2),
                               np.broadcast_to(t.prompt_lens[:, None], (40, L)), rtol=1e-4)
    back = load(save(t, tmp_path / "t.npz"))
    for name, arr in _arrays(t).items():
        np.testing.assert_array_equal(getattr(back, name), arr, err_msg=name)


def test_count_path_gate_probabilities_sum_to_prompt_tokens_on_average():
    t = generate("qwen3-30b-a3b", SHORT, num_requests=60, seed=3, keep_topk=False)
    ratio = t.prefill_gate_prob.sum(axis=2) / t.prompt_lens[:, None]
    assert abs(ratio.mean() - 1.0) < 0.05
    assert t.prefill_topk is None and t.decode_topk is None
    assert t.prompt_token_ids.shape == (int(t.prompt_lens.sum()),)


def test_count_and_token_paths_share_the_routing_structure():
    a = generate("gemma-4-26b-a4b", SHORT, num_requests=80, seed=4, keep_topk=True)
    b = generate("gemma-4-26b-a4b", SHORT, num_requests=80, seed=4, keep_topk=False)
    np.testing.assert_array_equal(a.domains, b.domains)
    np.testing.assert_array_equal(a.prompt_lens, b.prompt_lens)
    pa = a.prefill_counts.sum(axis=0).ravel()
    pb = b.prefill_counts.sum(axis=0).ravel()
    assert np.corrcoef(pa, pb)[0, 1] > 0.95


def test_shared_system_prompts_share_token_ids_and_routing():
    t = generate("qwen3-30b-a3b", SHORT, num_requests=40, seed=1, keep_topk=True)
    off, bs = t.prefill_offsets, t.meta.block_size
    first_block = {}
    shared = 0
    for r in range(40):
        key = tuple(t.prompt_token_ids[off[r]:off[r] + bs])
        if key in first_block:
            q = first_block[key]
            shared += 1
            assert t.domains[q] == t.domains[r]
            np.testing.assert_array_equal(t.prefill_topk[off[r]:off[r] + bs],
                                          t.prefill_topk[off[q]:off[q] + bs])
        else:
            first_block[key] = r
    assert shared >= 5  # half the requests start with one of 8 system prompts


def test_stickiness_repeats_decode_selections():
    base = get_params("qwen3-30b-a3b", "task")
    sticky = replace(base, stickiness=0.6)
    t = generate("qwen3-30b-a3b", SHORT, num_requests=30, seed=1, keep_topk=True, params=sticky)
    d = t.decode_topk
    starts = set(t.decode_offsets[:-1].tolist())
    same = [np.array_equal(d[i], d[i - 1]) for i in range(1, len(d)) if i not in starts]
    # all 48 layers repeat only when every layer stuck: rare; compare one layer instead
    same_l0 = [np.array_equal(d[i, 0], d[i - 1, 0]) for i in range(1, len(d)) if i not in starts]
    assert 0.45 < np.mean(same_l0) < 0.75
    assert np.mean(same) < 0.1
    with pytest.raises(ValueError, match="keep_topk"):
        generate("qwen3-30b-a3b", SHORT, num_requests=5, keep_topk=False, params=sticky)


def test_trace_fields_and_metadata():
    t = generate("gpt-oss-120b", "language", num_requests=50, seed=0, keep_topk=False)
    assert t.meta.model == "gpt-oss-120b" and (t.meta.num_layers, t.meta.top_k) == (36, 4)
    assert t.meta.source == "synthetic:eldr-synth-v1:language:seed=0"
    assert t.domain_names == WORKLOADS["language"].domain_names
    assert (t.output_lens >= 1).all() and (t.prompt_lens >= 4).all()
    assert t.prefill_gate_logit.dtype == np.float32


def test_default_trace_is_generate_with_the_embedded_settings(monkeypatch):
    assert DEFAULT_TRACE["model"] in PRESETS and DEFAULT_TRACE["workload"] in WORKLOADS
    monkeypatch.setitem(synth.DEFAULT_TRACE, "num_requests", 15)
    a = default_trace()
    b = generate(DEFAULT_TRACE["model"], DEFAULT_TRACE["workload"], num_requests=15,
                 seed=DEFAULT_TRACE["seed"], keep_topk=DEFAULT_TRACE["keep_topk"])
    np.testing.assert_array_equal(a.decode_counts, b.decode_counts)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"num_requests": 0}, "num_requests"),
    ({"seed": -1}, "seed"),
])
def test_generate_input_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        generate("qwen3-30b-a3b", SHORT, **kw)


def test_unknown_model_and_bad_params():
    with pytest.raises(ValueError, match="valid names"):
        generate("mixtral", "task", num_requests=5)
    with pytest.raises(ValueError, match="decode_drift"):
        SynthParams(domain_strength=1.0, decode_drift=1.5)
    with pytest.raises(ValueError, match="stickiness"):
        SynthParams(domain_strength=1.0, decode_drift=0.5, stickiness=1.0)


# -- samplers ------------------------------------------------------------------------------
def test_inclusion_probs_sum_to_k_and_match_gumbel_topk():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 16)) * 1.5
    pi = inclusion_probs(z, 4)
    assert pi.sum() == pytest.approx(4.0)
    top, _, _ = token_topk(rng, np.repeat(z, 40_000, axis=0), 4, with_gates=False)
    freq = np.bincount(top.ravel(), minlength=16) / 40_000
    np.testing.assert_allclose(pi[0], freq, atol=0.03)


def test_token_topk_is_the_topk_of_the_returned_logits():
    rng = np.random.default_rng(1)
    top, h, p = token_topk(rng, rng.standard_normal((50, 12)), 3, with_gates=True,
                           gate_scale=0.4)
    np.testing.assert_array_equal(top, np.argsort(-h, axis=1)[:, :3])
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)
    assert len({tuple(sorted(row)) for row in top.tolist()}) > 1


def test_aggregate_counts_exact_sums_and_bounds():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((200, 32)) * 2
    n = rng.integers(0, 50, 200)
    n[:3] = [0, 1, 2]
    c = aggregate_counts(rng, inclusion_probs(z, 6), n, 6)
    assert c.dtype == np.int32
    np.testing.assert_array_equal(c.sum(axis=1), 6 * n)
    assert (c >= 0).all() and (c <= n[:, None]).all()


def test_approx_gate_sums_mean_matches_the_token_model():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((1, 64)) * 2
    _, _, p = token_topk(rng, np.repeat(z, 20_000, axis=0), 4, with_gates=True,
                         gate_scale=0.35)
    prob, logit = approx_gate_sums(rng, np.repeat(z, 200, axis=0), np.full(200, 100),
                                   gate_scale=0.35)
    np.testing.assert_allclose(prob.mean(axis=0) / 100, p.mean(axis=0), rtol=0.08, atol=1e-4)
    assert logit.shape == (200, 64)
    with pytest.raises(ValueError, match="gate_scale"):
        approx_gate_sums(rng, z, np.array([5]), gate_scale=1.0)


# -- the command ----------------------------------------------------------------------------
def test_eldr_synth_command_writes_a_trace_and_prints_the_premises(tmp_path, capsys):
    from eldr.cli import main

    out = tmp_path / "t.npz"
    rc = main(["synth", "--model", "gpt-oss-120b", "--workload", "language", "--requests",
               "40", "--seed", "3", "--no-topk", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "prefill-decode Pearson" in text and "0.70 ± 0.05" in text
    t = load(out)
    assert t.num_requests == 40 and t.meta.model == "gpt-oss-120b" and t.decode_topk is None


def test_eldr_synth_refuses_huge_topk_and_writes_the_default(tmp_path, capsys, monkeypatch):
    from eldr.cli import main

    assert main(["synth", "--requests", "20000", "-o", str(tmp_path / "x.npz")]) == 2
    assert "--no-topk" in capsys.readouterr().err
    monkeypatch.setitem(synth.DEFAULT_TRACE, "num_requests", 12)
    assert main(["synth", "--default", "--no-check", "-o", str(tmp_path / "d.npz")]) == 0
    assert load(tmp_path / "d.npz").meta.source.endswith(f"seed={DEFAULT_TRACE['seed']}")


@pytest.mark.parametrize("keep_topk", [True, False])
def test_explicit_lengths_are_used_exactly_and_leave_no_shared_prefix(keep_topk):
    prompt = np.array([0, 5, 33, 17], np.int64)
    output = np.array([1, 9, 2, 30], np.int64)
    t = generate("qwen3-30b-a3b", SHORT, seed=3, keep_topk=keep_topk, lengths=(prompt, output))
    np.testing.assert_array_equal(t.prompt_lens, prompt)
    np.testing.assert_array_equal(t.output_lens, output)
    k = t.meta.top_k
    L = t.meta.num_layers
    np.testing.assert_array_equal(t.prefill_counts.sum(axis=2),
                                  np.repeat(k * prompt[:, None], L, axis=1))
    np.testing.assert_array_equal(t.decode_counts.sum(axis=2),
                                  np.repeat(k * (output - 1)[:, None], L, axis=1))
    assert t.prompt_token_ids.shape == (int(prompt.sum()),)


def test_explicit_lengths_do_not_change_the_default_draws():
    a = generate("qwen3-30b-a3b", SHORT, num_requests=20, seed=4, keep_topk=False)
    b = generate("qwen3-30b-a3b", SHORT, num_requests=20, seed=4, keep_topk=False,
                 lengths=(a.prompt_lens * 0 + 3, a.output_lens))
    np.testing.assert_array_equal(a.domains, b.domains)  # same streams, only lengths differ


@pytest.mark.parametrize("lengths, match", [
    ((np.array([1, 2]), np.array([1])), "differ in shape"),
    ((np.array([1, -1]), np.array([1, 1])), "prompt_lens must be >= 0"),
    ((np.array([1, 1]), np.array([1, 0])), "output_lens must be >= 1"),
    ((np.array([1.5]), np.array([1])), "1-D integer array"),
    ((np.array([1]),), "a pair"),
])
def test_bad_explicit_lengths_are_refused(lengths, match):
    with pytest.raises(ValueError, match=match):
        generate("qwen3-30b-a3b", SHORT, seed=0, keep_topk=False, lengths=lengths)


def test_explicit_lengths_must_agree_with_num_requests():
    with pytest.raises(ValueError, match="num_requests=3 but lengths give 2"):
        generate("qwen3-30b-a3b", SHORT, num_requests=3, seed=0, keep_topk=False,
                 lengths=(np.array([4, 4]), np.array([2, 2])))
