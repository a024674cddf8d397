"""Simulator configuration: hardware presets and the frozen, validated :class:`SimConfig`.

Hardware presets hold what a decode or prefill step costs on one GPU; the MoE-layer
constants ``a`` (fixed µs per layer) and ``b`` (µs per distinct expert) are per model, so
:func:`moe_constants` resolves them for a (hardware, model) pair.

The figures behind every preset (fits, derivations, the resulting step times) are in
docs/simulator.md, "Hardware presets" and "The tiny-MoE CPU preset", and
docs/method.md#h200-constants, with how and when each was measured; here, what kind each
constant is.

H200 (``h200``). ``a`` and ``b`` are the measured fused-MoE fits of docs/method.md#h200-constants
(stored in the model presets). HBM bandwidth 4.8 TB/s, 141 GB HBM3e, 989 TFLOPS dense bf16.
``t_fixed`` = 2.0 ms per step is an ASSUMPTION: everything in a decode step that is neither
a routed-expert GEMM nor a weight/KV read — attention/norm/rotary kernels at small batch,
sampling, the scheduler and the CPU↔GPU sync under CUDA graphs; with it a batch-1
Qwen3-30B-A3B step lands in line with public single-stream reports for this model on
H100/H200 (docs/simulator.md). It dilutes every relative TPOT gain, so it is a CLI option
(``--t-fixed-ms``).

H100 (``h100``, H100 SXM 80 GB). The same GH100 chip as the H200 with HBM3 at 3.35 TB/s
instead of HBM3e at 4.8 TB/s, 80 GB. What CARRIES OVER from the H200: the dense bf16 peak
(989 TFLOPS, the same tensor cores), ``t_fixed`` = 2.0 ms (the same ASSUMPTION: kernels,
sampling and scheduling of the same chip and stack) and each measured fit's ``a`` (the
per-layer launch and routing overhead, not a weight read). What is DERIVED from bandwidth:
each measured ``b`` × 4.8 / 3.35 (an expert's weights are streamed at the HBM rate, the
kernel's efficiency assumed equal), and every weight and KV read of the step model (they
divide by the preset's bandwidth). Models without a fit get the derived constants below at
3.35 TB/s. No H100 measurement backs any of it: ``eldr calibrate`` on a real H100 replaces it.

MI300X (``mi300x``). No measured fits are published here, so the constants are DERIVED:
``b`` = bytes of one expert / (5.3 TB/s × η), with η (:data:`_ETA`) the bandwidth
efficiency the H200 fit implies for Qwen3-30B-A3B (its expert's bytes read at 4.8 TB/s
against the fitted ``b``). ``a`` comes from the paper's microbenchmark (Fig. 2): 16 → 128
active experts makes an MoE layer 4.7× slower, so (a + 128 b) / (a + 16 b) = 4.7, i.e.
a = (128 − 4.7·16) / 3.7 · b. ``t_fixed`` = 3.0 ms (ASSUMED; ROCm launch and sync
overheads are larger). 192 GB HBM3, 1307 TFLOPS dense bf16.

A model preset without a measured fit (the shipped ``tiny-moe``) gets these DERIVED
constants on the H200 and the MI300X (``moe_constants``).

CPU (``cpu``). MEASURED on a 2-core x86 CPU of the project's CI machine (AMD EPYC, Zen 4,
KVM guest), one core (``taskset -c 1``), torch 2.13 with 1 thread, transformers 5.19
(``grouped_mm`` experts), fp32 as ``eldr capture`` runs it, 2026-11-30, by
benchmarks/bench_tiny_moe_step.py (docs/simulator.md#the-tiny-moe-cpu-preset). It holds
constants of ``tiny-moe`` ONLY, the one model that runs on that machine; any other model
is refused (:func:`moe_constants`) rather than given made-up numbers. ``a``, ``b``: the
least-squares fit ``a + b·D + c·B`` of one MoE layer (router + experts) over forced
(B, D) routings (the simulator has no per-token ``c`` term). ``hbm_bandwidth``: an
EFFECTIVE rate, KV bytes per context token / the measured decode step time per context
token (batch 1, 100 → 1000 tokens); the dense weights sit in cache, so ``dense/BW`` is no
physical read: it is folded back into ``t_fixed`` = measured batch-1 step (ctx 100) −
L(a + b·k) − dense/BW − KV/BW. ``peak_flops``: EFFECTIVE, chosen so that the default
``prefill_mfu`` 0.5 reproduces the measured prefill time per prompt token.
``hbm_bytes``: the machine's RAM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Hardware (the record) and A_OVER_B_MI300X live with the hardware files that build it
from eldr.sim.hardware import A_OVER_B_MI300X, Hardware, is_hardware_file, load_hardware
from eldr.traces.models import ModelPreset, get_preset

__all__ = ["A_OVER_B_MI300X", "HARDWARE", "Hardware", "SimConfig", "get_hardware",
           "moe_constants"]

# Bandwidth efficiency implied by the H200 Qwen3-30B fit: 9,437,184 B / 4.8e12 B/s / 2.22 µs.
_ETA = 9_437_184 / 4.8e12 / 2.22e-6  # = 0.886


HARDWARE: dict[str, Hardware] = {
    "h200": Hardware("h200", hbm_bandwidth=4.8e12, hbm_bytes=141e9, peak_flops=989e12,
                     t_fixed_s=2.0e-3, measured_moe=True),
    # H200 fits scaled to the H100's bandwidth (module docstring)
    "h100": Hardware("h100", hbm_bandwidth=3.35e12, hbm_bytes=80e9, peak_flops=989e12,
                     t_fixed_s=2.0e-3, measured_moe=True, fit_bandwidth=4.8e12),
    "mi300x": Hardware("mi300x", hbm_bandwidth=5.3e12, hbm_bytes=192e9, peak_flops=1307e12,
                       t_fixed_s=3.0e-3, measured_moe=False),
    # measured for tiny-moe only; each constant's measurement and arithmetic:
    # docs/simulator.md#the-tiny-moe-cpu-preset
    "cpu": Hardware("cpu", hbm_bandwidth=1.645e9,  # effective: KV bytes / time per ctx token
                    hbm_bytes=25.28e9,  # MemTotal of the machine, 24,684,084 kB
                    peak_flops=52.34e9,  # effective: gives back the prefill time per token
                    t_fixed_s=1.490e-3,  # the batch-1 step less the modelled terms
                    measured_moe=True,
                    moe_fits=(("tiny-moe", 301.46, 3.636),)),  # the a + b·D + c·B fit
}


def get_hardware(name: str | Hardware) -> Hardware:
    """The hardware preset ``name``, or the hardware file ``name`` when it is a path ending
    in ``.json`` (:func:`eldr.sim.hardware.load_hardware`, read on each call: a few
    hundred bytes); a :class:`Hardware` passes through."""
    if isinstance(name, Hardware):
        return name
    if is_hardware_file(name):
        return load_hardware(str(name).strip())
    key = str(name).strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(HARDWARE)}, "
                         "or a hardware file (.json, written by eldr calibrate)")
    return HARDWARE[key]


def moe_constants(hardware: Hardware, model: ModelPreset) -> tuple[float, float]:
    """(a, b) in SECONDS of one MoE layer, ``t = a + b·D``, for ``model`` on ``hardware``.

    A hardware with its own ``moe_fits`` (the ``cpu`` preset) resolves exactly those
    models and raises ``ValueError`` for any other. Otherwise: measured fits when the
    hardware has them and the preset carries them (``b`` scaled to this hardware's bandwidth
    when they were taken at another, ``Hardware.fit_bandwidth``), else ``b = expert_bytes /
    (bandwidth · η)`` and ``a = a_over_b · b`` (module docstring).
    """
    if hardware.moe_fits:
        for name, a_us, b_us in hardware.moe_fits:
            if name == model.name:
                return a_us * 1e-6, b_us * 1e-6
        fitted = ", ".join(name for name, _, _ in hardware.moe_fits)
        raise ValueError(f"hardware {hardware.name!r} has measured constants of {fitted} only, "
                         f"none of {model.name!r}; measure them on that machine (see "
                         "benchmarks/bench_tiny_moe_step.py) or pick another --hardware")
    if (hardware.measured_moe and model.moe_layer_fixed_us is not None
            and model.moe_layer_per_expert_us is not None):
        b = model.moe_layer_per_expert_us * 1e-6
        if hardware.fit_bandwidth is not None:  # fits taken at another bandwidth (h100)
            b *= hardware.fit_bandwidth / hardware.hbm_bandwidth
        return model.moe_layer_fixed_us * 1e-6, b
    b = model.expert_bytes / (hardware.hbm_bandwidth * _ETA)
    return hardware.a_over_b * b, b


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation run needs besides the trace and the policy.

    Times are seconds, bandwidths bytes/s. ``None`` for an override means "from the
    hardware / model preset". Validated on construction.
    """

    model: str = "qwen3-30b-a3b"  # model preset (weights, KV bytes, a, b)
    hardware: str = "h200"  # hardware preset
    num_prefill: int = 8  # prefill workers
    num_decode: int = 16  # decode workers (= routing targets K)
    qps: float = 20.0  # Poisson arrival rate, requests per second
    warmup_s: float = 30.0  # arrivals before this are simulated but not measured
    duration_s: float = 120.0  # measured window [warmup, warmup + duration) of arrivals
    seed: int = 0  # arrivals, request sampling and per-token expert draws
    # decode workers
    max_batch: int = 256  # max running requests per decode worker (vLLM max_num_seqs)
    max_batch_tokens: int = 8192  # token budget per step (a decode request uses 1)
    kv_capacity_tokens: int | None = None  # per decode worker; None: from HBM (see docs)
    gpu_memory_utilization: float = 0.9  # share of HBM for weights + KV
    tp: int = 1  # tensor parallel degree of a worker (dense + KV split across tp GPUs)
    ep: int = 1  # expert parallel ranks of a decode worker (tp x ep GPUs... see docs)
    # prefill workers
    prefill_max_batch_tokens: int = 8192  # prompt tokens per prefill step (whole requests)
    prefill_mfu: float = 0.5  # achieved share of peak FLOP/s in prefill
    affinity_blocks: int = 1  # prefix affinity key = hash of the first N full KV blocks
    spill_tokens: int = 8192  # spill to least loaded if the target holds this many more
    prefix_caching: bool = False  # prefill workers keep an LRU prefix cache of KV blocks
    prefix_cache_blocks: int = 65_536  # blocks of that cache per prefill worker
    signature_source: str = "trace"  # trace / fresh / sigcache (eldr.sim.signatures)
    # network
    link_bandwidth: float = 50e9  # KV transfer, B/s (400 Gb/s NDR InfiniBand per GPU)
    link_latency_s: float = 100e-6  # per transfer (handshake, NIXL metadata)
    # step-time overrides
    t_fixed_s: float | None = None  # per-step fixed overhead
    moe_a_s: float | None = None  # MoE layer fixed time a
    moe_b_s: float | None = None  # MoE layer time per distinct expert b
    hbm_bandwidth: float | None = None  # B/s for dense weights and KV reads

    def __post_init__(self) -> None:
        moe_constants(get_hardware(self.hardware), get_preset(self.model))  # may refuse
        for name in ("num_prefill", "num_decode", "max_batch", "max_batch_tokens", "tp", "ep",
                     "prefill_max_batch_tokens", "affinity_blocks", "prefix_cache_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SimConfig: {name} must be a positive integer, got {v!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"SimConfig: seed must be a non-negative integer, got {self.seed!r}")
        for name in ("qps", "duration_s", "link_bandwidth", "prefill_mfu",
                     "gpu_memory_utilization"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and v == v and v != float("inf")):
                raise ValueError(f"SimConfig: {name} must be finite and > 0, got {v!r}")
        for name in ("warmup_s", "link_latency_s", "spill_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < float("inf")):
                raise ValueError(f"SimConfig: {name} must be finite and >= 0, got {v!r}")
        if self.prefill_mfu > 1 or self.gpu_memory_utilization > 1:
            raise ValueError("SimConfig: prefill_mfu and gpu_memory_utilization must be <= 1")
        for name in ("t_fixed_s", "moe_a_s", "moe_b_s"):
            v = getattr(self, name)
            if v is not None and not (0 <= v < float("inf")):
                raise ValueError(f"SimConfig: {name} must be finite and >= 0, got {v!r}")
        if self.hbm_bandwidth is not None and not self.hbm_bandwidth > 0:
            raise ValueError(f"SimConfig: hbm_bandwidth must be > 0, got {self.hbm_bandwidth!r}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError("SimConfig: kv_capacity_tokens must be >= 1 or None, "
                             f"got {self.kv_capacity_tokens!r}")
        if self.signature_source not in ("trace", "fresh", "sigcache"):
            raise ValueError("SimConfig: signature_source must be trace, fresh or sigcache, "
                             f"got {self.signature_source!r}")
        if self.signature_source != "trace" and not self.prefix_caching:
            raise ValueError(f"SimConfig: signature_source={self.signature_source!r} only "
                             "differs from 'trace' with prefix_caching=True")
        E = get_preset(self.model).num_experts
        if E % self.ep:
            raise ValueError(f"SimConfig: ep={self.ep} must divide the {E} experts")

    @property
    def horizon_s(self) -> float:
        """Arrivals happen in [0, warmup + duration)."""
        return self.warmup_s + self.duration_s

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
