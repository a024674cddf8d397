import json

import numpy as np
import pytest

from eldr.cli import main
from eldr.fit import artifact
from eldr.fit.artifact import RoutingArtifact, fit_artifact
from eldr.fit.signature import SignatureEncoder
from eldr.routing import RouteRequest, RoutingResources, make_policy
from eldr.traces.trace import Trace, TraceMeta
from eldr.traces.trace import save as save_trace

L, E, K_TOP = 3, 8, 2


def _trace(R=60, seed=0):
    """Two domains using disjoint halves of the experts; prefill and decode agree."""
    rng = np.random.default_rng(seed)
    dom = np.arange(R) % 2
    prompt = rng.integers(2, 6, R)
    out = rng.integers(2, 5, R)
    pre = np.zeros((R, L, E), dtype=np.int32)
    dec = np.zeros((R, L, E), dtype=np.int32)
    for r in range(R):
        for layer in range(L):
            base = 4 * dom[r]
            for counts, n in ((pre, prompt[r]), (dec, out[r] - 1)):
                for _ in range(n):
                    chosen = base + rng.choice(4, K_TOP, replace=False)
                    counts[r, layer, chosen] += 1
    return Trace(meta=TraceMeta("toy", L, E, K_TOP, source="test"), prefill_counts=pre,
                 decode_counts=dec, prompt_lens=prompt.astype(np.int64),
                 output_lens=out.astype(np.int64), domains=dom.astype(np.int32),
                 domain_names=("a", "b"))


@pytest.fixture(scope="module")
def fitted():
    return fit_artifact(_trace(), worker_ids=["w0", "w1"], tau=0.05, n_init=2,
                        random_state=0)


def test_fit_gives_one_unit_centroid_per_worker(fitted):
    assert fitted.centroids.shape == (2, fitted.layers.size * E)
    assert fitted.centroids.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(fitted.centroids, axis=1), 1.0, rtol=1e-6)
    assert sorted(fitted.fit_stats["cluster_sizes"]) == [30, 30]
    assert fitted.fit_stats["capacity"] == 30
    # the two domains land on different workers
    trace = _trace()
    sims = fitted.encoder.transform(trace) @ fitted.centroids.T
    chosen = sims.argmax(1)
    assert len({int(c) for c in chosen[trace.domains == 0]}) == 1
    assert chosen[0] != chosen[1]


def test_round_trip_preserves_everything(fitted, tmp_path):
    out = artifact.save(fitted, tmp_path / "art")
    back = artifact.load(out)
    assert isinstance(back, RoutingArtifact)
    assert (back.model, back.num_layers, back.num_experts, back.top_k) == ("toy", L, E, K_TOP)
    assert back.worker_ids == ("w0", "w1") and back.tau == 0.05 and back.balanced
    np.testing.assert_array_equal(back.centroids, fitted.centroids)
    np.testing.assert_array_equal(back.encoder.idf_, fitted.encoder.idf_)
    np.testing.assert_array_equal(back.layers, fitted.layers)
    assert back.rho == pytest.approx(fitted.rho)
    assert back.fit_stats == json.loads(json.dumps(fitted.fit_stats))
    trace = _trace(seed=1)
    np.testing.assert_array_equal(back.encoder.transform(trace), fitted.encoder.transform(trace))
    pol = make_policy("eldr", num_workers=2, centroids=back.centroids, tau=back.tau)
    s = back.encoder.transform(trace)[0]
    assert pol.choose(RouteRequest("r", s), np.zeros(2)) in (0, 1)
    # the cost policy's parts: predictor and cluster profiles, exact through the files
    assert back.profile_alpha == fitted.profile_alpha is not None
    np.testing.assert_array_equal(back.profile_mean, fitted.profile_mean)
    np.testing.assert_array_equal(back.decoder_profiles, fitted.decoder_profiles)
    assert back.decoder_profiles.shape == (2, L, E) and (back.decoder_profiles <= 0).all()
    res = RoutingResources.from_artifact(back, [1, 0])
    cost = make_policy("eldr_cost", num_workers=2, **res.as_kwargs())
    np.testing.assert_array_equal(cost.footprint.typical.reshape(2, L, E)[0],
                                  back.decoder_profiles[1])
    p = back.predict_profile(trace.prefill_counts[0], int(trace.prompt_lens[0]))
    assert p.shape == (L, E) and cost.choose(RouteRequest("r", profile=p), np.zeros(2)) in (0, 1)


def test_version_1_artifacts_without_cost_parts_still_load(fitted, tmp_path):
    import dataclasses

    old = dataclasses.replace(fitted, profile_alpha=None, profile_mean=None,
                              decoder_profiles=None)
    out = artifact.save(old, tmp_path / "art")
    _corrupt_json(out, lambda d: (d.update(version=1), d.pop("cost")))
    back = artifact.load(out)
    assert back.decoder_profiles is None and back.profile_alpha is None
    p = back.predict_profile(np.full((L, E), 2), 4)  # raw prefill profile: counts / tokens
    np.testing.assert_allclose(p, 0.5)


def test_save_replaces_an_artifact_but_not_other_directories(fitted, tmp_path):
    out = artifact.save(fitted, tmp_path / "art")
    artifact.save(fitted, out)  # replace in place
    assert sorted(p.name for p in out.iterdir()) == ["arrays.npz", "artifact.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an artifact directory"):
        artifact.save(fitted, other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_fingerprint_mismatch_is_refused_naming_both(fitted, tmp_path):
    out = artifact.save(fitted, tmp_path / "art")
    meta = TraceMeta("big", 48, 128, 8)
    with pytest.raises(ValueError, match=r"artifact is for L=3 E=8 k=2 \(toy\), trace has "
                                         r"L=48 E=128 k=8"):
        artifact.load(out, expect_model=meta)
    artifact.load(out, expect_model=_trace())  # a matching trace is fine


def test_worker_set_mismatch_is_refused(fitted):
    np.testing.assert_array_equal(fitted.check_workers(["w1", "w0"]), [1, 0])
    with pytest.raises(ValueError, match=r"missing \['w1'\], unknown \['w9'\]"):
        fitted.check_workers(["w0", "w9"])
    with pytest.raises(ValueError, match="not unique"):
        fitted.check_workers(["w0", "w0"])


def _corrupt_json(path, edit):
    doc = json.loads((path / "artifact.json").read_text())
    edit(doc)
    (path / "artifact.json").write_text(json.dumps(doc))


def _corrupt_arrays(path, **changes):
    with np.load(path / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays.update(changes)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path / "arrays.npz", **arrays)


@pytest.mark.parametrize("name, damage, match", [
    ("version", lambda p: _corrupt_json(p, lambda d: d.update(version=3)), "version 3"),
    ("format", lambda p: _corrupt_json(p, lambda d: d.update(format="x")), "not an eldr"),
    ("json", lambda p: (p / "artifact.json").write_text("{"), "not valid JSON"),
    ("no json", lambda p: (p / "artifact.json").unlink(), "no artifact.json"),
    ("no arrays", lambda p: (p / "arrays.npz").unlink(), "missing arrays.npz"),
    ("garbage arrays", lambda p: (p / "arrays.npz").write_bytes(b"junk"), "not a readable"),
    ("field", lambda p: _corrupt_json(p, lambda d: d["model"].pop("top_k")), "model.top_k"),
    ("cost alpha", lambda p: _corrupt_json(p, lambda d: d["cost"].update(alpha=2.0)),
     "alpha must be in"),
    ("cost missing", lambda p: _corrupt_json(p, lambda d: d.pop("cost")), "holds"),
    ("positive log", lambda p: _corrupt_arrays(
        p, decoder_profiles=np.ones((2, L, E), np.float32)), "decoder_profiles must be"),
    ("profile shape", lambda p: _corrupt_arrays(
        p, profile_mean=np.zeros((1, E), np.float32)), "profile_mean has shape"),
    ("half the cost parts", lambda p: _corrupt_arrays(p, profile_mean=None), "holds"),
    ("type", lambda p: _corrupt_json(p, lambda d: d["model"].update(num_layers="3")),
     "must be an integer"),
    ("tau", lambda p: _corrupt_json(p, lambda d: d["routing"].update(tau=-1)), "tau"),
    ("workers", lambda p: _corrupt_json(p, lambda d: d["routing"].update(worker_ids=["a"])),
     "expected"),
    ("dup workers",
     lambda p: _corrupt_json(p, lambda d: d["routing"].update(worker_ids=["a", "a"])),
     "not unique"),
    ("layers", lambda p: _corrupt_json(p, lambda d: d["signature"].update(layers=[0, 0, 9])),
     "expected|layers"),
    ("rep", lambda p: _corrupt_json(p, lambda d: d["signature"].update(representation="x")),
     "unknown representation"),
    ("nan", lambda p: _corrupt_arrays(p, centroids=np.full((2, 1), np.nan, np.float32)),
     "shape"),
    ("norm", lambda p: _corrupt_arrays(p, centroids=_scaled_centroids(p, 2.0)), "norm"),
    ("inf", lambda p: _corrupt_arrays(p, centroids=_scaled_centroids(p, 1.0, inf=True)),
     "NaN or Inf"),
    ("idf shape", lambda p: _corrupt_arrays(p, idf=np.ones((2, 2))), "idf has shape"),
    ("idf neg", lambda p: _corrupt_arrays(p, idf=-np.ones((L, E))), "idf"),
    ("extra", lambda p: _corrupt_arrays(p, extra=np.ones(2)), "holds"),
    ("pickle", lambda p: _corrupt_arrays(p, idf=np.array([{"a": 1}], dtype=object)),
     "not a readable|pickle|Object"),
])
def test_each_corruption_is_refused(fitted, tmp_path, name, damage, match):
    out = artifact.save(fitted, tmp_path / "art")
    damage(out)
    with pytest.raises(ValueError, match=match):
        artifact.load(out)


def _scaled_centroids(path, factor, inf=False):
    with np.load(path / "arrays.npz") as npz:
        c = (npz["centroids"] * np.float32(factor)).astype(np.float32)
    if inf:
        c[0, 0] = np.inf
    return c


def test_fit_validates_inputs():
    trace = _trace()
    with pytest.raises(ValueError, match="not unique"):
        fit_artifact(trace, worker_ids=["a", "a"])
    with pytest.raises(ValueError, match="tau"):
        fit_artifact(trace, worker_ids=["a", "b"], tau=float("nan"))
    with pytest.raises(ValueError, match="only 60 calibration"):
        fit_artifact(trace, worker_ids=[f"w{i}" for i in range(61)])


def test_vanilla_and_fixed_layers(tmp_path):
    art = fit_artifact(_trace(), worker_ids=["a", "b", "c"], layers=[1], balanced=False,
                       n_init=1)
    assert not art.balanced and art.layers.tolist() == [1]
    assert art.centroids.shape == (3, E)
    back = artifact.load(artifact.save(art, tmp_path / "v"))
    assert not back.balanced and isinstance(back.encoder, SignatureEncoder)


def test_without_decode_counts_the_fit_keeps_alpha_zero_and_the_prefill_profiles():
    """The learner's fit on a buffer without decode counts: the same recipe, every layer
    and no predictor."""
    from eldr.fit.predictor import decoder_profiles, prefill_profiles

    trace = _trace()
    art = fit_artifact(trace, worker_ids=["a", "b"], layers=range(L),
                       profile_predictor=False, n_init=1)
    assert art.profile_alpha == 0.0 and art.layers.tolist() == list(range(L))
    assert art.fit_stats["profile_predictor"]["alpha"] == 0.0
    pre = prefill_profiles(trace)
    np.testing.assert_array_equal(art.profile_mean, pre.mean(axis=0).astype(np.float32))
    labels = (art.encoder.transform(trace) @ art.centroids.T).argmax(axis=1)
    np.testing.assert_array_equal(art.decoder_profiles, decoder_profiles(pre, labels, 2))
    np.testing.assert_array_equal(art.predict_profile(trace.prefill_counts[3],
                                                      int(trace.prompt_lens[3])), pre[3])


def test_reproduce_and_eldr_fit_run_the_same_recipe():
    """``eldr reproduce``'s set-up and ``fit_artifact`` given the same settings fit the
    same encoder, centroids and cluster profiles."""
    from eldr.reproduce.setup import fit_split

    calib, ev = _trace(seed=0), _trace(seed=1)
    art = fit_artifact(calib, worker_ids=["a", "b"], selection_max_pairs=500, max_pairs=800,
                       random_state=3)
    st = fit_split(calib, ev, "toy", seed=3, selection_max_pairs=500, max_pairs=800)
    np.testing.assert_array_equal(st.encoder.layers_, art.layers)
    assert st.encoder.rho_ == art.rho
    np.testing.assert_array_equal(st.centroids(2), art.centroids)
    np.testing.assert_array_equal(st.decoder_profiles(2), art.decoder_profiles)
    assert st.predictor.alpha_ == art.profile_alpha


def test_the_reader_does_not_import_the_artifact_module_back():
    import ast
    import inspect

    from eldr.fit import _artifact_io

    tree = ast.parse(inspect.getsource(_artifact_io))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "eldr.fit.artifact" not in imported and "eldr.fit" not in imported


def test_fit_command_writes_a_loadable_artifact(tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_trace(_trace(), path)
    rc = main(["fit", str(path), "--workers", "x", "y", "--tau", "0.2", "--n-init", "1",
               "-o", str(tmp_path / "art")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rho = " in out and "N* = " in out and "cluster sizes [30, 30]" in out
    art = artifact.load(tmp_path / "art")
    assert art.worker_ids == ("x", "y") and art.tau == 0.2
    rc = main(["fit", str(path), "--decoders", "0", "-o", str(tmp_path / "bad")])
    assert rc == 2 and "--decoders must be >= 1" in capsys.readouterr().err


def test_the_fit_report_says_what_was_fitted_and_why_no_prompt_predictor(fitted):
    from dataclasses import replace

    trace = _trace()
    lines = artifact.fit_report(fitted, trace)
    assert lines[0].startswith(f"rho = {fitted.rho:.4f} (count_idf), N* = "
                               f"{fitted.layers.size} of {L} layers: ")
    assert lines[1].startswith("balanced K-means, K = 2: cluster sizes [30, 30]")
    assert lines[2].startswith("fit time ") and lines[2].endswith("tau = 0.05")
    assert lines[3] == "prompt predictor: not fitted (the trace has no prompt_token_ids)"
    assert len(artifact.fit_report(fitted, trace, prompt_predictor=False)) == 3
    ids = replace(trace, prompt_token_ids=np.ones(int(trace.prompt_lens.sum()), np.int32))
    assert "synthetic trace or fewer than 6 prompts" in artifact.fit_report(fitted, ids)[3]
    refused = replace(fitted, fit_stats={**fitted.fit_stats,
                                         "prompt_predictor": {"refused": "R^2 0.010 < 0.1"}})
    assert artifact.fit_report(refused, trace)[3].startswith(
        "prompt predictor: fitted but not kept (R^2 0.010 < 0.1)")


# -- issue 12: odd files are refused in one line, never block, never inflate ----------------
def _npy_header(shape, descr="<f4"):
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                               "shape": tuple(shape)})
    return buf.getvalue()


def _rezip(path, members):
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.mark.parametrize("name, damage, match", [
    ("deep json", lambda p: (p / "artifact.json").write_text('{"a":' + "[" * 50_000
                                                               + "]" * 50_000 + "}"),
     "nested too deeply"),
    ("rho_curve", lambda p: _corrupt_json(p, lambda d: d["signature"].update(
        rho_curve=[[1, {"x": 1}]])), "rho_curve must be"),
    ("rho_curve str", lambda p: _corrupt_json(p, lambda d: d["signature"].update(
        rho_curve="abc")), "rho_curve must be"),
    ("not npy", lambda p: _rezip(p / "arrays.npz", {"idf.npy": b"junk", "centroids.npy": b""}),
     "'idf' is not a .npy array"),
    ("txt member", lambda p: _rezip(p / "arrays.npz", {"idf.txt": b"junk"}),
     "'idf.txt' is not a .npy array"),
    ("huge shape", lambda p: _rezip(p / "arrays.npz", {
        "idf.npy": _npy_header((10**6, 10**6), "<f8"), "centroids.npy": b""}),
     r"idf has shape \(1000000, 1000000\)"),
    ("bomb", lambda p: _rezip(p / "arrays.npz", {
        "idf.npy": _npy_header((1 << 25,), "<f8") + bytes(1 << 28),
        "centroids.npy": _npy_header((2, 4))}), r"idf has shape \(33554432,\)"),
    ("fingerprint", lambda p: _corrupt_json(p, lambda d: d["model"].update(
        num_layers=10**9, num_experts=10**9)), "k > E|implausibly large|fingerprint"),
])
def test_odd_artifact_files_are_refused_in_one_line(fitted, tmp_path, name, damage, match):
    out = artifact.save(fitted, tmp_path / "art")
    if name in ("not npy", "huge shape", "bomb"):  # members of a version 1 artifact
        _corrupt_json(out, lambda d: d.pop("cost"))
    damage(out)
    with pytest.raises(ValueError, match=match) as info:
        artifact.load(out)
    assert "\n" not in str(info.value)


def test_a_fifo_artifact_json_is_refused_without_blocking(fitted, tmp_path):
    import os
    import threading

    out = artifact.save(fitted, tmp_path / "art")
    (out / "artifact.json").unlink()
    os.mkfifo(out / "artifact.json")
    result = {}

    def go():
        try:
            artifact.load(out)
        except ValueError as exc:
            result["error"] = str(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(5)
    if th.is_alive():
        with open(os.open(out / "artifact.json", os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        pytest.fail("load() blocked on a FIFO")
    assert "not a regular file" in result["error"]


def test_fuzzed_artifact_documents_load_or_fail_with_one_value_error(fitted, tmp_path_factory):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    out = artifact.save(fitted, tmp_path_factory.mktemp("fuzz") / "art")
    doc = json.loads((out / "artifact.json").read_text())
    paths = [(a, b) for a, v in doc.items() if isinstance(v, dict) for b in v]
    values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                          | st.text(max_size=5),
                          lambda c: st.lists(c, max_size=3)
                          | st.dictionaries(st.text(max_size=3), c, max_size=3),
                          max_leaves=8)

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(edits=st.lists(st.tuples(st.sampled_from(paths), values), min_size=1, max_size=3))
    def check(edits):
        mutated = json.loads(json.dumps(doc))
        for (a, b), value in edits:
            mutated[a][b] = value
        (out / "artifact.json").write_text(json.dumps(mutated))
        try:
            artifact.load(out)
        except ValueError as exc:
            assert "\n" not in str(exc)

    check()


def test_artifacts_without_a_prompt_predictor_section_still_load(fitted, tmp_path):
    """Version 2 artifacts written before the prompt predictor have no such key."""
    out = artifact.save(fitted, tmp_path / "art")
    doc = json.loads((out / "artifact.json").read_text())
    assert doc["version"] == 2 and doc["prompt_predictor"] is None
    del doc["prompt_predictor"]
    (out / "artifact.json").write_text(json.dumps(doc))
    back = artifact.load(out)
    assert back.prompt_predictor is None
    with pytest.raises(ValueError, match="no prompt predictor"):
        back.route_inputs_from_prompt([1, 2, 3])


def test_a_prompt_predictor_section_without_its_file_is_refused(fitted, tmp_path):
    out = artifact.save(fitted, tmp_path / "art")
    doc = json.loads((out / "artifact.json").read_text())
    doc["prompt_predictor"] = {"hash": "x"}
    (out / "artifact.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="made by another eldr"):
        artifact.load(out)
