import base64
import io
import zlib

import numpy as np
import pytest

from eldr.capture.payload import (
    PAYLOAD_KEY,
    decode_block_counts,
    decode_counts,
    decode_routed_experts,
    encode_counts,
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
        (lambda o: {**o, "v": 2}, "version"),
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
