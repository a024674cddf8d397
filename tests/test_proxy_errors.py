import json

from eldr.proxy.errors import ProxyError, UpstreamReply, error_body


def test_error_body_is_openai_shaped():
    doc = json.loads(error_body(404, "no such model", code="model_not_found", param="model"))
    assert doc == {"object": "error", "error": {"message": "no such model",
                                                "type": "not_found_error",
                                                "param": "model", "code": "model_not_found"}}


def test_unknown_status_is_a_server_error():
    assert json.loads(error_body(599, "x"))["error"]["type"] == "server_error"


def test_proxy_error_and_upstream_reply_carry_status():
    e = ProxyError(400, "bad", param="prompt")
    assert e.status == 400 and json.loads(e.body())["error"]["param"] == "prompt"
    r = UpstreamReply(422, b"{}", "application/json")
    assert (r.status, r.body, r.content_type) == (422, b"{}", "application/json")
