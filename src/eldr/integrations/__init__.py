"""Adapters that put ELDR's decode routing inside other serving stacks (each an extra):
:mod:`eldr.integrations.ray` (Ray Serve, docs/ray.md)."""

__all__: list[str] = []
