"""The request path of ``eldr serve``: one client request in, a prefill, a routing decision,
a decode, the decoder's answer relayed out (docs/serve.md#one-request).

:mod:`~eldr.proxy.request.flow` runs it (:class:`RequestFlow`): each attempt's prefill
goes through :mod:`~eldr.proxy.request.prefill`, its decoder is
:mod:`~eldr.proxy.request.choice`'s, and its decode goes to
:mod:`~eldr.proxy.request.relay` as a :class:`DecodeAttempt`; the routing snapshot is
:mod:`~eldr.proxy.request.decision`'s, what a prefill answer tells the policy
:mod:`~eldr.proxy.request.signatures`'; :mod:`~eldr.proxy.request.affinity` picks the
prefill instance, :mod:`~eldr.proxy.request.containment` keeps poison requests and retry
storms out, :mod:`~eldr.proxy.request.decodepayload` strips the decode engines' counts,
:mod:`~eldr.proxy.request.offload` tokenizes and predicts prompts off the event loop and
:mod:`~eldr.proxy.request.forward` answers vLLM's other routes.
"""

from eldr.proxy.request.affinity import PrefixAffinity
from eldr.proxy.request.containment import GuardBuffers, RequestGuards, make_guards
from eldr.proxy.request.decision import LiveRouting, RoutingState, WorkerMismatch, build_state
from eldr.proxy.request.flow import LearnerHook, RequestFlow
from eldr.proxy.request.forward import (
    KNOWN_ROUTES,
    OWN_ROUTES,
    Forwarder,
    classify,
    method_not_allowed,
)
from eldr.proxy.request.relay import DecodeAttempt, DecodeRelay, DecodeTarget, is_stream_done
from eldr.proxy.request.signatures import Reading, read_counts, read_inputs, split_kv_params

__all__ = [
    "KNOWN_ROUTES",
    "OWN_ROUTES",
    "DecodeAttempt",
    "DecodeRelay",
    "DecodeTarget",
    "Forwarder",
    "GuardBuffers",
    "LearnerHook",
    "LiveRouting",
    "PrefixAffinity",
    "Reading",
    "RequestFlow",
    "RequestGuards",
    "RoutingState",
    "WorkerMismatch",
    "build_state",
    "classify",
    "is_stream_done",
    "make_guards",
    "method_not_allowed",
    "read_counts",
    "read_inputs",
    "split_kv_params",
]
