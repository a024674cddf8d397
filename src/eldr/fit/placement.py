"""Per-decoder expert placement for expert parallelism (docs/fit-and-routing.md, METRO-style).

With EP over ``ep`` GPUs (ranks), each MoE layer's ``E`` experts are split ``E/ep`` per
rank, and a decode step waits for the rank with the most work. ELDR routes similar requests
to the same decoder, so each decoder sees its own cluster's hot experts: one global layout
balances the whole traffic but can pile one cluster's hot experts onto one rank. Per
(decoder, layer), :func:`greedy_placement` therefore takes that decoder's expected decode
activation and hands out experts, most active first, each to the least-loaded rank that
still has room (ties → lowest rank), keeping exactly ``E/ep`` experts per rank.

Placements are int64 arrays of rank ids: ``(L, E)`` for one layout, ``(K, L, E)`` per
decoder. :func:`imbalance` scores a layout against an activation as max/mean rank load
per layer (1.0 = perfectly even).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from eldr.fileio import atomic_write_text
from eldr.traces.trace import Trace

__all__ = [
    "PLACEMENT_VERSION",
    "decoder_activation",
    "fit_placement",
    "global_placement",
    "greedy_placement",
    "imbalance",
    "rank_loads",
    "save_placement",
]

PLACEMENT_VERSION = 1


def _check_ep(ep: int, E: int) -> int:
    if isinstance(ep, bool) or not isinstance(ep, (int, np.integer)) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if E % ep:
        raise ValueError(f"ep={ep} must divide the number of experts E={E}")
    return int(ep)


def greedy_placement(activation: np.ndarray, ep: int) -> np.ndarray:
    """(L, E) expected activation → (L, E) int64 rank per expert, ``E/ep`` per rank.

    Per layer: experts in decreasing activation (ties → lower expert id) go to the
    least-loaded rank with room (ties → lowest rank).
    """
    act = np.asarray(activation, dtype=np.float64)
    if act.ndim != 2:
        raise ValueError(f"activation must be (L, E), got shape {act.shape}")
    if not np.isfinite(act).all() or (act < 0).any():
        raise ValueError("activation must be finite and >= 0")
    L, E = act.shape
    ep = _check_ep(ep, E)
    room0 = E // ep
    out = np.empty((L, E), dtype=np.int64)
    for layer in range(L):
        load = np.zeros(ep)
        room = np.full(ep, room0)
        for e in np.argsort(-act[layer], kind="stable"):
            r = int(np.argmin(np.where(room > 0, load, np.inf)))
            out[layer, e] = r
            load[r] += act[layer, e]
            room[r] -= 1
    return out


def _check_labels(trace: Trace, labels: np.ndarray, num_decoders: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != (trace.num_requests,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be ({trace.num_requests},) integers, got "
                         f"{labels.shape} {labels.dtype}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_decoders):
        raise ValueError(f"labels must lie in [0, {num_decoders})")
    return labels.astype(np.int64, copy=False)


def decoder_activation(trace: Trace, labels: np.ndarray, num_decoders: int) -> np.ndarray:
    """(K, L, E) float64 summed decode counts of the requests assigned to each decoder."""
    labels = _check_labels(trace, labels, num_decoders)
    L, E = trace.meta.num_layers, trace.meta.num_experts
    act = np.zeros((num_decoders, L * E))
    np.add.at(act, labels, trace.decode_counts.reshape(trace.num_requests, -1))
    return act.reshape(num_decoders, L, E)


def fit_placement(trace: Trace, labels: np.ndarray, num_decoders: int, ep: int) -> np.ndarray:
    """(K, L, E) int64 per-decoder layouts from each decoder's requests ``labels`` (R,)."""
    act = decoder_activation(trace, labels, num_decoders)
    return np.stack([greedy_placement(a, ep) for a in act])


def global_placement(trace: Trace, ep: int) -> np.ndarray:
    """(L, E) int64: one layout balancing the decode activation of the whole trace."""
    return greedy_placement(trace.decode_counts.sum(axis=0, dtype=np.float64), ep)


def rank_loads(placement: np.ndarray, activation: np.ndarray, ep: int) -> np.ndarray:
    """(L, ep) activation landing on each rank under an (L, E) ``placement``."""
    placement = np.asarray(placement)
    act = np.asarray(activation, dtype=np.float64)
    if placement.shape != act.shape or placement.ndim != 2:
        raise ValueError(f"placement {placement.shape} and activation {act.shape} must both "
                         "be (L, E)")
    L = placement.shape[0]
    out = np.zeros((L, ep))
    np.add.at(out, (np.repeat(np.arange(L), placement.shape[1]), placement.ravel()),
              act.ravel())
    return out


def imbalance(placement: np.ndarray, activation: np.ndarray, ep: int) -> np.ndarray:
    """(L,) max/mean rank load per layer (1.0 when even; layers without load → 1.0)."""
    loads = rank_loads(placement, activation, ep)
    mean = loads.mean(axis=1)
    return np.divide(loads.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def save_placement(path: str | os.PathLike, *, per_decoder: np.ndarray, global_: np.ndarray,
                   ep: int, worker_ids: list[str], model: dict, report: dict) -> Path:
    """Write ``placement.json`` atomically (format in docs/fit-and-routing.md)."""
    path = Path(path)
    doc = {
        "format": "eldr-expert-placement",
        "version": PLACEMENT_VERSION,
        "model": model,
        "ep": int(ep),
        "worker_ids": list(worker_ids),
        "per_decoder": {w: per_decoder[k].tolist() for k, w in enumerate(worker_ids)},
        "global": global_.tolist(),
        "imbalance": report,
    }
    return atomic_write_text(path, json.dumps(doc) + "\n")
