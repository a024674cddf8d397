"""Token path of :mod:`eldr.traces.synth`: route every token and record its top-k ids."""

from __future__ import annotations

import numpy as np

from eldr.traces.sampling import token_topk

__all__ = ["TokenRecorder"]

_TOKEN_CHUNK = 65_536  # tokens routed at once (bounds the temporaries to ~100 MB)


class TokenRecorder:
    """Routes every token of the prefill segments and decode runs, layer by layer.

    seg_lens: (S,) prefill segments (shared prefixes first, then one user prompt per
    request); dec_lens: (R,) decode tokens per request. ``route_*`` return the per-segment
    counts (and gate sums) of one layer and record the top-k ids; ``prefill_topk``
    assembles each request's rows (its prefix's, then its own) at the end.
    """

    def __init__(self, seg_lens: np.ndarray, dec_lens: np.ndarray, L: int, k: int) -> None:
        self.seg_lens, self.dec_lens, self.k = seg_lens, dec_lens, k
        self.seg_off = np.concatenate([[0], np.cumsum(seg_lens)])
        self.seg_topk = np.zeros((int(self.seg_off[-1]), L, k), np.int16)
        self.dec_off = np.concatenate([[0], np.cumsum(dec_lens)])
        self.decode_topk = np.zeros((int(self.dec_off[-1]), L, k), np.int16)

    def _chunks(self, offsets: np.ndarray):
        """Consecutive segment ranges [a, b) holding about ``_TOKEN_CHUNK`` tokens each."""
        n = offsets.shape[0] - 1
        a = 0
        while a < n:
            b = int(np.searchsorted(offsets, offsets[a] + _TOKEN_CHUNK, side="right")) - 1
            b = min(max(b, a + 1), n)
            yield a, b
            a = b

    def route_prefill(self, rng, layer, z_seg, E, gate_scale):
        S = z_seg.shape[0]
        cnt = np.zeros((S, E), np.int64)
        prob = np.zeros((S, E), np.float64)
        logit = np.zeros((S, E), np.float64)
        for a, b in self._chunks(self.seg_off):
            lens = self.seg_lens[a:b]
            seg = np.repeat(np.arange(a, b), lens)
            if seg.size == 0:
                continue
            top, h, pr = token_topk(rng, z_seg[seg], self.k, with_gates=True,
                                    gate_scale=gate_scale)
            t0, t1 = self.seg_off[a], self.seg_off[b]
            self.seg_topk[t0:t1, layer] = top
            flat = np.repeat(seg, self.k) * E + top.ravel().astype(np.int64)
            cnt += np.bincount(flat, minlength=S * E).reshape(S, E)
            nz = np.flatnonzero(lens)
            starts = (self.seg_off[a:b] - t0)[nz]
            prob[a + nz] = np.add.reduceat(pr, starts, axis=0, dtype=np.float64)
            logit[a + nz] = np.add.reduceat(h, starts, axis=0, dtype=np.float64)
        return cnt, prob, logit

    def route_decode(self, rng, layer, z_dec, E, stickiness):
        R = z_dec.shape[0]
        cnt = np.zeros((R, E), np.int64)
        for a, b in self._chunks(self.dec_off):
            lens = self.dec_lens[a:b]
            req = np.repeat(np.arange(a, b), lens)
            if req.size == 0:
                continue
            top, _, _ = token_topk(rng, z_dec[req], self.k, with_gates=False)
            if stickiness > 0:
                first = np.zeros(req.size, bool)
                first[(self.dec_off[a:b] - self.dec_off[a])[lens > 0]] = True
                fresh = first | (rng.random(req.size) >= stickiness)
                src = np.maximum.accumulate(np.where(fresh, np.arange(req.size), 0))
                top = top[src]
            self.decode_topk[self.dec_off[a]:self.dec_off[b], layer] = top
            flat = np.repeat(req, self.k) * E + top.ravel().astype(np.int64)
            cnt += np.bincount(flat, minlength=R * E).reshape(R, E)
        return cnt

    def prefill_topk(self, prefix: np.ndarray, Q: int) -> np.ndarray:
        """(P, L, k) int16: each request's shared-prefix rows, then its own prompt rows.

        prefix: (R,) shared prefix segment of each request, -1 for none; Q: number of
        prefix segments (request r's own prompt is segment Q + r).
        """
        rows = []
        for r in range(prefix.shape[0]):
            if prefix[r] >= 0:
                q = prefix[r]
                rows.append(np.arange(self.seg_off[q], self.seg_off[q + 1]))
            rows.append(np.arange(self.seg_off[Q + r], self.seg_off[Q + r + 1]))
        idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return self.seg_topk[idx]
