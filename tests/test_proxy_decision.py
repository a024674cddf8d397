import base64
import dataclasses
import io

import numpy as np
import pytest

from _proxy_fakes import E, L, domain_counts, fake_centroids, fake_encoder, make_state
from eldr.capture.payload import encode_counts
from eldr.fit.artifact import RoutingArtifact
from eldr.fit.signature import SignatureEncoder
from eldr.proxy.config import ServeConfig
from eldr.proxy.request.decision import build_state
from eldr.proxy.request.signatures import read_inputs, read_signature, split_kv_params
from eldr.routing import Decision, LazyShapePolicy, RouteRequest

CFG = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1", "http://d:2"),
                  policy="eldr")


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_payload_counts_give_the_encoders_signature():
    state = make_state(CFG)
    counts = domain_counts("code")
    sig = read_signature({}, encode_counts(counts), state)
    assert sig.source == "payload" and sig.problem is None
    np.testing.assert_array_equal(sig.vector, fake_encoder().transform(counts))


@pytest.mark.parametrize("rep", ["count", "count_idf", "sqrt_count", "binary"])
def test_masked_encoding_equals_the_full_transform(rep):
    rng = np.random.default_rng(0)
    enc = SignatureEncoder.from_state({
        "representation": rep, "num_layers": 6, "num_experts": E, "layers": [1, 4],
        "idf": rng.uniform(0, 2, (6, E))})
    state = dataclasses.replace(make_state(CFG), encoder=enc, num_layers=6)
    counts = rng.integers(0, 5, (6, E))
    np.testing.assert_array_equal(state.encode(counts), enc.transform(counts))


@pytest.mark.parametrize("rep", ["count", "count_idf", "sqrt_count", "binary"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_direct_encoding_is_bit_identical_to_transform(rep, dtype):
    """The direct path for integer counts (48 x 128, a 16-layer mask) is transform's."""
    rng = np.random.default_rng(1)
    enc = SignatureEncoder.from_state({
        "representation": rep, "num_layers": 48, "num_experts": 128,
        "layers": np.sort(rng.choice(48, 16, replace=False)),
        "idf": rng.uniform(0.1, 2.0, (48, 128))})
    state = dataclasses.replace(make_state(CFG), encoder=enc, num_layers=48,
                                num_experts=128)
    for _ in range(5):
        counts = rng.multinomial(2048, np.full(128, 1 / 128), size=48).astype(dtype)
        got = state.encode(counts)
        assert got.dtype == np.float32 and got.shape == (16 * 128,)
        np.testing.assert_array_equal(got, enc.transform(counts))
    zero = np.zeros((48, 128), dtype=dtype)
    np.testing.assert_array_equal(state.encode(zero), enc.transform(zero))
    floats = rng.uniform(0, 3, (48, 128))  # not counts: the generic path
    np.testing.assert_array_equal(state.encode(floats), enc.transform(floats))
    if np.dtype(dtype).kind == "i":
        bad = counts.copy()
        bad[0, 0] = -1  # in any layer, masked or not, as transform checks
        with pytest.raises(ValueError, match="negative"):
            state.encode(bad)


def test_block_payload_is_summed():
    state = make_state(CFG)
    counts = domain_counts("code")
    blocks = np.stack([counts, 2 * counts])
    sig = read_signature({}, encode_counts(blocks), state)
    np.testing.assert_allclose(sig.vector, fake_encoder().transform(3 * counts))


def test_routed_experts_field_is_read_when_no_payload():
    state = make_state(CFG)
    ids = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]], dtype=np.int32)  # (T=2, L=2, k=2)
    doc = {"choices": [{"routed_experts": _npy_b64(ids)}]}
    sig = read_signature(doc, None, state)
    counts = np.zeros((L, E))
    counts[0, 0], counts[0, 1], counts[0, 2] = 2, 1, 1  # layer 0: experts 0,1 then 0,2
    counts[1, 2], counts[1, 3] = 2, 2  # layer 1: experts 2,3 twice
    assert sig.source == "routed_experts"
    np.testing.assert_allclose(sig.vector, fake_encoder().transform(counts))


@pytest.mark.parametrize("doc, payload, source, problem", [
    ({}, None, "none", "missing"),
    ({}, {"v": 1, "shape": [L, E], "dtype": "uint16", "data": "!!"}, "payload", "malformed"),
    ({}, encode_counts(np.ones((L + 1, E), dtype=np.int64)), "payload", "mismatch"),
    ({}, encode_counts(np.ones((3, L, E + 1), dtype=np.int64)), "payload", "mismatch"),
    ({}, {"v": 1, "shape": [L, E], "dtype": "uint8", "data": ""}, "payload", "malformed"),
    ({}, "not a dict", "payload", "malformed"),
    ({"choices": [{"routed_experts": "@@"}]}, None, "routed_experts", "malformed"),
    ({"choices": [{"routed_experts": _npy_b64(np.zeros((2, L + 1, 2), np.int32))}]}, None,
     "routed_experts", "mismatch"),
    ({"choices": [{"routed_experts": _npy_b64(np.full((2, L, 2), E, np.int32))}]}, None,
     "routed_experts", "malformed"),
])
def test_bad_or_missing_signature_is_a_fallback_never_an_error(doc, payload, source, problem):
    sig = read_signature(doc, payload, make_state(CFG))
    assert (sig.vector, sig.source, sig.problem) == (None, source, problem)


def test_gate_representation_cannot_use_counts():
    enc = SignatureEncoder.from_state({"representation": "gate_prob", "num_layers": L,
                                       "num_experts": E, "layers": np.arange(L),
                                       "idf": np.ones((L, E))})
    state = make_state(CFG, encoder=enc)
    sig = read_signature({}, encode_counts(domain_counts("x")), state)
    assert sig.problem == "unencodable"


def test_split_kv_params_strips_the_payload_only():
    doc = {"kv_transfer_params": {"remote_engine_id": "e", "eldr": {"v": 1}}}
    assert split_kv_params(doc) == ({"remote_engine_id": "e"}, {"v": 1})
    assert split_kv_params({"kv_transfer_params": None}) == (None, None)
    assert split_kv_params({"kv_transfer_params": {"a": 1}}) == ({"a": 1}, None)
    assert split_kv_params({"kv_transfer_params": {"eldr": 1}}) == (None, 1)


def test_inputs_follow_the_policys_declaration():
    counts = domain_counts("code")
    eldr = read_inputs({}, encode_counts(counts), make_state(CFG), 3)
    assert eldr.signature is not None and eldr.profile is None and eldr.context_tokens == 3
    cost_cfg = dataclasses.replace(CFG, policy="eldr_cost")
    cost = read_inputs({}, {**encode_counts(counts), "tokens": 2}, make_state(cost_cfg), 5)
    assert cost.signature is None and cost.context_tokens == 5
    np.testing.assert_allclose(cost.profile, np.minimum(counts / 2, 1.0))  # over counted
    jsq = read_inputs({}, encode_counts(counts), make_state(dataclasses.replace(
        CFG, policy="jsq")), None)
    assert jsq.problem == "not_used" and jsq.signature is None and jsq.profile is None


def test_profile_tokens_fall_back_to_row_sum_over_top_k():
    counts = domain_counts("code")  # every layer: 4 experts x 2 = 8 selections = 2 tokens
    cost = read_inputs({}, encode_counts(counts), make_state(dataclasses.replace(
        CFG, policy="eldr_cost")), None)
    assert cost.context_tokens == 2
    np.testing.assert_allclose(cost.profile, counts / 2)


def test_lazy_cost_policy_binds_to_the_first_valid_payload():
    cfg = dataclasses.replace(CFG, policy="eldr_cost")
    state = build_state(cfg)
    policy = state.policy
    assert isinstance(policy, LazyShapePolicy) and state.shape is None
    assert policy.decide(RouteRequest("a"), np.array([1.0, 0.0])) == Decision(1, fallback=True)
    policy.on_dispatch(RouteRequest("a"), 1)  # before binding: dropped
    bad = read_inputs({}, {"v": 1, "shape": [L, E], "dtype": "uint16", "data": "!!"},
                      state, 3)
    assert bad.profile is None and policy.inner is None and bad.problem == "malformed"
    good = read_inputs({}, {**encode_counts(domain_counts("code")), "tokens": 2}, state, 3)
    assert state.shape == (L, E) and good.profile.shape == (L, E)
    d = policy.decide(RouteRequest("b", profile=good.profile), np.zeros(2))
    assert not d.fallback and d.cost is not None and policy.num_fallbacks == 1
    policy.on_dispatch(RouteRequest("b", profile=good.profile), d.worker)
    assert len(policy.footprint) == 1
    policy.on_release("a", "completed")  # never held: a no-op
    policy.on_release("b", "completed")
    assert len(policy.footprint) == 0
    other = read_inputs({}, encode_counts(np.ones((L + 1, E), dtype=np.int64)), state, 3)
    assert other.problem == "mismatch" and other.profile is None


def test_build_state_without_artifact():
    cfg = ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1", "http://d:2"),
                      policy="jsq")
    state = build_state(cfg)
    assert state.worker_names == ("decode-0", "decode-1")
    assert state.encoder is None and not state.needs_signature
    with pytest.raises(ValueError, match="needs a routing artifact"):
        build_state(CFG)
    assert build_state(dataclasses.replace(cfg, policy="eldr_cost")).needs_profile


class _FakeArtifact:
    """The fields of RoutingArtifact the router reads."""

    predict_profile = RoutingArtifact.predict_profile
    num_workers = RoutingArtifact.num_workers

    def __init__(self, worker_ids):
        self.encoder = fake_encoder()
        self.centroids = fake_centroids()
        self.worker_ids = worker_ids
        self.tau = 0.25
        self.num_layers, self.num_experts, self.top_k = L, E, 4
        self.profile_alpha = self.profile_mean = self.decoder_profiles = None


@pytest.fixture
def fake_artifact_module(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("eldr.fit.artifact")
    mod.loaded = []

    def load(path):
        mod.loaded.append(path)
        return _FakeArtifact(("w-code", "w-other"))

    mod.load = load
    monkeypatch.setitem(sys.modules, "eldr.fit.artifact", mod)
    import eldr.fit

    monkeypatch.setattr(eldr.fit, "artifact", mod, raising=False)
    return mod


def test_build_state_maps_decoders_by_order_or_by_id(fake_artifact_module):
    urls = ("http://d:1", "http://d:2")
    by_order = build_state(ServeConfig(prefill_urls=("http://p:1",), decode_urls=urls,
                                       artifact="A", policy="eldr"))
    assert by_order.worker_names == ("w-code", "w-other") and by_order.tau == 0.25
    by_id = build_state(ServeConfig(prefill_urls=("http://p:1",), decode_urls=urls,
                                    decode_ids=("w-other", "w-code"), artifact="A",
                                    policy="eldr", tau=0.0))
    assert by_id.worker_names == ("w-other", "w-code") and by_id.tau == 0.0
    s = fake_encoder().transform(domain_counts("code"))
    assert by_order.policy.choose(RouteRequest("r", s), np.zeros(2)) == 0
    assert by_id.policy.choose(RouteRequest("r", s), np.zeros(2)) == 1  # rows permuted
    assert fake_artifact_module.loaded == ["A", "A"]


@pytest.mark.parametrize("kw, match", [
    ({"decode_urls": ("http://d:1",)}, "has 2 decode workers"),
    ({"decode_ids": ("w-code", "w-9")}, "do not match"),
])
def test_build_state_refuses_a_decoder_mismatch(fake_artifact_module, kw, match):
    base = {"prefill_urls": ("http://p:1",), "decode_urls": ("http://d:1", "http://d:2"),
            "artifact": "A", "policy": "eldr"}
    with pytest.raises(ValueError, match=match):
        build_state(ServeConfig(**{**base, **kw}))


def test_eldr_cost_takes_the_models_shape_from_the_artifact(fake_artifact_module):
    state = build_state(ServeConfig(prefill_urls=("http://p:1",),
                                    decode_urls=("http://d:1", "http://d:2"), artifact="A",
                                    policy="eldr_cost"))
    assert state.policy.name == "eldr_cost" and not isinstance(state.policy, LazyShapePolicy)
    assert state.policy.shape == (L, E) == state.shape and state.top_k == 4
    assert state.tau is None and state.worker_names == ("w-code", "w-other")


def test_load_slack_reaches_the_cost_policy_with_or_without_an_artifact(fake_artifact_module):
    lazy = build_state(dataclasses.replace(CFG, policy="eldr_cost", load_slack=0.1)).policy
    lazy.bind(L, E)
    assert lazy.inner.load_slack == 0.1
    fitted = build_state(ServeConfig(prefill_urls=("http://p:1",),
                                     decode_urls=("http://d:1", "http://d:2"), artifact="A",
                                     policy="eldr_cost", load_slack=0.25)).policy
    assert fitted.load_slack == 0.25
    assert build_state(dataclasses.replace(CFG, policy="eldr_cost")).policy.inner is None
    with pytest.raises(ValueError, match="load_slack"):
        ServeConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:1",),
                    load_slack=-1.0)


def test_lazy_cost_policy_takes_engine_footprints_once_bound():
    policy = build_state(dataclasses.replace(CFG, policy="eldr_cost")).policy
    freq = np.full((L, E), 0.5, np.float32)
    assert policy.engine_footprint_shape is None  # (L, E) unknown: nothing to check against
    assert policy.observe_engine(0, freq, 0.0, 2.0) is False
    policy.bind(L, E)
    assert policy.engine_footprint_shape == (L, E)
    assert policy.observe_engine(0, freq, 0.0, 2.0) is True
    assert policy.footprint.distinct[0] == pytest.approx(0.5 * L * E)


def test_a_cost_layer_stride_reaches_the_policy_and_cuts_the_profile(fake_artifact_module):
    """``--cost-layer-stride``: the policy prices rows 0, s, ...; the profile is read from
    those rows only, from a whole payload or one masked to them; a mask missing one of
    them is a mismatch (routed by load)."""
    from eldr.capture.payload import encode_payload

    lazy = build_state(dataclasses.replace(CFG, policy="eldr_cost", cost_layer_stride=2))
    assert lazy.policy.priced_layers is None  # not bound yet: (L, E) unknown
    counts = domain_counts("code")
    got = read_inputs({}, {**encode_counts(counts), "tokens": 2}, lazy, 3)
    assert lazy.policy.priced_layers.tolist() == [0]
    np.testing.assert_allclose(got.profile, np.minimum(counts[[0]] / 2, 1.0))
    state = build_state(ServeConfig(prefill_urls=("http://p:1",),
                                    decode_urls=("http://d:1", "http://d:2"), artifact="A",
                                    policy="eldr_cost", cost_layer_stride=2))
    assert state.policy.priced_layers.tolist() == [0] and state.shape == (L, E)
    masked = read_inputs({}, encode_payload(counts, tokens=2, layers=[0]), state, 3)
    assert masked.problem is None
    np.testing.assert_allclose(masked.profile, np.minimum(counts[[0]] / 2, 1.0))
    more = read_inputs({}, encode_payload(counts, tokens=2, layers=[0, 1]), state, 3)
    np.testing.assert_allclose(more.profile, masked.profile)  # a mask holding more rows
    wrong = read_inputs({}, encode_payload(counts, tokens=2, layers=[1]), state, 3)
    assert wrong.problem == "mismatch" and wrong.profile is None
    every = build_state(dataclasses.replace(CFG, policy="eldr_cost"))
    every.policy.bind(L, E)
    assert every.policy.priced_layers is None
    assert read_inputs({}, encode_payload(counts, tokens=2, layers=[0]), every,
                       3).problem == "mismatch"
    with pytest.raises(ValueError, match="cost_layer_stride"):
        dataclasses.replace(CFG, cost_layer_stride=0)
