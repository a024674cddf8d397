"""One module per ``eldr`` sub-command; each defines ``HELP``, ``add_arguments`` and ``run``."""
