"""Large arrays of a reproduction moved to read-only memory-mapped ``.npy`` files.

The values do not change, only where they live: the process that built them no longer
holds them in its own memory, and joblib sends worker processes the file names, so every
process maps one copy and reads in only the pages it touches.
:mod:`eldr.reproduce.building` shares each set-up as soon as it is fitted
(:func:`share_setup`); :func:`eldr.reproduce.sweeps.run_plan` maps the calibration splits
once every centroid set is fitted (:func:`map_to_files`).
"""

from __future__ import annotations

import numpy as np

from eldr.reproduce.setup import RoutingSetup

__all__ = ["map_to_files", "share_setup", "slab_path"]


def slab_path(prefix: str) -> str:
    """The decode-token slab file of the set-up whose files start with ``prefix``."""
    return f"{prefix}-tokens.npy"


def share_setup(setup: RoutingSetup, prefix: str, *, slab_built: bool = False) -> None:
    """Build the set-up's decode-token slab into a file (before its counts go to files:
    building reads them all), or map the one a worker built there (``slab_built``,
    :func:`eldr.reproduce.building.build_setups`), and move its held-out arrays and
    signatures to files."""
    if slab_built:
        setup.tokens.map_built(slab_path(prefix))
    else:
        setup.tokens.build_all(slab_path(prefix))
    map_to_files(setup.eval, f"{prefix}-eval")
    setup.signatures = _to_file(setup.signatures, f"{prefix}-signatures.npy")


def map_to_files(trace, prefix: str, min_bytes: int = 1 << 20) -> None:
    """Move the trace's arrays of at least ``min_bytes`` into ``.npy`` files named
    ``{prefix}-{field}.npy`` and map them read-only, in place.

    (Trace is frozen; its arrays are swapped without re-validating, which would read
    every page back in.)"""
    for name, arr in list(vars(trace).items()):
        if isinstance(arr, np.ndarray) and arr.nbytes >= min_bytes:
            object.__setattr__(trace, name, _to_file(arr, f"{prefix}-{name}.npy"))


def _to_file(arr: np.ndarray, path: str) -> np.ndarray:
    """``arr`` saved to ``path`` and mapped back read-only (a plain view of the map)."""
    if isinstance(arr.base, np.memmap):
        return arr
    np.save(path, arr)
    return np.load(path, mmap_mode="r").view(np.ndarray)
