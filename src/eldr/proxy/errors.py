"""Error responses in vLLM's shape, field for field.

vLLM 0.32's OpenAI server answers every error as::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

``code`` is the HTTP status (an integer), ``type`` the name vLLM gives that status
(``BadRequestError``, ``NotFoundError``, ... or the status phrase, as its HTTP-exception
handler does), ``param`` the offending request field. A request it refuses while parsing
(pydantic) gets ``type`` "Bad Request" and ``param`` "body.<field>"; :mod:`eldr.proxy.bodies`
builds those. The router raises :class:`ProxyError` anywhere in the request flow; the
application turns it into that body, so clients see one shape whoever refused.
"""

from __future__ import annotations

import json
from http import HTTPStatus

__all__ = ["ProxyError", "UpstreamReply", "error_body", "error_type"]

# the names vLLM's create_error_response gives (vllm/entrypoints/serve/exception_handling)
_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """vLLM's ``type`` for ``status``: its exception name, else the HTTP status phrase."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None, err_type: str | None = None) -> bytes:
    """The JSON error document (UTF-8 bytes) for ``status``.

    ``code`` is the router's own reason (``"no_decoder"``...): it goes to logs, not into the
    body, whose ``code`` is the HTTP status as vLLM's is.
    """
    err = {"message": message, "type": err_type or error_type(status), "param": param,
           "code": status}
    return json.dumps({"error": err}).encode()


class ProxyError(Exception):
    """An error answered to the client in vLLM's error shape.

    ``status``: the HTTP status; ``code``: the router's short reason (e.g. ``"no_decoder"``,
    for logs and tests; the body carries the status); ``param``: the offending request
    field, if any; ``err_type``: the body's ``type`` when not the status's default.
    """

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, err_type=self.err_type)


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
