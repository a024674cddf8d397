"""The decode-selection API of ``eldr serve`` for orchestrators that keep their own request
path (docs/selection-api.md): select a decoder, reserve it, mark the prefill complete,
release it; reservations expire.

:mod:`~eldr.proxy.selection.service` decides and keeps the reservations (:class:`Selection`,
the router's own policy and loads); :mod:`~eldr.proxy.selection.table` is the reservation
memory the workers of ``--workers N`` share; :mod:`~eldr.proxy.selection.routes` the HTTP
routes (:class:`SelectionApi`).
"""

from eldr.proxy.selection.routes import PREFIX, SelectionApi, parse_query
from eldr.proxy.selection.service import Query, Selection, SelectionConfig
from eldr.proxy.selection.table import SelectionTable

__all__ = ["PREFIX", "Query", "Selection", "SelectionApi", "SelectionConfig",
           "SelectionTable", "parse_query"]
