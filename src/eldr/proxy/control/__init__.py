"""The router's control side: the admin token, artifact reloads, the elastic decoder pool
and learning from live traffic (``--learn``)."""

__all__: list[str] = []  # filled once the parts are wired through typed seams
