import pytest

from eldr.proxy.config import ServeConfig, parse_decode_spec

P, D1, D2 = "http://127.0.0.1:8100", "http://127.0.0.1:8200", "http://127.0.0.1:8201"


def test_valid_config_strips_trailing_slash():
    c = ServeConfig(prefill_urls=(P + "/",), decode_urls=(D1, D2), policy="jsq")
    assert c.prefill_urls == (P,)
    assert c.decode_urls == (D1, D2)


@pytest.mark.parametrize("kw, match", [
    ({"prefill_urls": ()}, "--prefill"),
    ({"decode_urls": ()}, "--decode"),
    ({"prefill_urls": ("ftp://x:1",)}, "http://HOST:PORT"),
    ({"prefill_urls": ("http://x:1/?a=1",)}, "query"),
    ({"decode_urls": (D1, D1)}, "listed twice"),
    ({"policy": "nope"}, "unknown routing policy"),
    ({"policy": "domain"}, "simulation only"),
    ({"policy": "oracle_signature"}, "simulation only"),
    ({"tau": -0.1}, "tau"),
    ({"tau": float("nan")}, "tau"),
    ({"port": 70000}, "port"),
    ({"admin_token": "short"}, "at least 8"),
    ({"decode_ids": ("a",)}, "1 decode ids for 2"),
    ({"decode_ids": ("a", "a")}, "listed twice"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"prefill_timeout": float("inf")}, "prefill_timeout"),
    ({"scrape_interval": -1.0}, "scrape_interval"),
    ({"engine_footprint": "on"}, "engine_footprint"),
    ({"short_prompt_tokens": -1}, "short_prompt_tokens"),
    ({"short_prompt_tokens": True}, "short_prompt_tokens"),
    ({"short_prompt_tokens": 2.5}, "short_prompt_tokens"),
    ({"poison_ttl": 0}, "poison_ttl"),
    ({"poison_capacity": 0}, "poison_capacity"),
    ({"retry_budget_ratio": -0.1}, "retry_budget_ratio"),
    ({"retry_budget_min": float("nan")}, "retry_budget_min"),
    ({"retry_budget_window": 0}, "retry_budget_window"),
])
def test_bad_values_are_named(kw, match):
    base = {"prefill_urls": (P,), "decode_urls": (D1, D2), "policy": "jsq"}
    with pytest.raises(ValueError, match=match):
        ServeConfig(**{**base, **kw})


def test_config_is_frozen():
    c = ServeConfig(prefill_urls=(P,), decode_urls=(D1,), policy="jsq")
    with pytest.raises(AttributeError):
        c.port = 1


def test_parse_decode_spec():
    assert parse_decode_spec("w0=" + D1) == ("w0", D1)
    assert parse_decode_spec(D1 + "/") == (None, D1)
    with pytest.raises(ValueError, match="worker id"):
        parse_decode_spec("=" + D1)
    with pytest.raises(ValueError, match="decode URL"):
        parse_decode_spec("w0=localhost:80")
