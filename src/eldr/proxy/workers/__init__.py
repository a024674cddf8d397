"""``eldr serve --workers N``: router processes on one port sharing their decoder loads,
their pool and their artifact (docs/serve.md#several-processes---workers-n)."""

__all__: list[str] = []  # filled once the parts are wired through typed seams
