import json

from eldr.proxy.errors import ProxyError, UpstreamReply, error_body, error_type


def test_error_body_is_vllm_shaped():
    doc = json.loads(error_body(404, "no such model", code="model_not_found", param="model"))
    assert doc == {"error": {"message": "no such model", "type": "NotFoundError",
                             "param": "model", "code": 404}}


def test_types_follow_vllm_names_then_status_phrases():
    assert [error_type(s) for s in (400, 404, 500, 503)] == [
        "BadRequestError", "NotFoundError", "InternalServerError", "ServiceUnavailableError"]
    assert (error_type(405), error_type(502), error_type(599)) == (
        "Method Not Allowed", "Bad Gateway", "InternalServerError")


def test_proxy_error_and_upstream_reply_carry_status():
    e = ProxyError(400, "bad", param="prompt", code="why", err_type="Bad Request")
    assert e.status == 400 and e.code == "why"
    assert json.loads(e.body()) == {"error": {"message": "bad", "type": "Bad Request",
                                              "param": "prompt", "code": 400}}
    r = UpstreamReply(422, b"{}", "application/json")
    assert (r.status, r.body, r.content_type) == (422, b"{}", "application/json")
