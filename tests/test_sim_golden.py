"""The engine reproduces, bit for bit, fingerprints recorded before its Vidur-shaped rewrite
(``tests/sim_golden.py``: summaries exactly, per-request records and events by SHA-256)."""

from __future__ import annotations

import json

import pytest

from sim_golden import GOLDEN, compute


@pytest.fixture(scope="module")
def now() -> dict:
    return compute()


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_simulation_matches_recorded_fingerprint(now, name):
    assert now[name] == json.loads(GOLDEN.read_text())[name]
