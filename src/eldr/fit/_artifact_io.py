"""Validating reader of routing artifacts, behind :func:`eldr.fit.artifact.load`.

Kept apart from :mod:`eldr.fit.artifact` (the record, the fit, save and load): the file
names and size caps, the worker-id and τ checks (shared with fitting), the array reader
that checks each header before decompressing, and the document's conversion, with all
its checks, into the fields of a :class:`~eldr.fit.artifact.RoutingArtifact`. It knows
nothing of that record: :func:`artifact_fields` returns its keyword arguments, and
``load`` builds it, so the two modules import one way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from eldr.fileio import NpzReader, open_regular
from eldr.fit.prompt import PromptPredictor
from eldr.fit.signature import REPRESENTATIONS, SignatureEncoder

__all__ = ["ARRAYS_FILE", "JSON_FILE", "MAX_ARRAYS_BYTES", "MAX_JSON_BYTES",
           "MAX_PROMPT_BYTES", "PROMPT_FILE", "artifact_fields", "check_tau",
           "check_worker_ids", "read_arrays"]

JSON_FILE = "artifact.json"
ARRAYS_FILE = "arrays.npz"
PROMPT_FILE = "prompt.npz"  # the optional prompt predictor's arrays
_UNIT_TOL = 1e-3  # centroid norms must be 1 within this (float32 storage)


def check_worker_ids(ids: tuple[str, ...]) -> None:
    if not ids:
        raise ValueError("at least one decode worker id is needed")
    if any(not w or w != w.strip() for w in ids):
        raise ValueError(f"decode worker ids must be non-empty without surrounding spaces: "
                         f"{list(ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"decode worker ids are not unique: {list(ids)}")


def check_tau(tau) -> float:
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a number, got {tau!r}") from None
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"tau must be finite and >= 0, got {tau!r}")
    return value


def _get(doc: dict, path: str, kind):
    node = doc
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"artifact.json: missing field {path!r}")
        node = node[key]
    if kind is int and (isinstance(node, bool) or not isinstance(node, int)):
        raise ValueError(f"artifact.json: {path} must be an integer, got {node!r}")
    if kind is float and (isinstance(node, bool) or not isinstance(node, (int, float))):
        raise ValueError(f"artifact.json: {path} must be a number, got {node!r}")
    if kind in (str, list, dict, bool) and not isinstance(node, kind):
        raise ValueError(f"artifact.json: {path} must be a {kind.__name__}, got {node!r}")
    return node


MAX_JSON_BYTES = 16 << 20  # artifact.json larger than this is refused unread
MAX_ARRAYS_BYTES = 1 << 30  # arrays.npz: the file, and what its arrays declare in all
MAX_PROMPT_BYTES = 256 << 20  # prompt.npz (the fit keeps the predictor under 24 MiB)


def read_arrays(path: Path, shapes: dict[str, tuple[tuple[int, ...], np.dtype]], *,
                max_bytes: int = MAX_ARRAYS_BYTES) -> dict[str, np.ndarray]:
    """The arrays named in ``shapes`` (name → (shape, dtype)), each checked on its header."""
    what = path.name
    try:
        fh = open_regular(path, max_bytes=max_bytes, what=what)
    except FileNotFoundError:
        raise ValueError(f"missing {what}") from None
    with fh:
        if fh.read(2) != b"PK":
            raise ValueError(f"{what} is not a readable array file (not a zip archive)")
        fh.seek(0)
        with NpzReader(fh, max_bytes=max_bytes, where=what) as npz:
            if set(npz.names) != set(shapes):
                raise ValueError(f"{what} holds {sorted(npz.names)}, expected "
                                 f"{sorted(shapes)}")
            return {name: npz.read(name, _exactly(name, *shapes[name])) for name in shapes}


def _exactly(name: str, shape: tuple[int, ...], dtype: np.dtype):
    def check(declared, declared_dtype):
        if tuple(declared) != shape or declared_dtype != dtype:
            raise ValueError(f"{name} has shape {tuple(declared)} {declared_dtype}, expected "
                             f"{shape} {dtype}")
    return check


def artifact_fields(doc: dict, read: Callable[[dict], dict[str, np.ndarray]],
                    read_prompt: Callable[[dict], dict[str, np.ndarray]] | None = None
                    ) -> dict:
    """The keyword arguments of a ``RoutingArtifact`` from its validated document;
    ``read(shapes)`` reads the arrays once the document says what their shapes must be
    (``shapes``: name → (shape, dtype), as :func:`read_arrays` takes them);
    ``read_prompt(shapes)`` the prompt predictor's, when the document has one."""
    name = _get(doc, "model.name", str)
    L, E, k = (_get(doc, f"model.{f}", int) for f in ("num_layers", "num_experts", "top_k"))
    if min(L, E, k) <= 0 or k > E:
        raise ValueError(f"bad model fingerprint L={L} E={E} k={k}")
    rep = _get(doc, "signature.representation", str)
    if rep not in REPRESENTATIONS:
        raise ValueError(f"unknown representation {rep!r}")
    layers = _get(doc, "signature.layers", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ValueError(f"signature.layers must be integers, got {layers!r}")
    ids = _get(doc, "routing.worker_ids", list)
    if not all(isinstance(w, str) for w in ids):
        raise ValueError(f"routing.worker_ids must be strings, got {ids!r}")
    check_worker_ids(tuple(ids))
    tau = check_tau(_get(doc, "routing.tau", float))
    balanced = _get(doc, "routing.balanced", bool)
    fit_stats = doc.get("fit", {})
    if not isinstance(fit_stats, dict):
        raise ValueError("artifact.json: fit must be an object")
    rho_curve = doc["signature"].get("rho_curve", [])
    if not (isinstance(rho_curve, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
            and not isinstance(p[0], bool) and isinstance(p[1], (int, float))
            and not isinstance(p[1], bool) for p in rho_curve)):
        raise ValueError("artifact.json: signature.rho_curve must be a list of "
                         "[layer, rho] pairs")
    if L * E > 1 << 26 or len(ids) * len(layers) * E > 1 << 28:
        raise ValueError(f"implausibly large model fingerprint L={L} E={E} for "
                         f"{len(ids)} workers and {len(layers)} layers")

    K = len(ids)
    shapes = {"idf": ((L, E), np.dtype("<f8")),
              "centroids": ((K, len(layers) * E), np.dtype("<f4"))}
    alpha = None
    if doc.get("cost") is not None:  # version 2: the cost policy's fitted parts
        alpha = _get(doc, "cost.alpha", float)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"cost.alpha must be in [0, 1], got {alpha}")
        shapes["profile_mean"] = ((L, E), np.dtype("<f4"))
        shapes["decoder_profiles"] = ((K, L, E), np.dtype("<f4"))
    arrays = read(shapes)
    idf, centroids = arrays["idf"], arrays["centroids"]  # shapes and dtypes checked
    if not np.isfinite(centroids).all():
        raise ValueError("centroids contain NaN or Inf")
    norms = np.linalg.norm(centroids.astype(np.float64), axis=1)
    bad = np.flatnonzero(np.abs(norms - 1.0) > _UNIT_TOL)
    if bad.size:
        raise ValueError(f"centroid {int(bad[0])} has norm {norms[bad[0]]:.6f}, expected a "
                         "unit row")
    state = {"representation": rep, "num_layers": L, "num_experts": E, "layers": layers,
             "idf": idf, "rho": _get(doc, "signature.rho", float), "rho_curve": rho_curve}
    encoder = SignatureEncoder.from_state(state)  # validates idf values and the layer mask
    mean = profiles = None
    if alpha is not None:  # shapes and dtypes checked by the reader
        mean, profiles = arrays["profile_mean"], arrays["decoder_profiles"]
        if not np.isfinite(mean).all() or (mean < 0).any() or (mean > 1).any():
            raise ValueError("profile_mean must hold probabilities in [0, 1]")
        if not np.isfinite(profiles).all() or (profiles > 0).any():
            raise ValueError("decoder_profiles must be finite log-probabilities (<= 0)")
    prompt = None
    if doc.get("prompt_predictor") is not None:
        prompt = _prompt_predictor(doc["prompt_predictor"], (L, E, k), read_prompt)
    return {"model": name, "num_layers": L, "num_experts": E, "top_k": k, "encoder": encoder,
            "centroids": centroids, "worker_ids": tuple(ids), "tau": tau,
            "balanced": balanced, "fit_stats": fit_stats, "profile_alpha": alpha,
            "profile_mean": mean, "decoder_profiles": profiles, "prompt_predictor": prompt}


def _prompt_predictor(pdoc, model: tuple[int, int, int],
                      read_prompt: Callable[[dict], dict[str, np.ndarray]] | None
                      ) -> PromptPredictor:
    """The optional prompt predictor: document checked, (L, E, k) equal to the model's,
    arrays read with exactly the shapes the document implies, values checked."""
    try:
        pdoc = PromptPredictor.check_document(pdoc)
    except ValueError as exc:
        raise ValueError(f"artifact.json: {exc}") from None
    theirs = (pdoc["num_layers"], pdoc["num_experts"], pdoc["top_k"])
    if theirs != model:
        raise ValueError(f"prompt_predictor is for L={theirs[0]} E={theirs[1]} k={theirs[2]}, "
                         f"the artifact for L={model[0]} E={model[1]} k={model[2]}")
    if read_prompt is None:
        raise ValueError("the artifact has a prompt predictor but no reader for its arrays")
    arrays = read_prompt(PromptPredictor.array_shapes(pdoc))
    return PromptPredictor.from_state(pdoc, arrays)
