"""The admin token check and its per-address limit on wrong tokens
(eldr.proxy.control.admin); the reload path is exercised over HTTP in
test_proxy_learn_admin.py and test_proxy_app.py."""

from types import SimpleNamespace

import pytest

from eldr.proxy.control.admin import AdminToken, FailedAttempts
from eldr.proxy.errors import ProxyError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(auth: str | None = None, remote: str | None = "10.0.0.1"):
    return SimpleNamespace(remote=remote,
                           headers={} if auth is None else {"Authorization": auth})


def _status(token: AdminToken, request) -> int:
    try:
        token.authorize(request)
    except ProxyError as exc:
        return exc.status
    return 200


def test_an_address_is_limited_after_its_failures_until_they_age_out():
    clock = Clock()
    failed = FailedAttempts(max_failures=3, window=60.0, clock=clock)
    for _ in range(2):
        failed.record("a")
    assert not failed.is_limited("a")
    failed.record("a")
    assert failed.is_limited("a") and not failed.is_limited("b")
    clock.now += 59.0
    assert failed.is_limited("a")  # still inside the window
    clock.now += 2.0
    assert not failed.is_limited("a")  # the three aged out


def test_remembered_addresses_are_bounded_oldest_forgotten_first():
    failed = FailedAttempts(max_failures=1, window=60.0, max_peers=3, clock=Clock())
    for peer in ("a", "b", "c", "d"):
        failed.record(peer)
    assert len(failed._seen) == 3
    assert not failed.is_limited("a")  # forgotten: a flood of addresses grows nothing
    assert all(failed.is_limited(p) for p in ("b", "c", "d"))


def test_the_token_is_checked_then_limited_per_address():
    token = AdminToken("s3cret", FailedAttempts(max_failures=2, clock=Clock()))
    assert _status(token, _request("Bearer s3cret")) == 200
    assert _status(token, _request("bearer  s3cret ")) == 200  # scheme case, spaces
    assert _status(token, _request("Basic s3cret")) == 401
    assert _status(token, _request()) == 401
    assert _status(token, _request("Bearer s3cret")) == 429  # even the right one waits
    assert _status(token, _request("Bearer s3cret", remote="10.0.0.2")) == 200
    assert token.is_admin(_request("Bearer s3cret", remote="10.0.0.2"))
    assert not token.is_admin(_request("Bearer wrong", remote="10.0.0.3"))


@pytest.mark.parametrize("auth", ["Bearer anything", None])
def test_without_a_token_every_admin_request_is_refused(auth):
    token = AdminToken(None)
    with pytest.raises(ProxyError) as err:
        token.authorize(_request(auth))
    assert err.value.status == 403 and err.value.code == "admin_disabled"
