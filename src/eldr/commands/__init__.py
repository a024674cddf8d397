"""One module per ``eldr`` sub-command; each defines ``HELP``, ``add_arguments`` and ``run``."""

__all__: list[str] = []  # one module per sub-command, found by eldr.cli
