"""Recorded expert routing converted into eldr traces (``eldr import``; docs/trace-format.md,
"Importing recorded routing").

Four layouts:

- ``gpt-oss``: the GPT-OSS-20B recording of ``shared/data/real-routing/gpt-oss-20b/``
  (``routing.npz``, ``tokens.npz``, optional ``requests.json``): decode routing only, with
  the prompts' token ids. Routing row i of a request is the forward step that reads
  generated token i, so it maps one to one onto eldr's decode steps (the first output token
  comes out of prefill, the last one is never fed back): ``output_lens = rows + 1``,
  ``decode_topk`` = the rows, ``decode_token_ids`` = the tokens they read. No prefill
  routing: a decode-only (version 2) trace, real ``prompt_lens`` and ``prompt_token_ids``
  (the whole prompt: template, user message, closing tokens).
- ``esft``: the ESFT-vanilla-lite recording (``routing.npz`` with ``expert_ids``,
  ``offsets``, ``task``): every token of a sequence routed in one teacher-forced pass, no
  token ids. A split point ``s`` is chosen per sequence (``split`` × its length, default the
  first half): rows ``0 .. s−1`` are the prompt (what a prefill of that prefix computes);
  tokens ``s .. n−1`` are the output, the first of them produced by prefill, so the decode
  steps read tokens ``s .. n−2`` (rows ``s .. n−2``) and the last row (the step that reads
  the sequence's final token, which a server never runs) is dropped: ``output_lens = n − s``.
- ``jsonl`` and ``npz``: the generic layouts a user dumps from their own stack
  (:func:`read_generic_jsonl`, :func:`read_generic_npz`; format in the docs).

Every problem with the input is one ``ValueError`` line naming the file (and the line of a
JSONL file); ``eldr import`` turns it into exit status 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eldr.traces.trace import Trace, TraceMeta

__all__ = ["ESFT_DEFAULT_SPLIT", "LAYOUTS", "GenericOptions", "counts_of", "detect_layout",
           "esft_split_points", "import_esft", "import_gpt_oss",
           "import_trace", "read_generic_jsonl", "read_generic_npz"]

LAYOUTS = ("auto", "gpt-oss", "esft", "jsonl", "npz")
ESFT_DEFAULT_SPLIT = 0.5  # share of each ESFT sequence taken as its prompt

_MAX_INPUT_BYTES = 4 << 30
_MAX_JSONL_LINE = 1 << 20

# The two public recordings (shared/data/real-routing/README.md).
_GPT_OSS = {"model": "gpt-oss-20b", "num_layers": 24, "num_experts": 32, "top_k": 4,
            "url": "https://github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting",
            "commit": "72b368f60045221f21eeb65debb27d58de92e565", "licence": "Apache-2.0"}
_ESFT = {"model": "esft-vanilla-lite", "num_layers": 26, "num_experts": 64, "top_k": 6,
         "url": "https://github.com/deepseek-ai/ESFT", "commit": "579a7711",
         "licence": "MIT (code of github.com/deepseek-ai/ESFT); the model, "
                    "deepseek-ai/ESFT-vanilla-lite, is under the DeepSeek model licence"}


def _family(dataset: str) -> str:
    """The benchmark family of a GPT-OSS request's ``dataset`` (MMLU-Pro kept apart from
    MMLU: a caller that wants them together merges the two labels)."""
    d = dataset.lower()
    for prefix, name in (("mmlu_pro", "mmlu_pro"), ("mmlu", "mmlu"),
                         ("sorry_bench", "sorry_bench"), ("polyglot", "polyglot_or_not"),
                         ("tulu3", "tulu3_persona_if")):
        if d.startswith(prefix):
            return name
    return d or "unknown"


def _npz(path: Path, where: str) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` read without pickle, or one ValueError line."""
    if not path.is_file():
        raise ValueError(f"{where}: no file {path.name} there")
    if path.stat().st_size > _MAX_INPUT_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_INPUT_BYTES >> 30} GiB, refused")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as exc:  # OSError, ValueError, zipfile.BadZipFile, EOFError ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not a readable .npz ({reason})") from None


def _need(arrays: dict, names: Iterable[str], where: Path) -> None:
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(f"{where}: missing array(s) {missing} (found {sorted(arrays)})")


def _offsets(off, n_rows: int, where: str) -> np.ndarray:
    off = np.asarray(off)
    if off.ndim != 1 or off.size < 2 or not np.issubdtype(off.dtype, np.integer):
        raise ValueError(f"{where}: offsets must be a 1-D integer array of R + 1 >= 2 entries")
    off = off.astype(np.int64)
    if off[0] != 0 or off[-1] != n_rows or (np.diff(off) < 0).any():
        raise ValueError(f"{where}: offsets must rise from 0 to the {n_rows} rows")
    return off


def _expert_ids(arr, num_layers: int, top_k: int, num_experts: int, where: str) -> np.ndarray:
    """(T, L, k) int16 expert ids, checked: shape, integers, range."""
    arr = np.asarray(arr)
    if arr.ndim != 3 or arr.shape[1:] != (num_layers, top_k):
        raise ValueError(f"{where}: expert ids of shape {arr.shape}, expected (T, {num_layers}, "
                         f"{top_k})")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: expert ids must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"{where}: expert id out of range [0, {num_experts}) "
                         f"(min {int(arr.min())}, max {int(arr.max())})")
    return arr.astype(np.int16)


def counts_of(topk: np.ndarray, offsets: np.ndarray, num_experts: int) -> np.ndarray:
    """(R, L, E) int32 expert counts of per-token ids ``topk`` (T, L, k), request r being
    rows ``offsets[r]:offsets[r + 1]``."""
    R = offsets.size - 1
    L = topk.shape[1]
    req = np.repeat(np.arange(R), np.diff(offsets))
    flat = (req[:, None, None] * L + np.arange(L)[None, :, None]) * num_experts + topk
    out = np.bincount(flat.ravel().astype(np.int64), minlength=R * L * num_experts)
    return out.reshape(R, L, num_experts).astype(np.int32)


# -- the two public recordings ---------------------------------------------------------------
def import_gpt_oss(directory: str | os.PathLike) -> Trace:
    """The GPT-OSS-20B recording (module docstring): a decode-only trace."""
    d = Path(directory)
    where = str(d)
    routing = _npz(d / "routing.npz", where)
    _need(routing, ("expert_ids", "offsets"), d / "routing.npz")
    tokens = _npz(d / "tokens.npz", where)
    _need(tokens, ("prompt_ids", "prompt_offsets"), d / "tokens.npz")
    c = _GPT_OSS
    topk = _expert_ids(routing["expert_ids"], c["num_layers"], c["top_k"], c["num_experts"],
                       f"{d / 'routing.npz'}")
    off = _offsets(routing["offsets"], topk.shape[0], f"{d / 'routing.npz'}")
    R = off.size - 1
    p_off = _offsets(tokens["prompt_offsets"], int(np.asarray(tokens["prompt_ids"]).size),
                     f"{d / 'tokens.npz'} prompt_offsets")
    if p_off.size != R + 1:
        raise ValueError(f"{d / 'tokens.npz'}: {p_off.size - 1} prompts for {R} routed requests")
    prompt_ids = np.asarray(tokens["prompt_ids"])
    if not np.issubdtype(prompt_ids.dtype, np.integer) or (prompt_ids.size
                                                          and prompt_ids.min() < 0):
        raise ValueError(f"{d / 'tokens.npz'}: prompt_ids must be non-negative integers")
    gen = None
    if "gen_ids" in tokens:
        gen = np.asarray(tokens["gen_ids"])
        g_off = tokens.get("gen_offsets")
        if gen.shape != (topk.shape[0],) or (g_off is not None
                                             and not np.array_equal(g_off, off)):
            raise ValueError(f"{d / 'tokens.npz'}: gen_ids are not aligned with the routing "
                             "rows")
    prov = {"url": c["url"], "commit": c["commit"],
            "recorded": "HF transformers generate, greedy, max_new_tokens=512",
            "conversion": "eldr import --layout gpt-oss: routing row i (the step reading "
                          "generated token i) = decode step i; output_lens = rows + 1",
            "prompt_token_ids": "ids index the recording's own vocabulary of token strings "
                                "(tokens.npz 'vocab', not shipped), not the tokenizer's ids; "
                                "whole prompt: 64-token system template, user message, "
                                "3 closing tokens",
            "prefill": "none: the recorder dropped the prompt tokens' routing"}
    domains = names = None
    req_path = d / "requests.json"
    if req_path.is_file():
        doc = _json_file(req_path)
        reqs = doc.get("requests") if isinstance(doc, dict) else None
        if not isinstance(reqs, list) or len(reqs) != R or not all(
                isinstance(q, dict) and isinstance(q.get("dataset"), str) for q in reqs):
            raise ValueError(f"{req_path}: expected {{'requests': [{R} objects with a "
                             "'dataset' string]}")
        fam = [_family(q["dataset"]) for q in reqs]
        names = tuple(sorted(set(fam)))
        domains = np.array([names.index(f) for f in fam], dtype=np.int32)
        for key in ("source", "commit", "licence", "model"):
            if isinstance(doc.get(key), str):
                prov[f"source_{key}"] = doc[key]
        prov["domains"] = "benchmark family of each request's dataset (MMLU-Pro apart)"
        prov["has_repetition"] = sum(bool(q.get("has_repetition")) for q in reqs)
        prov["unfinished"] = sum(not q.get("finished_successfully", True) for q in reqs)
    prov["caveat"] = ("requests 194 and 493 may have gen_ids shifted by one token against "
                      "the routing rows (the source re-tokenised the generated text)")
    meta = TraceMeta(model=c["model"], num_layers=c["num_layers"],
                     num_experts=c["num_experts"], top_k=c["top_k"],
                     source="imported:gpt-oss-expert-fingerprinting", licence=c["licence"],
                     provenance=prov)
    return Trace(meta=meta, prefill_counts=None,
                 decode_counts=counts_of(topk, off, c["num_experts"]),
                 prompt_lens=np.diff(p_off), output_lens=np.diff(off) + 1,
                 domains=domains, domain_names=names, decode_topk=topk,
                 prompt_token_ids=prompt_ids.astype(np.int32),
                 decode_token_ids=None if gen is None else gen.astype(np.int32))


def esft_split_points(lengths: np.ndarray, split: float) -> np.ndarray:
    """(R,) prompt tokens of each ESFT sequence: ``floor(split · n)`` clipped to
    ``[1, n − 1]`` (a prompt of at least one token, an output of at least one)."""
    if not 0.0 < split < 1.0:
        raise ValueError(f"--split must be a fraction in (0, 1), got {split}")
    n = np.asarray(lengths, dtype=np.int64)
    if (n < 2).any():
        raise ValueError("a sequence shorter than 2 tokens cannot be split into prompt and "
                         "output")
    return np.clip(np.floor(split * n).astype(np.int64), 1, n - 1)


def import_esft(directory_or_file: str | os.PathLike, *,
                split: float = ESFT_DEFAULT_SPLIT) -> Trace:
    """The ESFT-vanilla-lite recording (module docstring), the first ``split`` of each
    sequence as its prompt."""
    p = Path(directory_or_file)
    path = p / "routing.npz" if p.is_dir() else p
    routing = _npz(path, str(p))
    _need(routing, ("expert_ids", "offsets"), path)
    c = _ESFT
    topk = _expert_ids(routing["expert_ids"], c["num_layers"], c["top_k"], c["num_experts"],
                       str(path))
    off = _offsets(routing["offsets"], topk.shape[0], str(path))
    n = np.diff(off)
    s = esft_split_points(n, split)
    pre_rows = np.concatenate([np.arange(a, a + b) for a, b in zip(off[:-1], s, strict=True)])
    dec_rows = np.concatenate([np.arange(a + b, e - 1)
                               for a, b, e in zip(off[:-1], s, off[1:], strict=True)])
    pre_lens, out_lens = s, n - s
    pre, dec = topk[pre_rows], topk[dec_rows]
    domains = names = None
    if "task" in routing:
        task = np.asarray(routing["task"])
        if task.shape != (n.size,) or task.dtype.kind not in "US":
            raise ValueError(f"{path}: 'task' must be ({n.size},) strings")
        names = tuple(sorted({str(t) for t in task}))
        domains = np.array([names.index(str(t)) for t in task], dtype=np.int32)
    prov = {"url": c["url"], "commit": c["commit"],
            "recorded": "results/expert_scores/<task>/expert_weights_<layer>.txt: every token "
                        "of each chat sequence routed in one teacher-forced pass",
            "split": float(split),
            "conversion": f"eldr import --layout esft --split {split:g}: the first "
                          f"floor({split:g}·n) tokens (clipped to [1, n−1]) are the prompt "
                          "(prefill routing); tokens s..n−1 the output, the first from "
                          "prefill, decode steps read s..n−2; the last row (reading the "
                          "final token, never run when serving) is dropped",
            "gate_weights": "not kept (recorded top-6 weights, not renormalised; nothing in "
                            "eldr reads them)",
            "shared_experts": "2 shared experts every token uses are not in the routing"}
    meta = TraceMeta(model=c["model"], num_layers=c["num_layers"],
                     num_experts=c["num_experts"], top_k=c["top_k"],
                     source="imported:esft-expert-scores", licence=c["licence"],
                     provenance=prov)
    return Trace(meta=meta, prefill_counts=counts_of(pre, _cum(pre_lens), c["num_experts"]),
                 decode_counts=counts_of(dec, _cum(out_lens - 1), c["num_experts"]),
                 prompt_lens=pre_lens, output_lens=out_lens, domains=domains,
                 domain_names=names, prefill_topk=pre, decode_topk=dec)


def _cum(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def _json_file(path: Path):
    if path.stat().st_size > 256 << 20:
        raise ValueError(f"{path}: larger than 256 MiB, refused")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


# -- the generic layout ----------------------------------------------------------------------
@dataclass
class _Request:
    """What the generic readers gather for one request."""

    rows: dict = field(default_factory=lambda: {"prefill": {}, "decode": {}})
    tokens: dict = field(default_factory=lambda: {"prefill": {}, "decode": {}})
    prompt_tokens: list | None = None
    prompt_len: int | None = None
    domain: str | None = None


@dataclass
class GenericOptions:
    """What a generic file cannot say for itself (``eldr import`` options), each
    overridable by the file's header."""

    model: str = "unknown"
    num_experts: int | None = None  # default: 1 + the largest expert id seen
    licence: str = ""
    source: str = ""  # where the routing came from (a URL, a commit)
    block_size: int = 16


def _int(value, what: str, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{where}: {what} must be an integer >= {lo}, got {value!r}")
    return value


def read_generic_jsonl(path: str | os.PathLike, options: GenericOptions | None = None
                       ) -> Trace:
    """A trace from the generic JSON-lines layout (docs/trace-format.md): per token (and
    layer) ``{"request", "phase", "layer"?, "experts", "weights"?, "token"?,
    "position"?}``, per request ``{"request", "prompt_len"?, "prompt_tokens"?,
    "domain"?}``, optionally a first ``{"eldr_import": 1, ...}`` header."""
    path = Path(path)
    opts = GenericOptions() if options is None else options
    if path.stat().st_size > _MAX_INPUT_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_INPUT_BYTES >> 30} GiB, refused")
    requests: dict = {}
    header: dict = {}
    shape: dict = {}  # "L" (layers), "k"
    with open(path, encoding="utf-8", errors="strict") as fh:
        try:
            for lineno, line in enumerate(fh, start=1):
                where = f"{path}:{lineno}"
                if len(line) > _MAX_JSONL_LINE:
                    raise ValueError(f"{where}: line longer than {_MAX_JSONL_LINE} characters")
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{where}: each line must be a JSON object")
                if "eldr_import" in rec:
                    if lineno != 1 and requests:
                        raise ValueError(f"{where}: the header must be the first line")
                    header = rec
                    continue
                _generic_record(rec, requests, shape, where)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    return _build_generic(requests, shape, header, opts, str(path), "jsonl")


def _generic_record(rec: dict, requests: dict, shape: dict, where: str) -> None:
    rid = rec.get("request")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"{where}: 'request' (a string or integer id) is required")
    req = requests.setdefault(rid, _Request())
    if "phase" not in rec:  # a per-request record
        unknown = set(rec) - {"request", "prompt_len", "prompt_tokens", "domain"}
        if unknown:
            raise ValueError(f"{where}: a record without 'phase' describes a request and may "
                             f"hold only prompt_len, prompt_tokens, domain; got {sorted(unknown)}")
        if "prompt_len" in rec:
            req.prompt_len = _int(rec["prompt_len"], "prompt_len", where)
        if "prompt_tokens" in rec:
            toks = rec["prompt_tokens"]
            if not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks):
                raise ValueError(f"{where}: prompt_tokens must be a list of non-negative "
                                 "integers")
            req.prompt_tokens = toks
        if "domain" in rec:
            if not isinstance(rec["domain"], str):
                raise ValueError(f"{where}: domain must be a string")
            req.domain = rec["domain"]
        return
    phase = rec["phase"]
    if phase not in ("prefill", "decode"):
        raise ValueError(f"{where}: phase must be 'prefill' or 'decode', got {phase!r}")
    unknown = set(rec) - {"request", "phase", "layer", "experts", "weights", "token",
                          "position", "domain"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
    experts = rec.get("experts")
    if "layer" in rec:  # one record per token and layer
        layer = _int(rec["layer"], "layer", where)
        ids = _id_list(experts, where)
        per_layer = {layer: ids}
        k = len(ids)
    else:  # one record per token, all layers
        if not isinstance(experts, list) or not experts:
            raise ValueError(f"{where}: 'experts' must be a list of k ids (with 'layer') or "
                             "a list of L lists of k ids (without)")
        per_layer = {i: _id_list(e, where) for i, e in enumerate(experts)}
        k = len(per_layer[0])
        shape.setdefault("L", len(per_layer))
        if len(per_layer) != shape["L"]:
            raise ValueError(f"{where}: {len(per_layer)} layers, earlier records had "
                             f"{shape['L']}")
    shape.setdefault("k", k)
    if any(len(v) != shape["k"] for v in per_layer.values()):
        raise ValueError(f"{where}: {k} experts per layer, earlier records had {shape['k']}")
    if "weights" in rec:  # checked, not kept (nothing in eldr reads them)
        w = rec["weights"]
        rows_w = [w] if "layer" in rec else w
        if not isinstance(rows_w, list) or len(rows_w) != len(per_layer) or not all(
                isinstance(row, list) and len(row) == shape["k"] and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool)
                    and np.isfinite(x) for x in row) for row in rows_w):
            raise ValueError(f"{where}: weights must be finite numbers shaped like 'experts'")
    rows = req.rows[phase]
    if "position" in rec:
        pos = _int(rec["position"], "position", where)
    else:  # order of appearance of this layer's records
        first_layer = next(iter(per_layer))
        pos = sum(1 for r in rows.values() if first_layer in r)
    slot = rows.setdefault(pos, {})
    for layer, ids in per_layer.items():
        if layer in slot:
            raise ValueError(f"{where}: request {rid!r} {phase} token {pos} layer {layer} "
                             "given twice")
        slot[layer] = ids
    if "token" in rec:
        req.tokens[phase][pos] = _int(rec["token"], "token", where)
    if "domain" in rec:
        if not isinstance(rec["domain"], str):
            raise ValueError(f"{where}: domain must be a string")
        req.domain = rec["domain"]


def _id_list(ids, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(
            isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise ValueError(f"{where}: experts must be a non-empty list of non-negative integer "
                         "ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: an expert is selected twice in one layer")
    return ids


def _generic_shape(requests: dict, shape: dict, header: dict, opts: GenericOptions,
                   where: str) -> dict:
    """Model, L, E, k, licence and block size of a generic file: its header over the
    command's options, the rest from the records."""
    if not requests:
        raise ValueError(f"{where}: no routing records")
    known_header = {"eldr_import", "model", "num_experts", "licence", "source", "block_size",
                    "provenance"}
    bad = set(header) - known_header
    if bad:
        raise ValueError(f"{where}: unknown header key(s) {sorted(bad)}")
    k = shape.get("k")
    if not k:
        raise ValueError(f"{where}: no routing records (only per-request records)")
    slots = [slot for q in requests.values() for ph in q.rows.values() for slot in ph.values()]
    L = shape.get("L")
    if L is None:  # per-layer records: the layers seen
        L = 1 + max(layer for slot in slots for layer in slot)
    ids_seen = max(max(max(v) for v in slot.values()) for slot in slots)
    num_experts = header.get("num_experts", opts.num_experts)
    num_experts = _int(ids_seen + 1 if num_experts is None else num_experts, "num_experts",
                       where, lo=1)
    if ids_seen >= num_experts:
        raise ValueError(f"{where}: expert id {ids_seen} but num_experts = {num_experts}")
    return {"model": str(header.get("model", opts.model)), "L": int(L), "k": int(k),
            "E": num_experts, "licence": str(header.get("licence", opts.licence)),
            "block": header.get("block_size", opts.block_size),
            "source": header.get("source", opts.source)}


def _generic_arrays(requests: dict, L: int, k: int, has_prefill: bool, where: str) -> dict:
    """Per-request lengths and concatenated per-token arrays of the generic records."""
    pre_parts, dec_parts, pre_lens, out_lens, prompt_ids, dec_ids = [], [], [], [], [], []
    keep_prompt_ids = keep_dec_ids = True
    for rid, q in requests.items():
        pre = _stack(q.rows["prefill"], L, k, rid, "prefill", where)
        dec = _stack(q.rows["decode"], L, k, rid, "decode", where)
        if has_prefill:
            plen = pre.shape[0]
            if q.prompt_len is not None and q.prompt_len != plen:
                raise ValueError(f"{where}: request {rid!r}: prompt_len {q.prompt_len} but "
                                 f"{plen} prefill tokens")
        else:
            plen = q.prompt_len if q.prompt_len is not None else (
                len(q.prompt_tokens) if q.prompt_tokens is not None else None)
            if plen is None:
                raise ValueError(f"{where}: request {rid!r}: a decode-only request needs "
                                 "prompt_len or prompt_tokens (the real prompt length)")
        ptoks = q.prompt_tokens
        if ptoks is None and has_prefill and len(q.tokens["prefill"]) == plen:
            ptoks = [q.tokens["prefill"][i] for i in range(plen)]
        if ptoks is not None and len(ptoks) != plen:
            raise ValueError(f"{where}: request {rid!r}: {len(ptoks)} prompt tokens, prompt "
                             f"length {plen}")
        keep_prompt_ids &= ptoks is not None
        if keep_prompt_ids:
            prompt_ids.append(np.asarray(ptoks, dtype=np.int64))
        dt = q.tokens["decode"]
        keep_dec_ids &= len(dt) == dec.shape[0]
        if keep_dec_ids:
            dec_ids.append(np.asarray([dt[i] for i in range(dec.shape[0])], dtype=np.int64))
        pre_parts.append(pre)
        dec_parts.append(dec)
        pre_lens.append(plen)
        out_lens.append(dec.shape[0] + 1)
    return {"prompt_lens": np.asarray(pre_lens, dtype=np.int64),
            "output_lens": np.asarray(out_lens, dtype=np.int64),
            "prefill_topk": np.concatenate(pre_parts).astype(np.int16) if has_prefill
            else None,
            "decode_topk": np.concatenate(dec_parts).astype(np.int16),
            "prompt_token_ids": np.concatenate(prompt_ids).astype(np.int32)
            if keep_prompt_ids and prompt_ids else None,
            "decode_token_ids": np.concatenate(dec_ids).astype(np.int32)
            if keep_dec_ids and dec_ids else None}


def _build_generic(requests: dict, shape: dict, header: dict, opts: GenericOptions,
                   where: str, layout: str) -> Trace:
    m = _generic_shape(requests, shape, header, opts, where)
    with_prefill = [bool(q.rows["prefill"]) for q in requests.values()]
    has_prefill = all(with_prefill)
    if any(with_prefill) and not has_prefill:
        first = next(rid for rid, q in requests.items() if not q.rows["prefill"])
        raise ValueError(f"{where}: request {first!r} has no prefill records while others do "
                         "(a trace is either all with prefill routing or decode-only)")
    arrays = _generic_arrays(requests, m["L"], m["k"], has_prefill, where)
    domains = names = None
    labels = [q.domain for q in requests.values()]
    if any(d is not None for d in labels):
        if any(d is None for d in labels):
            raise ValueError(f"{where}: some requests have a domain and others not")
        names = tuple(sorted(set(labels)))
        domains = np.array([names.index(d) for d in labels], dtype=np.int32)
    order = list(requests)
    prov = {"conversion": f"eldr import --layout {layout}: decode records = decode steps "
                          "(the first output token from prefill), output_lens = steps + 1",
            "input": Path(where).name, "requests": ", ".join(map(str, order[:3]))
            + (", ..." if len(order) > 3 else "")}
    if m["source"]:
        prov["source"] = str(m["source"])
    extra = header.get("provenance")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ValueError(f"{where}: header provenance must be an object")
        prov.update(extra)
    E = m["E"]
    try:
        meta = TraceMeta(model=m["model"], num_layers=m["L"], num_experts=E, top_k=m["k"],
                         block_size=m["block"], source=f"imported:{layout}",
                         licence=m["licence"], provenance=prov)
        pre = arrays["prefill_topk"]
        return Trace(meta=meta,
                     prefill_counts=None if pre is None else
                     counts_of(pre, _cum(arrays["prompt_lens"]), E),
                     decode_counts=counts_of(arrays["decode_topk"],
                                             _cum(arrays["output_lens"] - 1), E),
                     domains=domains, domain_names=names, **arrays)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _stack(rows: dict, L: int, k: int, rid, phase: str, where: str) -> np.ndarray:
    """(n, L, k) ids of one request's tokens of one phase; positions must be 0 .. n − 1
    with every layer present."""
    n = len(rows)
    out = np.empty((n, L, k), dtype=np.int64)
    if n and sorted(rows) != list(range(n)):
        raise ValueError(f"{where}: request {rid!r} {phase} positions are not 0..{n - 1}")
    for pos in range(n):
        slot = rows[pos]
        if len(slot) != L or set(slot) != set(range(L)):
            missing = sorted(set(range(L)) - set(slot))
            raise ValueError(f"{where}: request {rid!r} {phase} token {pos} lacks layer(s) "
                             f"{missing[:5]}")
        for layer, ids in slot.items():
            out[pos, layer] = ids
    return out


def _npz_phase(a: dict, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(experts (N, L, k), is-decode (N,) bool, token ids (N,) or None), checked."""
    experts = np.asarray(a["experts"])
    if experts.ndim != 3 or experts.shape[0] == 0:
        raise ValueError(f"{path}: experts must be (N, L, k) with N >= 1, got {experts.shape}")
    N = experts.shape[0]
    if not np.issubdtype(experts.dtype, np.integer) or experts.min() < 0:
        raise ValueError(f"{path}: experts must be non-negative integer ids")
    s = np.sort(experts, axis=2)
    if (s[:, :, 1:] == s[:, :, :-1]).any():
        raise ValueError(f"{path}: a token selects the same expert twice in one layer")
    phase = np.asarray(a["phase"])
    if np.shape(a["request"]) != (N,) or phase.shape != (N,):
        raise ValueError(f"{path}: request and phase must be ({N},) like experts' rows")
    if phase.dtype.kind in "US":
        bad_phase = ~np.isin(phase, ["prefill", "decode"])
        if bad_phase.any():
            raise ValueError(f"{path}: phase must be 'prefill' or 'decode', got "
                             f"{phase[bad_phase][0]!r}")
        is_dec = phase == "decode"
    elif np.issubdtype(phase.dtype, np.integer) and np.isin(phase, [0, 1]).all():
        is_dec = phase == 1
    else:
        raise ValueError(f"{path}: phase must be 0 (prefill) / 1 (decode) or the strings")
    if "weights" in a and (np.shape(a["weights"]) != experts.shape
                           or not np.isfinite(np.asarray(a["weights"], dtype=float)).all()):
        raise ValueError(f"{path}: weights must be finite and shaped like experts")
    tok = a.get("token")
    if tok is not None and (np.shape(tok) != (N,) or not np.issubdtype(
            np.asarray(tok).dtype, np.integer) or np.asarray(tok).min() < 0):
        raise ValueError(f"{path}: token must be ({N},) non-negative integers")
    return experts, is_dec, tok


def _npz_per_request(a: dict, req: np.ndarray, path: Path) -> tuple[list, dict, list | None]:
    """(request order, per-request arrays, prompt token lists or None), checked."""
    if req.dtype.kind not in "iuUS":
        raise ValueError(f"{path}: request ids must be integers or strings")
    if "request_ids" in a:
        order = [x.item() for x in np.asarray(a["request_ids"])]
        if len(set(order)) != len(order):
            raise ValueError(f"{path}: request_ids repeat an id")
        missing = set(req.tolist()) - set(order)
        if missing:
            raise ValueError(f"{path}: rows name request {sorted(missing)[0]!r}, not in "
                             "request_ids")
    else:
        _, first = np.unique(req, return_index=True)
        order = [req[i].item() for i in np.sort(first)]
    R = len(order)
    per_req = {}
    for name in ("prompt_lens", "domains"):
        if name in a:
            arr = np.asarray(a[name])
            if arr.shape != (R,):
                raise ValueError(f"{path}: {name} must be ({R},), one per request")
            per_req[name] = arr
    if "prompt_lens" in per_req and (not np.issubdtype(per_req["prompt_lens"].dtype,
                                                       np.integer)
                                     or per_req["prompt_lens"].min() < 0):
        raise ValueError(f"{path}: prompt_lens must be non-negative integers")
    prompt_tokens = None
    if "prompt_tokens" in a:
        if "prompt_token_offsets" not in a:
            raise ValueError(f"{path}: prompt_tokens needs prompt_token_offsets (R + 1,)")
        pt = np.asarray(a["prompt_tokens"])
        po = _offsets(a["prompt_token_offsets"], pt.size, f"{path} prompt_token_offsets")
        if po.size != R + 1 or not np.issubdtype(pt.dtype, np.integer) or (
                pt.size and pt.min() < 0):
            raise ValueError(f"{path}: prompt_tokens must be non-negative integers with "
                             f"{R} + 1 offsets")
        prompt_tokens = [pt[po[i]:po[i + 1]].tolist() for i in range(R)]
    return order, per_req, prompt_tokens


def read_generic_npz(path: str | os.PathLike, options: GenericOptions | None = None
                     ) -> Trace:
    """A trace from the generic NPZ layout (docs/trace-format.md): per token row
    ``request`` (N,) ids, ``phase`` (N,) 0/1 or "prefill"/"decode", ``experts`` (N, L, k),
    optional ``token`` (N,), ``weights`` (N, L, k); per request (R,) optional
    ``request_ids``, ``prompt_lens``, ``domains``, and ``prompt_tokens`` with
    ``prompt_token_offsets`` (R + 1,); rows of one request and phase in token order."""
    path = Path(path)
    opts = GenericOptions() if options is None else options
    a = _npz(path, str(path))
    _need(a, ("request", "phase", "experts"), path)
    known = {"request", "phase", "experts", "token", "weights", "request_ids", "prompt_lens",
             "domains", "prompt_tokens", "prompt_token_offsets"}
    bad = set(a) - known
    if bad:
        raise ValueError(f"{path}: unknown array(s) {sorted(bad)}")
    experts, is_dec, tok = _npz_phase(a, path)
    L, k = experts.shape[1:]
    req = np.asarray(a["request"])
    order, per_req, prompt_tokens = _npz_per_request(a, req, path)
    index = {rid: i for i, rid in enumerate(order)}
    rows_of: list[list[int]] = [[] for _ in order]
    for i, rid in enumerate(req.tolist()):
        rows_of[index[rid]].append(i)
    requests: dict = {}
    for i, rid in enumerate(order):
        q = _Request()
        rows = np.asarray(rows_of[i], dtype=np.int64)
        for ph, mask in (("prefill", ~is_dec[rows]), ("decode", is_dec[rows])):
            sel = rows[mask]
            q.rows[ph] = {p: {layer: experts[r, layer].tolist() for layer in range(L)}
                          for p, r in enumerate(sel)}
            if tok is not None:
                q.tokens[ph] = {p: int(tok[r]) for p, r in enumerate(sel)}
        if "prompt_lens" in per_req:
            q.prompt_len = int(per_req["prompt_lens"][i])
        if prompt_tokens is not None:
            q.prompt_tokens = prompt_tokens[i]
        if "domains" in per_req:
            q.domain = str(per_req["domains"][i])
        requests[rid] = q
    return _build_generic(requests, {"L": L, "k": k}, {}, opts, str(path), "npz")


# -- dispatch --------------------------------------------------------------------------------
def detect_layout(path: str | os.PathLike) -> str:
    """The layout of ``path``: a folder with ``tokens.npz`` is ``gpt-oss``, a folder or an
    ``.npz`` whose arrays are ``expert_ids`` and ``offsets`` ``esft``, another ``.npz``
    ``npz``, a ``.jsonl`` / ``.json`` file ``jsonl``."""
    p = Path(path)
    if p.is_dir():
        if (p / "tokens.npz").is_file() and (p / "routing.npz").is_file():
            return "gpt-oss"
        if (p / "routing.npz").is_file():
            return "esft"
        raise ValueError(f"{p}: a folder without routing.npz: not a known layout (give a file, "
                         "or --layout)")
    if not p.exists():
        raise ValueError(f"{p}: no such file or folder")
    name = p.name.lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".npz"):
        try:
            with np.load(p, allow_pickle=False) as z:
                files = set(z.files)
        except Exception as exc:
            raise ValueError(f"{p}: not a readable .npz ({type(exc).__name__})") from None
        if {"expert_ids", "offsets"} <= files and "request" not in files:
            return "esft"
        return "npz"
    raise ValueError(f"{p}: unknown layout (a .jsonl or .npz file, or a recording folder; "
                     "or say --layout)")


def import_trace(path: str | os.PathLike, *, layout: str = "auto",
                 split: float = ESFT_DEFAULT_SPLIT,
                 options: GenericOptions | None = None) -> Trace:
    """Convert ``path`` (``layout`` one of :data:`LAYOUTS`; ``auto`` detects it)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such file or folder")
    if layout == "auto":
        layout = detect_layout(p)
    if layout == "gpt-oss":
        return import_gpt_oss(p)
    if layout == "esft":
        return import_esft(p, split=split)
    if p.is_dir():
        raise ValueError(f"{p}: the {layout} layout is one file, not a folder")
    if layout == "jsonl":
        return read_generic_jsonl(p, options)
    return read_generic_npz(p, options)
