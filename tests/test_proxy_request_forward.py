"""What the router does with routes outside its own (eldr.proxy.request.forward.classify);
the forwarding itself runs over HTTP in test_proxy_app.py."""

import pytest

from eldr.proxy.request.forward import classify


@pytest.mark.parametrize("method, path, what", [
    ("GET", "/v1/completions", "own"),  # a router route with a wrong method: its 405
    ("POST", "/admin/reload", "own"),
    ("POST", "/admin/anything", "control"),  # /admin/* is never forwarded
    ("POST", "/sleep", "control"),
    ("POST", "/v1/load_lora_adapter", "control"),
    ("POST", "/v1/responses", "generation"),
    ("GET", "/v1/responses/abc", "generation"),
    ("POST", "/v1/audio/transcriptions", "generation"),
    ("DELETE", "/tokenize", "method"),
    ("POST", "/tokenize", "forward"),
    ("GET", "/version", "forward"),
    ("GET", "/no/such/route", "forward"),  # the engines answer their own 404
])
def test_each_kind_of_route(method, path, what):
    assert classify(method, path) == what
