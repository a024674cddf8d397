"""The request path of ``eldr serve``: one client request in, a prefill, a routing decision,
a decode, the decoder's answer relayed out (docs/serve.md#one-request)."""

__all__: list[str] = []  # filled once the parts are wired through typed seams
