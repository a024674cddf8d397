"""Presets of the four MoE models the paper evaluates, of the two production-size models
whose real routing eldr ships (``gpt-oss-20b``, ``deepseek-v2-lite``; docs/real-models.md)
and of the tiny MoE shipped with eldr: routing shape and weight/KV bytes.

Every number carries its source in a comment. Architecture facts (layers, hidden size,
heads, experts, top-k, vocabulary) come from each model's ``config.json`` as summarised in
docs/method.md#model-facts. Byte counts are derived from those facts; the arithmetic is written out
as the expression itself, so the reader can check it. Small tensors (RMSNorm weights,
q/k norms) are ignored: they are below 0.1% of any figure here. Where a fact is not in
the model-facts table and had to be assumed, the comment says "assumed".

The simulator (decode step time, KV transfer), the signature-cache benchmark and the
synthetic trace generator import these presets; nothing here does any I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALL_PRESETS", "PRESETS", "REAL_PRESETS", "TINY_MOE", "ModelPreset", "get_preset",
           "preset_from_config"]

BF16 = 2  # bytes per bf16 parameter


@dataclass(frozen=True)
class ModelPreset:
    """Routing shape and memory traffic of one MoE model (decode-side view).

    Bytes are what one decode step must stream from HBM: ``expert_bytes`` once per
    distinct expert selected at a layer, ``dense_bytes_per_step`` once per step
    (attention, router, shared MLP, LM head), KV bytes once per context token.
    """

    name: str  # preset key, e.g. "qwen3-30b-a3b"
    hf_id: str  # Hugging Face repository the facts describe
    num_layers: int  # L, MoE layers (every decoder layer is MoE in all four models)
    num_experts: int  # E, routed experts per layer
    top_k: int  # k, routed experts selected per token per layer
    hidden_size: int  # model width
    expert_intermediate_size: int  # width of one routed expert's FFN
    vocab_size: int  # LM-head rows
    dtype: str  # storage format of the routed expert weights
    expert_bytes: int  # bytes of ONE routed expert at ONE layer
    attn_bytes_per_layer: int  # attention weight bytes per layer (mean over layer types)
    dense_bytes_per_step: int  # all non-routed-expert weight bytes read per decode step
    kv_bytes_per_token: int  # KV bytes per context token on full-attention layers
    sliding_window: int | None = None  # tokens kept by sliding-window layers (None: none)
    kv_sliding_bytes_per_token: int = 0  # KV bytes per token on sliding layers (<= window)
    moe_layer_fixed_us: float | None = None  # H200 MoE-layer time a in t = a + b*D (µs)
    moe_layer_per_expert_us: float | None = None  # ... b, µs per distinct expert D
    max_context_tokens: int | None = None  # context window (prompt + output); None: unset

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hidden_size",
                     "expert_intermediate_size", "vocab_size", "expert_bytes",
                     "attn_bytes_per_layer", "dense_bytes_per_step", "kv_bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model preset {self.name!r}: {name} must be a positive "
                                 f"integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model preset {self.name!r}: top_k={self.top_k} exceeds "
                             f"num_experts={self.num_experts}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model preset {self.name!r}: sliding_window must be positive "
                             f"or None, got {self.sliding_window!r}")
        if self.max_context_tokens is not None and (
                isinstance(self.max_context_tokens, bool)
                or not isinstance(self.max_context_tokens, int) or self.max_context_tokens < 2):
            raise ValueError(f"model preset {self.name!r}: max_context_tokens must be an "
                             f"integer >= 2 or None, got {self.max_context_tokens!r}")
        if self.kv_sliding_bytes_per_token < 0:
            raise ValueError(f"model preset {self.name!r}: kv_sliding_bytes_per_token must "
                             f"be >= 0, got {self.kv_sliding_bytes_per_token!r}")
        if (self.sliding_window is None) != (self.kv_sliding_bytes_per_token == 0):
            raise ValueError(f"model preset {self.name!r}: sliding_window and "
                             "kv_sliding_bytes_per_token must be given together")

    @property
    def kv_fixed_bytes_per_request(self) -> int:
        """Sliding-window KV of a request whose context fills the window (the cap)."""
        if self.sliding_window is None:
            return 0
        return self.sliding_window * self.kv_sliding_bytes_per_token

    def kv_bytes(self, context_tokens: int) -> int:
        """KV bytes of one request holding ``context_tokens`` tokens of context."""
        if context_tokens < 0:
            raise ValueError(f"kv_bytes: context_tokens must be >= 0, got {context_tokens}")
        sliding = 0
        if self.sliding_window is not None:
            sliding = min(context_tokens, self.sliding_window) * self.kv_sliding_bytes_per_token
        return context_tokens * self.kv_bytes_per_token + sliding


# -- Qwen3-30B-A3B ---------------------------------------------------------------------------
# config.json (Qwen/Qwen3-30B-A3B): 48 layers, hidden 2048, 32 query heads and 4 KV heads of
# head_dim 128, moe_intermediate_size 768, 128 experts, top-8, vocab 151936, untied
# embeddings, bf16. Every layer is MoE (no shared expert).
_QWEN3_30B_ATTN = (2048 * 32 * 128      # q_proj
                   + 2 * 2048 * 4 * 128  # k_proj, v_proj
                   + 32 * 128 * 2048     # o_proj
                   ) * BF16              # = 37,748,736 B
_QWEN3_30B_ROUTER = 2048 * 128 * BF16  # gate: hidden x E = 524,288 B
_QWEN3_30B = ModelPreset(
    name="qwen3-30b-a3b",
    hf_id="Qwen/Qwen3-30B-A3B",
    num_layers=48,
    num_experts=128,
    top_k=8,
    hidden_size=2048,
    expert_intermediate_size=768,
    vocab_size=151936,
    dtype="bf16",
    expert_bytes=3 * 2048 * 768 * BF16,  # gate, up, down projections = 9,437,184 B (9.44 MB)
    attn_bytes_per_layer=_QWEN3_30B_ATTN,
    # 48 x (attention + router) + LM head 151936 x 2048 bf16 = 2,459,435,008 B
    dense_bytes_per_step=48 * (_QWEN3_30B_ATTN + _QWEN3_30B_ROUTER) + 151936 * 2048 * BF16,
    kv_bytes_per_token=48 * 2 * 4 * 128 * BF16,  # layers x (K,V) x kv heads x head_dim = 96 KiB
    moe_layer_fixed_us=18.7,  # docs/method.md#h200-constants (vLLM 0.19 fused_moe fit)
    moe_layer_per_expert_us=2.22,  # docs/method.md#h200-constants
)

# -- GPT-OSS-120B ----------------------------------------------------------------------------
# config.json (openai/gpt-oss-120b): 36 layers, hidden 2880, 64 query heads and 8 KV heads of
# head_dim 64, intermediate_size 2880, 128 experts, top-4, vocab 201088, untied embeddings.
# Attention alternates sliding-window (128 tokens) and full layers: 18 of each. Attention
# projections carry biases; each layer has 64 attention-sink logits. Expert weights are
# MXFP4: 4-bit values plus one 8-bit scale per 32 values (4.25 bits per weight); expert
# biases, attention and LM head are bf16.
_GPT_OSS_ATTN = (2880 * 64 * 64 + 64 * 64  # q_proj + bias
                 + 2 * (2880 * 8 * 64 + 8 * 64)  # k_proj, v_proj + biases
                 + 64 * 64 * 2880 + 2880  # o_proj + bias
                 + 64  # sinks
                 ) * BF16  # = 53,100,288 B
_GPT_OSS_ROUTER = (2880 * 128 + 128) * BF16  # router weight + bias = 737,536 B
_GPT_OSS_EXPERT_WEIGHTS = 2880 * 2 * 2880 + 2880 * 2880  # gate_up (fused) + down = 24,883,200
_GPT_OSS_120B = ModelPreset(
    name="gpt-oss-120b",
    hf_id="openai/gpt-oss-120b",
    num_layers=36,
    num_experts=128,
    top_k=4,
    hidden_size=2880,
    expert_intermediate_size=2880,
    vocab_size=201088,
    dtype="mxfp4",
    # weights x 0.5 B + one scale byte per 32 weights + bf16 biases (5760 + 2880)
    # = 12,441,600 + 777,600 + 17,280 = 13,236,480 B (13.2 MB)
    expert_bytes=_GPT_OSS_EXPERT_WEIGHTS // 2 + _GPT_OSS_EXPERT_WEIGHTS // 32
    + (2 * 2880 + 2880) * BF16,
    attn_bytes_per_layer=_GPT_OSS_ATTN,
    # 36 x (attention + router) + LM head 201088 x 2880 bf16 = 3,096,428,544 B
    dense_bytes_per_step=36 * (_GPT_OSS_ATTN + _GPT_OSS_ROUTER) + 201088 * 2880 * BF16,
    kv_bytes_per_token=18 * 2 * 8 * 64 * BF16,  # 18 full layers x (K,V) x 8 x 64 = 36 KiB
    sliding_window=128,  # config.json sliding_window
    kv_sliding_bytes_per_token=18 * 2 * 8 * 64 * BF16,  # x 128 tokens = 4.5 MiB per request
    moe_layer_fixed_us=61.9,  # docs/method.md#h200-constants
    moe_layer_per_expert_us=5.07,  # docs/method.md#h200-constants
)

# -- Gemma-4-26B-A4B -------------------------------------------------------------------------
# config.json (google/gemma-4-26b-a4b, text config): 30 layers, hidden 2816, 128 experts,
# top-8, expert intermediate 704, plus a dense shared MLP of intermediate 2112 in every
# layer; vocab 262144, tied embeddings (the LM head reads the embedding matrix), bf16.
# Attention: 25 sliding-window layers (window 1024; 16 query heads, 8 KV heads, head_dim
# 256) and 5 global layers (16 query heads of head_dim 512, K shared with V).
# ASSUMED: 2 KV heads on global layers, K stored once more as V in the cache — this is what
# the model-facts table's 20 KiB/token implies (5 x 2 x 2 x 512 x 2 B = 20 KiB).
_GEMMA4_SLIDING_ATTN = (2816 * 16 * 256 + 2 * 2816 * 8 * 256 + 16 * 256 * 2816) * BF16
# = 69,206,016 B per sliding layer
_GEMMA4_GLOBAL_ATTN = (2816 * 16 * 512 + 2816 * 2 * 512 + 16 * 512 * 2816) * BF16
# = 98,041,856 B per global layer (no v_proj: attention_k_eq_v)
_GEMMA4_ATTN_TOTAL = 25 * _GEMMA4_SLIDING_ATTN + 5 * _GEMMA4_GLOBAL_ATTN  # 2,220,359,680 B
_GEMMA4_SHARED_MLP = 3 * 2816 * 2112 * BF16  # 35,684,352 B per layer
_GEMMA4_ROUTER = 2816 * 128 * BF16  # 720,896 B per layer
_GEMMA4_26B = ModelPreset(
    name="gemma-4-26b-a4b",
    hf_id="google/gemma-4-26b-a4b",
    num_layers=30,
    num_experts=128,
    top_k=8,
    hidden_size=2816,
    expert_intermediate_size=704,
    vocab_size=262144,
    dtype="bf16",
    expert_bytes=3 * 2816 * 704 * BF16,  # 11,894,784 B (11.9 MB)
    attn_bytes_per_layer=_GEMMA4_ATTN_TOTAL // 30,  # mean over layer types: 74,011,989 B
    # attention + 30 x (shared MLP + router) + tied LM head 262144 x 2816 = 4,788,912,128 B
    dense_bytes_per_step=_GEMMA4_ATTN_TOTAL + 30 * (_GEMMA4_SHARED_MLP + _GEMMA4_ROUTER)
    + 262144 * 2816 * BF16,
    kv_bytes_per_token=5 * 2 * 2 * 512 * BF16,  # global layers: 20 KiB per token
    sliding_window=1024,
    # 25 layers x (K,V) x 8 x 256 x 2 B = 200 KiB per token, x 1024 = 200 MiB per request
    kv_sliding_bytes_per_token=25 * 2 * 8 * 256 * BF16,
    moe_layer_fixed_us=25.0,  # docs/method.md#h200-constants (SGLang)
    moe_layer_per_expert_us=2.73,  # docs/method.md#h200-constants
)

# -- Qwen3-235B-A22B -------------------------------------------------------------------------
# config.json (Qwen/Qwen3-235B-A22B): 94 layers, hidden 4096, 64 query heads and 4 KV heads
# of head_dim 128, moe_intermediate_size 1536, 128 experts, top-8, vocab 151936, untied, bf16.
_QWEN3_235B_ATTN = (4096 * 64 * 128 + 2 * 4096 * 4 * 128 + 64 * 128 * 4096) * BF16
# = 142,606,336 B
_QWEN3_235B_ROUTER = 4096 * 128 * BF16  # 1,048,576 B
_QWEN3_235B = ModelPreset(
    name="qwen3-235b-a22b",
    hf_id="Qwen/Qwen3-235B-A22B",
    num_layers=94,
    num_experts=128,
    top_k=8,
    hidden_size=4096,
    expert_intermediate_size=1536,
    vocab_size=151936,
    dtype="bf16",
    expert_bytes=3 * 4096 * 1536 * BF16,  # 37,748,736 B (37.7 MB)
    attn_bytes_per_layer=_QWEN3_235B_ATTN,
    # 94 x (attention + router) + LM head 151936 x 4096 bf16 = 14,748,221,440 B
    dense_bytes_per_step=94 * (_QWEN3_235B_ATTN + _QWEN3_235B_ROUTER) + 151936 * 4096 * BF16,
    kv_bytes_per_token=94 * 2 * 4 * 128 * BF16,  # 188 KiB
    moe_layer_fixed_us=32.8,  # docs/method.md#h200-constants
    moe_layer_per_expert_us=8.31,  # docs/method.md#h200-constants
)

PRESETS: dict[str, ModelPreset] = {
    p.name: p for p in (_QWEN3_30B, _GPT_OSS_120B, _GEMMA4_26B, _QWEN3_235B)
}
"""The paper's four models (the ones with a synthetic-routing calibration)."""

# -- the two models of the shipped real routing (docs/real-models.md) -------------------------
# GPT-OSS-20B. config.json (openai/gpt-oss-20b): 24 layers, hidden 2880, 64 query heads and 8
# KV heads of head_dim 64, intermediate_size 2880, 32 experts, top-4, vocab 201088, untied
# embeddings. Attention alternates sliding-window (128 tokens) and full layers: 12 of each.
# Attention, router and LM head are bf16 (the attention block is GPT-OSS-120B's: same width
# and heads); experts are MXFP4 (4.25 bits per weight), an expert exactly GPT-OSS-120B's.
_GPT_OSS_20B_ROUTER = (2880 * 32 + 32) * BF16  # router weight + bias = 184,384 B
_GPT_OSS_20B = ModelPreset(
    name="gpt-oss-20b",
    hf_id="openai/gpt-oss-20b",
    num_layers=24,
    num_experts=32,
    top_k=4,
    hidden_size=2880,
    expert_intermediate_size=2880,
    vocab_size=201088,
    dtype="mxfp4",
    # as GPT-OSS-120B's: 4-bit weights + one scale byte per 32 + bf16 biases = 13,236,480 B
    expert_bytes=_GPT_OSS_EXPERT_WEIGHTS // 2 + _GPT_OSS_EXPERT_WEIGHTS // 32
    + (2 * 2880 + 2880) * BF16,
    attn_bytes_per_layer=_GPT_OSS_ATTN,  # 53,100,288 B
    # 24 x (attention + router) + LM head 201088 x 2880 bf16 = 2,437,099,008 B
    dense_bytes_per_step=24 * (_GPT_OSS_ATTN + _GPT_OSS_20B_ROUTER) + 201088 * 2880 * BF16,
    kv_bytes_per_token=12 * 2 * 8 * 64 * BF16,  # 12 full layers x (K,V) x 8 x 64 = 24 KiB
    sliding_window=128,  # config.json sliding_window
    kv_sliding_bytes_per_token=12 * 2 * 8 * 64 * BF16,  # x 128 tokens = 3 MiB per request
    # CARRIED OVER from GPT-OSS-120B's H200 fit (docs/method.md#h200-constants): the same
    # expert (2880 x 2880 MXFP4, same fused-MoE kernel), so the same time per distinct
    # expert; a is ASSUMED equal although the router picks among 32, not 128, experts
    moe_layer_fixed_us=61.9,
    moe_layer_per_expert_us=5.07,
    max_context_tokens=131072,  # config.json max_position_embeddings
)

# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite; its fine-tune ESFT-vanilla-lite routed the
# shipped ESFT trace). config.json: 27 layers, the first dense (intermediate_size 10944,
# first_k_dense_replace 1), 26 MoE layers of 64 routed experts (moe_intermediate_size 1408)
# plus 2 shared experts every token uses, top-6; hidden 2048; MLA attention with 16 heads,
# no query compression (q_lora_rank null), kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128; vocab 102400, untied embeddings, bf16.
# The KV cache of MLA holds per token per layer the 512-dim latent plus the 64-dim rope key.
_DSV2_LITE_ATTN = (2048 * 16 * (128 + 64)  # q_proj (no q compression)
                   + 2048 * (512 + 64)  # kv_a_proj_with_mqa: latent + rope key
                   + 512 * 16 * (128 + 128)  # kv_b_proj: latent -> K nope, V
                   + 16 * 128 * 2048  # o_proj
                   ) * BF16  # = 27,525,120 B
_DSV2_LITE_ROUTER = 2048 * 64 * BF16  # gate: 262,144 B per MoE layer
_DSV2_LITE_SHARED = 3 * 2048 * (2 * 1408) * BF16  # 2 shared experts: 34,603,008 B per layer
_DSV2_LITE_DENSE_FFN = 3 * 2048 * 10944 * BF16  # layer 0's dense MLP: 134,479,872 B
_DSV2_LITE = ModelPreset(
    name="deepseek-v2-lite",
    hf_id="deepseek-ai/DeepSeek-V2-Lite",
    num_layers=26,  # MoE layers (the routing shape); the dense first layer is in dense bytes
    num_experts=64,
    top_k=6,
    hidden_size=2048,
    expert_intermediate_size=1408,
    vocab_size=102400,
    dtype="bf16",
    expert_bytes=3 * 2048 * 1408 * BF16,  # 17,301,504 B (17.3 MB)
    attn_bytes_per_layer=_DSV2_LITE_ATTN,
    # 27 x attention + 26 x (router + shared experts) + layer 0's MLP + LM head
    # 102400 x 2048 bf16 = 2,203,582,464 B
    dense_bytes_per_step=27 * _DSV2_LITE_ATTN + 26 * (_DSV2_LITE_ROUTER + _DSV2_LITE_SHARED)
    + _DSV2_LITE_DENSE_FFN + 102400 * 2048 * BF16,
    kv_bytes_per_token=27 * (512 + 64) * BF16,  # 27 layers x (latent + rope key) = 31,104 B
    # a, b: no measured fit of this model; eldr.sim.config.moe_constants DERIVES them from
    # bandwidth (b = 17.3 MB / (4.8 TB/s x 0.886) = 4.07 us on the H200, a = 14.27 b)
    # max_context_tokens: unset (the YaRN-scaled position limit is no serving context)
)

REAL_PRESETS: dict[str, ModelPreset] = {p.name: p for p in (_GPT_OSS_20B, _DSV2_LITE)}
"""The models of the shipped real routing (no synthetic-routing calibration)."""

# -- tiny MoE shipped with eldr ----------------------------------------------------------------
# src/eldr/data/tiny_moe/config.json (Qwen3MoeForCausalLM, trained by scripts/train_tiny_moe.py):
# 6 layers, hidden 128, 4 query heads and 2 KV heads of head_dim 32, moe_intermediate_size
# 32, 64 experts, top-4, vocab 4096, tied embeddings, bf16, max_position_embeddings 1024,
# no sliding window, no shared expert (mlp_only_layers empty, decoder_sparse_step 1).
# tests/test_models.py re-derives every byte count below from that config.json.
_TINY_ATTN = (128 * 4 * 32         # q_proj
              + 2 * 128 * 2 * 32   # k_proj, v_proj
              + 4 * 32 * 128       # o_proj
              ) * BF16             # = 98,304 B
_TINY_ROUTER = 128 * 64 * BF16  # gate: hidden x E = 16,384 B
TINY_MOE = ModelPreset(
    name="tiny-moe",
    hf_id="local:eldr/data/tiny_moe",
    num_layers=6,
    num_experts=64,
    top_k=4,
    hidden_size=128,
    expert_intermediate_size=32,
    vocab_size=4096,
    dtype="bf16",
    expert_bytes=3 * 128 * 32 * BF16,  # DERIVED: gate, up, down = 24,576 B
    attn_bytes_per_layer=_TINY_ATTN,
    # DERIVED: 6 x (attention + router) + tied LM head 4096 x 128 bf16 = 1,736,704 B
    dense_bytes_per_step=6 * (_TINY_ATTN + _TINY_ROUTER) + 4096 * 128 * BF16,
    kv_bytes_per_token=6 * 2 * 2 * 32 * BF16,  # DERIVED: layers x (K,V) x 2 x 32 = 1,536 B
    # a, b: no H200 fit exists, so none is stored; eldr.sim.config.moe_constants DERIVES
    # them on the h200 and mi300x: b = expert_bytes / (bandwidth x eta), a = 14.27 b
    # (on the H200: b = 24,576 B / (4.8 TB/s x 0.886) = 5.8 ns, a = 82 ns). A model this
    # small is overhead-bound, so its decode step is almost all t_fixed: expect little
    # from expert locality unless --moe-a-us / --moe-b-us say otherwise. The "cpu" hardware
    # preset carries constants MEASURED on the CPU that runs this model (docs/simulator.md).
    max_context_tokens=1024,  # config.json max_position_embeddings
)

ALL_PRESETS: dict[str, ModelPreset] = {**PRESETS, **REAL_PRESETS, TINY_MOE.name: TINY_MOE}
"""Every preset :func:`get_preset` resolves: the paper's four, the two real-routing models
and the shipped tiny MoE."""

# other names a trace's ``meta.model`` may carry for a preset: its Hugging Face id (matched
# whole or by its last part), and the fine-tunes whose routing was recorded on its
# architecture (ESFT-vanilla-lite is DeepSeek-V2-Lite fine-tuned)
_ALIASES: dict[str, str] = {
    **{p.hf_id.lower(): p.name for p in ALL_PRESETS.values()},
    **{p.hf_id.lower().rsplit("/", 1)[-1]: p.name for p in ALL_PRESETS.values()},
    "deepseek-ai/esft-vanilla-lite": "deepseek-v2-lite",
    "esft-vanilla-lite": "deepseek-v2-lite",
}


def get_preset(name: str | ModelPreset) -> ModelPreset:
    """The preset called ``name`` (case-insensitive, ``_`` read as ``-``, so a trace's
    ``tiny_moe`` resolves; a Hugging Face id such as ``openai/gpt-oss-20b`` or a recorded
    fine-tune's, ``deepseek-ai/ESFT-vanilla-lite``, resolves to its preset); a preset
    passes through unchanged."""
    if isinstance(name, ModelPreset):
        return name
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, _ALIASES.get(str(name).strip().lower(), key))
    if key not in ALL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: "
                         f"{', '.join(ALL_PRESETS)}")
    return ALL_PRESETS[key]


# -- a preset from a Hugging Face config.json --------------------------------------------------
def _first(doc: dict, *keys, default=None):
    for k in keys:
        if doc.get(k) is not None:
            return doc[k]
    return default


def _positive(doc: dict, where: str, *keys) -> int:
    v = _first(doc, *keys)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}: {' / '.join(keys)} must be a positive integer, got {v!r}")
    return v


def preset_from_config(doc: dict, *, name: str | None = None,
                       where: str = "config.json") -> ModelPreset:
    """A :class:`ModelPreset` from a Hugging Face MoE ``config.json`` (parsed), by the
    same arithmetic as the presets above, for the common layouts: Qwen3-MoE / Qwen2-MoE,
    Mixtral, OLMoE, GPT-OSS, DeepSeek-V2/V3 (MLA). Read: layers, hidden size, routed experts
    (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``), top-k, the expert's
    intermediate size, shared experts (``n_shared_experts`` or
    ``shared_expert_intermediate_size``), dense layers (``first_k_dense_replace``,
    ``mlp_only_layers``), attention (GQA heads and ``head_dim``, or MLA's
    ``kv_lora_rank`` / ``qk_rope_head_dim``), sliding-window layers (``layer_types``), tied
    embeddings, and MXFP4 experts (``quantization_config.quant_method``). APPROXIMATE:
    biases and norms are left out (< 0.1 % of any figure here) and every dense weight is
    taken as bf16. No measured MoE-layer fit: the simulator derives ``a``, ``b`` from
    bandwidth. ``ValueError`` naming the field for a config that is not a MoE model."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: must be a JSON object")
    doc = {**doc, **(doc.get("text_config") or {})}  # multimodal configs nest the LM
    hidden = _positive(doc, where, "hidden_size")
    layers = _positive(doc, where, "num_hidden_layers")
    vocab = _positive(doc, where, "vocab_size")
    E = _first(doc, "num_experts", "num_local_experts", "n_routed_experts")
    k = _first(doc, "num_experts_per_tok", "experts_per_token", "moe_topk")
    if not E or not k:
        raise ValueError(f"{where}: not a mixture-of-experts config (no expert count and "
                         "top-k: num_experts / num_local_experts / n_routed_experts and "
                         "num_experts_per_tok)")
    E = _positive({"E": E}, where, "E")
    k = _positive({"k": k}, where, "k")
    inter = _positive(doc, where, "moe_intermediate_size", "intermediate_size")
    dense_inter = int(_first(doc, "intermediate_size", default=inter))
    first_dense = int(_first(doc, "first_k_dense_replace", default=0) or 0)
    dense_layers = set(range(first_dense)) | set(doc.get("mlp_only_layers") or [])
    moe_layers = layers - len(dense_layers)
    if moe_layers <= 0:
        raise ValueError(f"{where}: no MoE layer ({layers} layers, {len(dense_layers)} dense)")
    heads = _positive(doc, where, "num_attention_heads")
    quant = (doc.get("quantization_config") or {}).get("quant_method", "")
    mxfp4 = str(quant).lower() == "mxfp4"
    w = 3 * hidden * inter
    expert_bytes = w // 2 + w // 32 if mxfp4 else w * BF16
    if doc.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        rope, nope = int(doc.get("qk_rope_head_dim", 64)), int(doc.get("qk_nope_head_dim", 128))
        v_dim, rank = int(doc.get("v_head_dim", 128)), int(doc["kv_lora_rank"])
        q_rank = doc.get("q_lora_rank")
        q = (hidden * heads * (nope + rope) if not q_rank
             else hidden * q_rank + q_rank * heads * (nope + rope))
        attn = (q + hidden * (rank + rope) + rank * heads * (nope + v_dim)
                + heads * v_dim * hidden) * BF16
        kv_token, sliding_token, window = layers * (rank + rope) * BF16, 0, None
    else:
        kv = int(_first(doc, "num_key_value_heads", default=heads))
        hd = int(_first(doc, "head_dim", default=hidden // heads))
        attn = (2 * hidden * heads * hd + 2 * hidden * kv * hd) * BF16
        per_layer = 2 * kv * hd * BF16
        types = doc.get("layer_types") or []
        n_slide = sum(1 for t in types if "sliding" in str(t))
        window = int(doc["sliding_window"]) if n_slide and doc.get("sliding_window") else None
        n_slide = n_slide if window else 0
        kv_token, sliding_token = (layers - n_slide) * per_layer, n_slide * per_layer
        if kv_token == 0:  # every layer sliding: keep the format's full-layer slot nonzero
            kv_token = 1
    shared = _first(doc, "shared_expert_intermediate_size", default=0) or \
        int(_first(doc, "n_shared_experts", default=0) or 0) * inter
    # the LM head is read once per step, tied to the embedding or not
    dense = (layers * attn + moe_layers * (hidden * E + 3 * hidden * int(shared)) * BF16
             + len(dense_layers) * 3 * hidden * dense_inter * BF16 + vocab * hidden * BF16)
    model_name = name or str(_first(doc, "_name_or_path", "model_type", default="custom"))
    return ModelPreset(
        name=model_name.strip().lower().replace("_", "-") or "custom",
        hf_id=str(_first(doc, "_name_or_path", default=f"config:{model_name}")),
        num_layers=moe_layers, num_experts=E, top_k=k, hidden_size=hidden,
        expert_intermediate_size=inter, vocab_size=vocab,
        dtype="mxfp4" if mxfp4 else "bf16", expert_bytes=expert_bytes,
        attn_bytes_per_layer=attn, dense_bytes_per_step=dense,
        kv_bytes_per_token=kv_token, sliding_window=window,
        kv_sliding_bytes_per_token=sliding_token,
        max_context_tokens=doc.get("max_position_embeddings") if isinstance(
            doc.get("max_position_embeddings"), int) and doc["max_position_embeddings"] >= 2
        else None)
