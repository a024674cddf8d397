"""The paper's two request mixes: ``task`` (four sharp domains) and ``language`` (chat).

A :class:`Workload` says which domains requests come from and in what shares, how many
requests a run has by default, and how long prompts and outputs are. The domain shares
come from the paper (docs/method.md#results-to-reproduce): ``task`` has four domains
whose largest/smallest share ratio is 1.41; ``language`` is WildChat-like, the top two
languages carry ≈75% of requests and the top four 87.6%.

Length distributions are NOT published by the paper; the defaults below are assumptions
chosen to be typical of the source datasets (short task prompts and answers, chat with
short prompts and longer answers) and modest enough that per-token top-k traces of ≈10k
requests stay within a few GB. They are configurable: build a new workload with
``dataclasses.replace(WORKLOADS["task"], prompt_len=LengthDist(...))``. Note that the
prefill↔decode Pearson premise depends on the lengths (fewer tokens = noisier counts), so
the generator's calibration (``eldr.traces.synth``) holds for these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WORKLOADS", "LengthDist", "Workload", "get_workload"]


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: lognormal with the given median and log-space sigma, rounded, clipped.

    ``sample`` draws ``round(median * exp(sigma * N(0, 1)))`` clipped to ``[low, high]``.
    """

    median: float  # median length in tokens (before clipping)
    sigma: float  # standard deviation of log(length); 0 gives a constant length
    low: int  # smallest length (inclusive)
    high: int  # largest length (inclusive)

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"LengthDist: median must be > 0, got {self.median!r}")
        if not self.sigma >= 0:
            raise ValueError(f"LengthDist: sigma must be >= 0, got {self.sigma!r}")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"LengthDist: need 0 <= low <= high, got low={self.low!r} "
                             f"high={self.high!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) int64 lengths."""
        x = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)

    def mean(self) -> float:
        """Mean of the unclipped lognormal (a planning figure for memory and time)."""
        return float(self.median * np.exp(self.sigma**2 / 2))


@dataclass(frozen=True)
class Workload:
    """A request mix. Validated on construction; pass it whole to the generator."""

    name: str  # workload key, e.g. "task"
    domain_names: tuple[str, ...]  # domain labels (task domains or languages)
    domain_weights: tuple[float, ...]  # request share of each domain, sums to 1
    num_requests: int  # default number of requests of a run
    prompt_len: LengthDist  # user part of the prompt (a shared prefix adds to it)
    output_len: LengthDist  # generated tokens, >= 1 (the first comes out of prefill)
    domain_sharpness: str  # "sharp" (task labels align with experts) or "soft" (languages)
    shared_prefix_prob: float = 0.5  # chance a request starts with a shared system prompt
    shared_prefixes_per_domain: int = 2  # distinct system prompts of each domain
    shared_prefix_blocks: tuple[int, int] = (1, 4)  # system prompt length in KV blocks, range

    def __post_init__(self) -> None:
        n = len(self.domain_names)
        if n == 0 or len(set(self.domain_names)) != n:
            raise ValueError(f"workload {self.name!r}: domain_names must be unique and "
                             f"non-empty, got {self.domain_names!r}")
        w = np.asarray(self.domain_weights, dtype=np.float64)
        if w.shape != (n,) or (w <= 0).any() or abs(w.sum() - 1.0) > 1e-6:
            raise ValueError(f"workload {self.name!r}: domain_weights must be {n} positive "
                             f"shares summing to 1, got {self.domain_weights!r}")
        if self.num_requests <= 0:
            raise ValueError(f"workload {self.name!r}: num_requests must be positive, "
                             f"got {self.num_requests!r}")
        if self.output_len.low < 1:
            raise ValueError(f"workload {self.name!r}: output lengths must be >= 1, got "
                             f"low={self.output_len.low}")
        if self.domain_sharpness not in ("sharp", "soft"):
            raise ValueError(f"workload {self.name!r}: domain_sharpness must be 'sharp' or "
                             f"'soft', got {self.domain_sharpness!r}")
        if not 0.0 <= self.shared_prefix_prob <= 1.0:
            raise ValueError(f"workload {self.name!r}: shared_prefix_prob must be in [0, 1], "
                             f"got {self.shared_prefix_prob!r}")
        if self.shared_prefixes_per_domain < 1:
            raise ValueError(f"workload {self.name!r}: shared_prefixes_per_domain must be "
                             f">= 1, got {self.shared_prefixes_per_domain!r}")
        lo, hi = self.shared_prefix_blocks
        if not 1 <= lo <= hi:
            raise ValueError(f"workload {self.name!r}: shared_prefix_blocks must be "
                             "(low, high) with 1 <= low <= high, got "
                             f"{self.shared_prefix_blocks!r}")

    @property
    def num_domains(self) -> int:
        return len(self.domain_names)

    def sample_domains(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n,) int32 domain labels drawn with the workload's shares."""
        return rng.choice(self.num_domains, size=n, p=np.asarray(self.domain_weights)).astype(
            np.int32
        )


def _normalised(raw: list[float]) -> tuple[float, ...]:
    total = sum(raw)
    return tuple(x / total for x in raw)


# task: code / math / medical / legal (paper §3.2/§6). Shares are 1.41 : 1.25 : 1.12 : 1 so
# that largest / smallest = 1.41 exactly; the middle two are interpolated (assumed).
# Lengths (assumed): task prompts are questions or snippets (median 160 tokens), answers
# median 128 tokens.
_TASK = Workload(
    name="task",
    domain_names=("code", "math", "medical", "legal"),
    domain_weights=_normalised([1.41, 1.25, 1.12, 1.0]),
    num_requests=12_000,  # paper: ≈12k requests
    prompt_len=LengthDist(median=160, sigma=0.7, low=8, high=2048),
    output_len=LengthDist(median=128, sigma=0.8, low=2, high=1024),
    domain_sharpness="sharp",
)

# language: WildChat-like (paper §3.5.2 Fig. 5): top-2 languages ≈75% of traffic, top-4
# 87.6%. English 52.5% + Chinese 22.5% = 75%; + Russian 7.6% + French 5% = 87.6%. The
# remaining 12.4% is a tail of eight languages with geometrically decaying shares (assumed).
_TAIL = ("spanish", "german", "portuguese", "japanese", "korean", "italian", "arabic",
         "turkish")
_TAIL_RAW = [0.75**i for i in range(len(_TAIL))]
_LANGUAGE = Workload(
    name="language",
    domain_names=("english", "chinese", "russian", "french", *_TAIL),
    domain_weights=_normalised(
        [0.525, 0.225, 0.076, 0.050] + [0.124 * x / sum(_TAIL_RAW) for x in _TAIL_RAW]
    ),
    num_requests=14_000,  # paper: ≈14k requests
    # chat (assumed): short prompts (median 96, wide spread), longer answers (median 192)
    prompt_len=LengthDist(median=96, sigma=1.0, low=4, high=2048),
    output_len=LengthDist(median=192, sigma=0.8, low=2, high=1536),
    domain_sharpness="soft",
)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (_TASK, _LANGUAGE)}


def get_workload(name: str | Workload) -> Workload:
    """The workload called ``name``; a :class:`Workload` passes through unchanged."""
    if isinstance(name, Workload):
        return name
    key = str(name).strip().lower()
    if key not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}")
    return WORKLOADS[key]
