import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.cache.hashing import (
    HASH_NBYTES,
    ROOT_HASH,
    block_hashes,
    hash_block_tokens,
)

# Regression pins of the documented v1 serialisation: if these change, every stored hash
# (and every router/engine pair running different versions) disagrees.
PIN_ROOT = "29ca3c296ef83219cf25de5a690125da5a353fa4fae952ee77f3584f41144db0"
PIN_1234 = "114110170cd2aabe4553ae68d1168c5b6ecc4c981e30b9e0f718d15945903733"
PIN_1234_KEYS = "b17ed5c03c6ce0abbf7a86d7725faa61b41a8605ab6d6300bceac61e027d8325"


def test_root_and_pinned_digests():
    assert ROOT_HASH.hex() == PIN_ROOT
    assert ROOT_HASH == hashlib.sha256(b"eldr.hashing/v1/root").digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == PIN_1234
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7, b"x")).hex() == PIN_1234_KEYS


def test_serialisation_matches_the_documented_format():
    """Rebuild the message byte by byte from the module docstring's description."""
    parent = hash_block_tokens(None, [9])
    msg = (
        parent
        + struct.pack("<Q", 3)
        + struct.pack("<3q", 5, 0, 70000)
        + struct.pack("<Q", 3)
        + b"i" + struct.pack("<q", -2)
        + b"s" + struct.pack("<Q", 2) + "é".encode()
        + b"b" + struct.pack("<Q", 1) + b"\x00"
    )
    got = hash_block_tokens(parent, np.array([5, 0, 70000], dtype=np.int32), (-2, "é", b"\0"))
    assert got == hashlib.sha256(msg).digest()
    no_keys = ROOT_HASH + struct.pack("<Q", 2) + struct.pack("<2q", 1, 2) + struct.pack("<Q", 0)
    assert hash_block_tokens(None, [1, 2]) == hashlib.sha256(no_keys).digest()


def test_hash_is_independent_of_input_container_and_dtype():
    ref = hash_block_tokens(None, [3, 1, 4])
    for tokens in ([3, 1, 4], (3, 1, 4), np.array([3, 1, 4], np.int16),
                   np.array([3, 1, 4], np.uint64), np.array([3, 1, 4], ">i8")):
        assert hash_block_tokens(None, tokens) == ref
    assert hash_block_tokens(None, [3, 1, 4], None) == hash_block_tokens(None, [3, 1, 4], ())
    assert hash_block_tokens(None, [1], (np.int64(5),)) == hash_block_tokens(None, [1], (5,))


def test_block_hashes_chain_and_partial_tail_never_hashed():
    tokens = list(range(11))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # 3 tail tokens are not hashed
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    assert all(isinstance(h, bytes) and len(h) == HASH_NBYTES for h in hashes)
    assert block_hashes(tokens[:3], 4) == []
    assert block_hashes([], 4) == []
    # Growing the tail up to (not past) a block boundary changes nothing.
    assert block_hashes(tokens[:8], 4) == block_hashes(tokens[:11], 4)


def test_third_block_appears_at_the_boundary():
    tokens = list(range(12))
    three = block_hashes(tokens, 4)
    assert len(three) == 3 and three[:2] == block_hashes(tokens[:11], 4)


def test_extra_keys_separate_hashes():
    tokens = [1, 2, 3, 4]
    base = hash_block_tokens(None, tokens)
    variants = [("a",), ("b",), (1,), ("1",), (b"1",), ("a", "b"), ("ab",), (0,), (b"",)]
    digests = {hash_block_tokens(None, tokens, k) for k in variants}
    assert len(digests) == len(variants) and base not in digests
    # Keys reach every later block through the chain.
    a = block_hashes(list(range(8)), 4, ("salt-a",))
    b = block_hashes(list(range(8)), 4, ("salt-b",))
    assert a[0] != b[0] and a[1] != b[1]


def test_parent_and_position_matter():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    parent = hash_block_tokens(None, [7])
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(None, [1, 2])
    # The length prefix separates blocks that would otherwise concatenate alike.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 5), max_size=40),
    b=st.lists(st.integers(0, 5), max_size=40),
    block_size=st.integers(1, 6),
)
def test_prefix_property(a, b, block_size):
    """Leading hashes agree exactly as far as the leading full blocks' tokens agree."""
    ha, hb = block_hashes(a, block_size), block_hashes(b, block_size)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (ha[i] == hb[i]) == same_prefix


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: hash_block_tokens(None, []), "at least one token"),
        (lambda: hash_block_tokens(None, [[1, 2]]), "1-D"),
        (lambda: hash_block_tokens(None, [1.0, 2.0]), "integers"),
        (lambda: hash_block_tokens(None, [True, False]), "integers"),
        (lambda: hash_block_tokens(None, [-1]), "non-negative"),
        (lambda: hash_block_tokens(None, np.array([2**64 - 1], np.uint64)), "int64"),
        (lambda: hash_block_tokens(b"short", [1]), "32-byte"),
        (lambda: hash_block_tokens("x" * 32, [1]), "32-byte"),
        (lambda: hash_block_tokens(None, [1], "salt"), "sequence"),
        (lambda: hash_block_tokens(None, [1], (1.5,)), "int, str or bytes"),
        (lambda: hash_block_tokens(None, [1], (True,)), "int, str or bytes"),
        (lambda: hash_block_tokens(None, [1], (2**63,)), "int64"),
        (lambda: block_hashes([1, 2], 0), "positive"),
        (lambda: block_hashes([1, 2], 2.0), "integer"),
    ],
)
def test_bad_input_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
