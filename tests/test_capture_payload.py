import base64
import io
import json
import zlib

import numpy as np
import pytest

from eldr.capture.payload import (
    MAX_PAYLOAD_CHARS,
    PAYLOAD_KEY,
    decode_block_counts,
    decode_counts,
    decode_payload,
    decode_routed_experts,
    encode_counts,
    encode_payload,
    topk_to_counts,
)


def _npy_b64(arr):
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=arr.dtype == object)
    return base64.b64encode(buf.getvalue()).decode()


def test_round_trip_exact_and_uint16():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 500, size=(6, 64))
    obj = encode_counts(counts)
    assert obj["v"] == 1 and obj["shape"] == [6, 64] and obj["dtype"] == "uint16"
    out = decode_counts(obj, num_layers=6, num_experts=64)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, counts)


def test_large_counts_use_uint32():
    counts = np.array([[70000, 0], [1, 2]])
    obj = encode_counts(counts)
    assert obj["dtype"] == "uint32"
    np.testing.assert_array_equal(decode_counts(obj, num_layers=2, num_experts=2), counts)


def test_block_rows_round_trip():
    rows = np.arange(3 * 2 * 4).reshape(3, 2, 4)
    out = decode_block_counts(encode_counts(rows), num_layers=2, num_experts=4)
    np.testing.assert_array_equal(out, rows)
    empty = decode_block_counts(encode_counts(np.zeros((0, 2, 4), int)),
                                num_layers=2, num_experts=4)
    assert empty.shape == (0, 2, 4)


def test_payload_is_kilobytes_for_a_big_model():
    # Qwen3-30B-A3B-sized: 48 layers x 128 experts, a 2k-token prompt with top-8.
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(128, size=8, replace=False) for _ in range(2048 * 48)])
    counts = topk_to_counts(ids.reshape(2048, 48, 8), 128)
    import json
    assert len(json.dumps({PAYLOAD_KEY: encode_counts(counts)})) < 16 * 1024


def test_topk_to_counts_hand_computed():
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]])  # (T=2, L=2, k=2)
    np.testing.assert_array_equal(topk_to_counts(ids, 4), [[1, 2, 1, 0], [1, 0, 1, 2]])
    with pytest.raises(ValueError, match="out of range"):
        topk_to_counts(ids, 3)
    with pytest.raises(ValueError, match="tokens, layers, top_k"):
        topk_to_counts(ids[0], 4)


def test_encode_refuses_bad_counts():
    with pytest.raises(ValueError, match="negative"):
        encode_counts(np.array([[1, -1]]))
    with pytest.raises(ValueError, match="integers"):
        encode_counts(np.array([[1.5]]))
    with pytest.raises(ValueError, match="shape"):
        encode_counts(np.array([1, 2]))


def _good():
    return encode_counts(np.ones((2, 4), dtype=np.int64))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda o: "not a dict", "JSON object"),
        (lambda o: {k: v for k, v in o.items() if k != "data"}, "missing"),
        (lambda o: {**o, "v": 3}, "version"),
        (lambda o: {**o, "v": True}, "version"),
        (lambda o: {**o, "shape": [2, -4]}, "shape"),
        (lambda o: {**o, "shape": [2, 4.0]}, "shape"),
        (lambda o: {**o, "shape": [4, 2]}, "expected"),
        (lambda o: {**o, "shape": [1 << 20, 1 << 20]}, "too large"),
        (lambda o: {**o, "dtype": "int8"}, "dtype"),
        (lambda o: {**o, "dtype": "uint32"}, "bytes"),
        (lambda o: {**o, "data": "!!!"}, "base64"),
        (lambda o: {**o, "data": 5}, "base64 string"),
        (lambda o: {**o, "data": base64.b64encode(b"nozlib").decode()}, "zlib"),
        (lambda o: {**o, "data": base64.b64encode(zlib.compress(b"\0" * 15)).decode()},
         "bytes"),
        (lambda o: {**o, "data": base64.b64encode(zlib.compress(b"\0" * 17)).decode()},
         "bytes"),
    ],
)
def test_decode_refuses_malformed(mutate, match):
    with pytest.raises(ValueError, match=match):
        decode_counts(mutate(_good()), num_layers=2, num_experts=4)


def test_decode_refuses_decompression_bomb_cheaply():
    bomb = base64.b64encode(zlib.compress(b"\0" * (64 << 20))).decode()
    with pytest.raises(ValueError, match="bytes"):
        decode_counts({"v": 1, "shape": [2, 4], "dtype": "uint16", "data": bomb},
                      num_layers=2, num_experts=4)


def test_block_decode_refuses_2d():
    with pytest.raises(ValueError, match=r"\[B, 2, 4\]"):
        decode_block_counts(_good(), num_layers=2, num_experts=4)


def test_decode_routed_experts():
    ids = np.arange(5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2) % 8
    out = decode_routed_experts(_npy_b64(ids))
    assert out.dtype == np.int32 and out.shape == (5, 3, 2)
    np.testing.assert_array_equal(out, ids)
    counts = topk_to_counts(out, 8)
    assert (counts.sum(axis=1) == 5 * 2).all()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3, "base64 string"),
        ("@@", "base64"),
        (base64.b64encode(b"not npy").decode(), "npy"),
        (_npy_b64(np.zeros((2, 3, 1))), "integers"),
        (_npy_b64(np.zeros((2, 3), dtype=np.int32)), "tokens, layers, top_k"),
        (_npy_b64(-np.ones((1, 1, 1), dtype=np.int32)), "negative"),
        (_npy_b64(np.array([None, 1], dtype=object)), "npy"),
    ],
)
def test_decode_routed_experts_refuses(value, match):
    with pytest.raises(ValueError, match=match):
        decode_routed_experts(value)


# -- version 2 ---------------------------------------------------------------------------------
def _counts(n_tokens, L=4, E=16, k=2, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n_tokens, L, E)), axis=2)[:, :, :k]
    return topk_to_counts(ids, E)


@pytest.mark.parametrize("tokens, enc, width", [
    (3, "sparse", 1),  # 6 selections a layer: (expert, count) pairs are shorter
    (40, "dense", 1), (2000, "dense", 2), (None, "dense", 3)])
def test_v2_round_trip_picks_the_shorter_layout(tokens, enc, width):
    counts = _counts(tokens) if tokens else np.full((4, 16), 9000)
    tokens = tokens or 9000
    obj = encode_payload(counts, tokens=tokens)
    assert obj["v"] == 2 and obj["shape"] == [4, 16] and obj["enc"] == enc
    assert obj["w"] == width
    got = decode_payload(json.loads(json.dumps(obj)), num_layers=4, num_experts=16)
    assert got.tokens == tokens and got.layers is None and got.counts.dtype == np.int32
    np.testing.assert_array_equal(got.counts, counts)
    np.testing.assert_array_equal(decode_counts(obj, num_layers=4, num_experts=16), counts)
    # the bound every count was checked against: the largest dense count, the tokens sparse
    assert got.count_bound == (counts.max() if enc == "dense" else tokens)
    assert got.count_bound >= counts.max()


def test_v2_sparse_layout_is_expert_count_pairs_per_layer():
    counts = np.zeros((2, 100), dtype=np.int64)
    counts[0, [3, 97]] = [5, 1]
    counts[1, 50] = 6
    obj = encode_payload(counts, tokens=6)
    assert obj["enc"] == "sparse" and obj["w"] == 2  # ids up to 99 need two digits
    # [nnz per layer] [expert ids] [counts]: 2, 1 | 3, 97, 50 | 5, 1, 6
    from eldr.capture.digits import decode_digits
    assert decode_digits(obj["data"], 2).tolist() == [2, 1, 3, 97, 50, 5, 1, 6]
    np.testing.assert_array_equal(
        decode_payload(obj, num_layers=2, num_experts=100).counts, counts)


def test_v2_layer_mask_sends_only_those_rows():
    counts = _counts(300, L=6)
    full = encode_payload(counts, tokens=300)
    masked = encode_payload(counts, tokens=300, layers=[1, 4])
    assert masked["layers"] == [1, 4] and len(masked["data"]) * 3 == len(full["data"])
    got = decode_payload(masked, num_layers=6, num_experts=16)
    assert got.layers.tolist() == [1, 4]
    np.testing.assert_array_equal(got.counts[[1, 4]], counts[[1, 4]])
    assert not got.counts[[0, 2, 3, 5]].any()
    np.testing.assert_array_equal(got.rows_counts, counts[[1, 4]])  # the rows as sent
    assert decode_payload(full, num_layers=6, num_experts=16).rows_counts is None
    for bad in ([4, 1], [1, 1], [6], [], [1.0], "1"):
        with pytest.raises(ValueError, match="layers"):
            encode_payload(counts, layers=bad)


def test_v1_payloads_still_decode():
    counts = _counts(50)
    got = decode_payload({**encode_counts(counts), "tokens": 50}, num_layers=4, num_experts=16)
    assert got.tokens == 50 and got.layers is None
    assert got.count_bound is None  # version 1 never checks its counts against its tokens
    np.testing.assert_array_equal(got.counts, counts)
    blocks = decode_payload(encode_counts(np.stack([counts, counts])), num_layers=4,
                            num_experts=16)
    np.testing.assert_array_equal(blocks.counts, 2 * counts)


def _v2():
    obj = encode_payload(_counts(2000), tokens=2000)
    assert obj["enc"] == "dense" and obj["w"] == 2  # 4 x 16 x 2 characters
    return obj


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda o: {**o, "data": o["data"][:-1]}, "characters"),  # truncated
    (lambda o: {**o, "data": o["data"][:-2]}, "characters"),
    (lambda o: {**o, "data": o["data"] + "##"}, "characters"),  # one value too many
    (lambda o: {**o, "data": "#" * (MAX_PAYLOAD_CHARS + 2)}, "limit"),  # oversized
    (lambda o: {**o, "v": 3}, "version"),
    (lambda o: {**o, "v": "2"}, "version"),
    (lambda o: {**o, "v": 2.0}, "version"),
    (lambda o: {**o, "v": True}, "version"),
    (lambda o: {**o, "tokens": float("nan")}, "tokens"),
    (lambda o: {**o, "tokens": -1}, "tokens"),
    (lambda o: {**o, "tokens": 1}, "over 1"),  # counts above the tokens counted
    (lambda o: {**o, "shape": [4, float("nan")]}, "shape"),
    (lambda o: {**o, "shape": [16, 4]}, "shape"),
    (lambda o: {**o, "shape": [4, 16, 1]}, "shape"),
    (lambda o: {**o, "w": 4}, "w must"),
    (lambda o: {**o, "w": float("nan")}, "w must"),
    (lambda o: {**o, "enc": "rle"}, "enc"),
    (lambda o: {**o, "data": None}, "string"),
    (lambda o: {**o, "data": "\\" * len(o["data"])}, "alphabet"),
    (lambda o: {**o, "data": "é" * len(o["data"])}, "ASCII"),
    (lambda o: {**o, "layers": [0, 7]}, "layers"),
    (lambda o: {**o, "layers": [0, 1]}, "characters"),  # 2 rows declared, 4 sent
    (lambda o: [o], "JSON object"),
])
def test_v2_decode_refuses_malformed(mutate, match):
    with pytest.raises(ValueError, match=match):
        decode_payload(mutate(_v2()), num_layers=4, num_experts=16)


def _sparse():
    counts = np.zeros((2, 100), dtype=np.int64)
    counts[0, [3, 97]] = [5, 1]
    counts[1, 50] = 6
    return encode_payload(counts, tokens=6)


@pytest.mark.parametrize(("values", "match"), [
    ([2, 1, 3, 97, 50, 5, 1], "expected"),  # a count missing
    ([2, 1, 97, 3, 50, 5, 1, 6], "increase"),  # ids out of order
    ([2, 1, 3, 3, 50, 5, 1, 6], "increase"),  # a duplicate expert
    ([2, 1, 3, 100, 50, 5, 1, 6], "out of range"),
    ([2, 1, 3, 97, 50, 5, 0, 6], "count"),  # zero pairs are not sent
    ([2, 1, 3, 97, 50, 5, 1, 7], "over 6"),
    ([101, 0], "more than"),
    ([1], "fewer"),
])
def test_v2_sparse_decode_refuses_malformed(values, match):
    from eldr.capture.digits import encode_digits
    obj = {**_sparse(), "data": encode_digits(np.array(values), 2)}
    with pytest.raises(ValueError, match=match):
        decode_payload(obj, num_layers=2, num_experts=100)


def test_v2_is_smaller_than_v1_for_a_big_model():
    rng = np.random.default_rng(1)
    logw = np.log(rng.gamma(0.5, size=(48, 128)))
    ids = np.argsort(-(logw[None] + rng.gumbel(size=(2048, 48, 128))), axis=2)[:, :, :8]
    counts = topk_to_counts(ids, 128)
    v1 = len(json.dumps(encode_counts(counts)))
    v2 = len(json.dumps(encode_payload(counts, tokens=2048)))
    masked = len(json.dumps(encode_payload(counts, tokens=2048, layers=list(range(0, 48, 3)))))
    assert v2 < 13_000 and masked < 4_600 and masked < v1 / 2
