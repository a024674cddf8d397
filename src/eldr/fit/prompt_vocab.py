"""Which tokenizer and vocabulary a prompt predictor belongs to (:mod:`eldr.fit.prompt`).

A predictor's token ids come from one tokenizer: :func:`tokenizer_fingerprint` names it
(SHA-256 of its ``tokenizer.json``), :func:`tokenizer_vocab_size` and
:func:`config_vocab_size` (the model's ``config.json``) give a real vocabulary, and
:data:`VOCAB_SOURCES` says where a predictor's ``vocab_size`` came from: a ``tokenizer``'s
or a ``config``'s vocabulary refuses ids outside it; ``calibration`` (neither was given)
only records 1 + the largest id the calibration held, and a later larger id is hashed like
any other (up to :data:`MAX_TOKEN_ID`, the feature hash's range).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["MAX_TOKEN_ID", "VOCAB_SOURCES", "config_vocab_size", "resolve_vocab_source",
           "tokenizer_fingerprint", "tokenizer_vocab_size"]

MAX_TOKEN_ID = 1 << 31  # ids the feature hash takes (a bigram key holds two below 2**32)
_MAX_TOKENIZER_BYTES = 256 << 20
_MAX_CONFIG_BYTES = 4 << 20
# where a predictor's vocab_size comes from: a tokenizer's or a model config's vocabulary
# (ids outside it refused), or the calibration's largest id (ids beyond it hashed)
VOCAB_SOURCES = ("tokenizer", "config", "calibration")


def _tokenizer_bytes(source: str | os.PathLike | bytes) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    path = Path(source)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path}: no tokenizer.json there")
    if path.stat().st_size > _MAX_TOKENIZER_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_TOKENIZER_BYTES >> 20} MiB, refused")
    return path.read_bytes()


def tokenizer_fingerprint(tokenizer_json_path_or_bytes: str | os.PathLike | bytes) -> str:
    """SHA-256 (hex) of a tokenizer's ``tokenizer.json`` bytes: a file, a model folder
    holding one, or the bytes themselves. Two tokenizers with the same file map text to
    the same ids; any change to the file (vocabulary, merges, normaliser) changes it."""
    return hashlib.sha256(_tokenizer_bytes(tokenizer_json_path_or_bytes)).hexdigest()


def tokenizer_vocab_size(tokenizer_json_path_or_bytes: str | os.PathLike | bytes) -> int:
    """1 + the largest token id of a ``tokenizer.json`` (model vocabulary and added
    tokens): every id that tokenizer can produce is below it."""
    raw = _tokenizer_bytes(tokenizer_json_path_or_bytes)
    try:
        doc = json.loads(raw.decode("utf-8"))
        vocab = doc.get("model", {}).get("vocab", {})
        if isinstance(vocab, dict):
            ids = [int(v) for v in vocab.values()]
        else:  # Unigram: a list of [piece, score], the id is the position
            ids = [len(vocab) - 1] if vocab else []
        ids += [int(t["id"]) for t in doc.get("added_tokens", []) or []]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, KeyError,
            ValueError) as exc:
        raise ValueError(f"not a readable tokenizer.json ({exc})") from None
    if not ids or min(ids) < 0:
        raise ValueError("tokenizer.json has no vocabulary")
    return max(ids) + 1


def config_vocab_size(config: str | os.PathLike | dict) -> int:
    """``vocab_size`` of a model's Hugging Face ``config.json``: a file, a model folder
    holding one, or the parsed document (a multimodal config's ``text_config`` read for
    the language model's). Every token id the model embeds is below it; ValueError naming
    the problem otherwise."""
    where = "config"
    if isinstance(config, dict):
        doc = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        if not path.is_file():
            raise ValueError(f"{path}: no config.json there")
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: larger than {_MAX_CONFIG_BYTES >> 20} MiB, refused")
        try:
            doc = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a config.json must be a JSON object")
    text = doc.get("text_config")
    v = doc.get("vocab_size")
    if v is None and isinstance(text, dict):
        v = text.get("vocab_size")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_TOKEN_ID:
        raise ValueError(f"{where}: vocab_size must be an integer in [1, 2**31], got {v!r}")
    return v


def resolve_vocab_source(source: str | None, vocab_size: int | None, fingerprint: str) -> str:
    """The fit's ``vocab_source`` checked, or its default: ``tokenizer`` with a known
    tokenizer, else ``calibration`` (``config`` is always said by the caller)."""
    if source is None:
        return "tokenizer" if fingerprint else "calibration"
    if source not in VOCAB_SOURCES:
        raise ValueError(f"vocab_source must be one of {VOCAB_SOURCES}, got {source!r}")
    if source != "calibration" and vocab_size is None:
        raise ValueError(f"vocab_source={source!r} needs that vocabulary's vocab_size")
    return source
