"""Adapters that put ELDR's decode routing inside other serving stacks (each an extra)."""
