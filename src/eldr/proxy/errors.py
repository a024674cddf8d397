"""OpenAI-style error responses.

Clients of an OpenAI-compatible server expect every error as::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null,
               "code": null}, "object": "error"}

with a 4xx status for the client's mistakes and a 5xx for the server's. The router raises
:class:`ProxyError` anywhere in the request flow; the application turns it into that body.
"""

from __future__ import annotations

import json

__all__ = ["ProxyError", "UpstreamReply", "error_body"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None) -> bytes:
    """The JSON error document (UTF-8 bytes) for ``status``."""
    err = {"message": message, "type": _TYPES.get(status, "server_error"),
           "param": param, "code": code}
    return json.dumps({"error": err, "object": "error"}).encode()


class ProxyError(Exception):
    """An error answered to the client as an OpenAI-style JSON document.

    ``status``: the HTTP status; ``code``: a short machine-readable reason
    (e.g. ``"model_not_found"``); ``param``: the offending request field, if any.
    """

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, code=self.code, param=self.param)


class UpstreamReply(Exception):  # a reply to relay, not a failure of ours
    """An engine's own 4xx answer (e.g. vLLM rejecting a bad parameter), relayed verbatim.

    The client's request was at fault, so the status and body go back unchanged; the
    router does not retry it elsewhere.
    """

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type
