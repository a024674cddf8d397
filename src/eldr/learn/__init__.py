"""Learning the routing artifact from live traffic (``eldr serve --learn DIR``; docs/learn.md).

:mod:`~eldr.learn.buffer` keeps completed requests as a rolling calibration trace,
:mod:`~eldr.learn.refit` fits and validates a candidate artifact in another process,
:mod:`~eldr.learn.drift` watches the traffic for a shift away from the calibration, and
:mod:`~eldr.learn.controller` decides when to fit and hands accepted artifacts to the
router's reload. Imports traces, fit and routing only; the proxy imports this package.
"""

__all__: list[str] = []
