"""The engines behind the router: the pool of prefill and decode instances, their health,
load and circuit breakers, and the HTTP client the router talks to them with."""

__all__: list[str] = []  # filled once the parts are wired through typed seams
