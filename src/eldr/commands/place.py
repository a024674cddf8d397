"""``eldr place ARTIFACT TRACE --ep N``: per-decoder expert placement for EP > 1."""

from __future__ import annotations

import argparse

HELP = "Per-decoder expert placement over EP ranks from an artifact and a calibration trace."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="routing artifact directory written by eldr fit")
    p.add_argument("trace", help="calibration trace (.npz) of the same model")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel ranks per decoder")
    p.add_argument("--output", "-o", required=True, metavar="FILE",
                   help="placement JSON to write (atomically)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from eldr.fit import artifact, placement
    from eldr.fit.cluster import balanced_assign
    from eldr.traces.trace import load

    art = artifact.load(args.artifact)
    trace = load(args.trace)
    art.check_model(trace)
    trace.require_prefill("eldr place (it assigns each request to a decoder by its prefill "
                          "signature)")
    K = art.num_workers
    # Each decoder's requests: the balanced assignment of the trace to the centroids, i.e.
    # the clusters as fitted (on the calibration trace, exactly the K-means labels).
    sims = art.encoder.transform(trace).astype(np.float64) @ art.centroids.T.astype(np.float64)
    labels = balanced_assign(1.0 - sims)
    per_decoder = placement.fit_placement(trace, labels, K, args.ep)
    layout = placement.global_placement(trace, args.ep)
    act = placement.decoder_activation(trace, labels, K)
    rows = []
    print(trace.describe())
    print(f"EP={args.ep}: {trace.meta.num_experts // args.ep} experts per rank; rank load "
          "imbalance (max/mean) on each decoder's own traffic, mean over layers [worst layer]")
    print(f"{'decoder':<16} {'requests':>8} {'per-decoder':>16} {'global':>16}")
    for k, w in enumerate(art.worker_ids):
        own = placement.imbalance(per_decoder[k], act[k], args.ep)
        glob = placement.imbalance(layout, act[k], args.ep)
        n = int((labels == k).sum())
        rows.append({"worker": w, "requests": n, "per_decoder_mean": float(own.mean()),
                     "per_decoder_max": float(own.max()), "global_mean": float(glob.mean()),
                     "global_max": float(glob.max())})
        print(f"{w:<16} {n:8d} {own.mean():8.3f} [{own.max():5.3f}] "
              f"{glob.mean():8.3f} [{glob.max():5.3f}]")
    mean_own = float(np.mean([r["per_decoder_mean"] for r in rows]))
    mean_glob = float(np.mean([r["global_mean"] for r in rows]))
    print(f"{'mean':<16} {'':8} {mean_own:8.3f} {'':7} {mean_glob:8.3f}")
    model = {"name": art.model, "num_layers": art.num_layers, "num_experts": art.num_experts,
             "top_k": art.top_k}
    out = placement.save_placement(
        args.output, per_decoder=per_decoder, global_=layout, ep=args.ep,
        worker_ids=list(art.worker_ids), model=model,
        report={"decoders": rows, "per_decoder_mean": mean_own, "global_mean": mean_glob})
    print(f"wrote {out}")
    return 0
