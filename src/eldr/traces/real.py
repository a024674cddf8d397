"""The real routing shipped with eldr: two public recordings of production-size MoE models,
converted by ``eldr import`` (``data/real_routing/README.md`` names sources, commits and
licences; docs/real-models.md what they show).

- ``gpt-oss-20b``: openai/gpt-oss-20b (24 MoE layers, 32 experts, top-4), 620 requests,
  decode routing only (a version 2 decode-only trace) with the prompts' token ids and the
  token read at each decode step; domains = benchmark family.
- ``esft-vanilla-lite``: deepseek-ai/ESFT-vanilla-lite, the DeepSeek-V2-Lite architecture
  (26 MoE layers, 64 routed experts, top-6), 143 teacher-forced chat sequences, the first
  half of each as its prompt (``--split 0.5``); domains = task; no token ids.
"""

from __future__ import annotations

from pathlib import Path

from eldr.traces.trace import Trace, load

__all__ = ["REAL_TRACES", "load_real_trace", "real_trace_path"]

_DIR = Path(__file__).resolve().parent.parent / "data" / "real_routing"
REAL_TRACES = ("gpt-oss-20b", "esft-vanilla-lite")  # the names real_trace_path takes


def real_trace_path(name: str) -> Path:
    """Path of a shipped real-routing trace (``.npz``): ``name`` one of :data:`REAL_TRACES`."""
    if name not in REAL_TRACES:
        raise ValueError(f"unknown real trace {name!r}; choose one of {', '.join(REAL_TRACES)}")
    path = _DIR / f"{name}.npz"
    if not path.is_file():
        raise ValueError(f"the real trace {name!r} is not installed at {path} (rebuild it "
                         "with scripts/make_real_traces.py)")
    return path


def load_real_trace(name: str) -> Trace:
    """The shipped real-routing trace ``name``, loaded (:func:`real_trace_path`)."""
    return load(real_trace_path(name))
