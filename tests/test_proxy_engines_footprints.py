"""eldr.proxy.engines.footprints: a decoder's GET /eldr/footprint into the policy, every
outcome counted (read, missing, invalid, stale, refused), nothing wanted when disabled."""

import asyncio
import json
import time
from types import SimpleNamespace

import numpy as np

from eldr.capture.decode import encode_digits
from eldr.proxy.engines.footprints import FOOTPRINT_PATH, FootprintReader

L, E = 2, 4


class _Resp:
    def __init__(self, status, body: bytes):
        self.status, self._body, self.content_length = status, body, len(body)

    async def read(self):
        return self._body

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Session:
    def __init__(self, status=200, body=b"", fail=False):
        self.status, self.body, self.fail, self.urls = status, body, fail, []

    def get(self, url, **kw):
        self.urls.append(url)
        if self.fail:
            raise ConnectionError("refused")
        return _Resp(self.status, self.body)


class _Policy:
    engine_footprint_shape = (L, E)

    def __init__(self, accept=True):
        self.accept, self.seen = accept, []

    def observe_engine(self, index, freq, age, max_age):
        self.seen.append((index, freq.copy(), age, max_age))
        return self.accept


def _doc(counts, steps=4, age=0.5):
    return json.dumps({"v": 1, "shape": [L, E], "window": 8, "steps": steps,
                       "time": time.time(), "w": 1, "data": encode_digits(counts, 1),
                       "age": age}).encode()


def _read(reader, session, inst=None):
    inst = inst or SimpleNamespace(url="http://d0", index=1, removed=False)
    return asyncio.run(reader.read(session, inst, timeout=1.0, headers={}))


def _reader(policy, interval=1.0, mode="auto"):
    r = FootprintReader(interval, mode)
    r.policy_of = lambda: policy
    return r


def test_a_valid_reading_reaches_the_policy_as_shares_of_steps():
    policy = _Policy()
    counts = np.array([[4, 0, 2, 1], [0, 0, 4, 3]])
    reader, session = _reader(policy), _Session(body=_doc(counts))
    assert _read(reader, session) == "read"
    assert session.urls == ["http://d0" + FOOTPRINT_PATH]
    ((index, freq, age, max_age),) = policy.seen
    assert index == 1 and age == 0.5 and max_age == 3.0
    np.testing.assert_allclose(freq, counts / 4)
    assert reader.counts["read"] == 1


def test_every_other_outcome_is_counted_and_nothing_reaches_the_policy():
    counts = np.ones((L, E), dtype=int)
    cases = [(_Session(fail=True), "missing"), (_Session(status=404), "missing"),
             (_Session(body=b"{not json"), "invalid"),
             (_Session(body=_doc(np.ones((L, E + 1), dtype=int))), "invalid"),
             (_Session(body=_doc(counts, age=3.0)), "stale")]
    for session, outcome in cases:
        policy = _Policy()
        reader = _reader(policy)
        assert _read(reader, session) == outcome
        assert policy.seen == [] and reader.counts[outcome] == 1
    policy = _Policy(accept=False)
    reader = _reader(policy)
    assert _read(reader, _Session(body=_doc(counts))) == "refused"
    assert reader.counts["refused"] == 1


def test_nothing_is_asked_when_disabled_unwanted_or_the_decoder_left():
    counts = np.ones((L, E), dtype=int)
    for reader in (_reader(_Policy(), interval=0), _reader(_Policy(), mode="off"),
                   _reader(SimpleNamespace())):  # a policy without engine footprints
        session = _Session(body=_doc(counts))
        assert _read(reader, session) is None and session.urls == []
    policy = _Policy()
    gone = SimpleNamespace(url="http://d0", index=0, removed=True)
    assert _read(_reader(policy), _Session(body=_doc(counts)), gone) is None
    assert policy.seen == []
