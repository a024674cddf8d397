"""Capture expert routing from Hugging Face transformers MoE models with forward hooks.

Every supported architecture has one router module per MoE layer that returns
``(router_logits, router_scores, router_indices)``: logits (T, E) over all routed
experts and the selected expert ids (T, k) of the T tokens in the forward pass. A forward
hook on each router copies the logits and ids out; nothing in the model is changed.

Per request, the prompt runs through the model once (prefill), then greedy generation
feeds each new token back with the KV cache. A request with ``n`` generated tokens runs
``n - 1`` decode forward passes (the first token comes out of prefill; the last is never
fed back), the trace convention of :mod:`eldr.traces.trace`. Generation stops after
``max_new_tokens`` tokens or at the end-of-sequence token (which counts as generated).

Gate values: ``prefill_gate_prob`` is the per-token softmax of the router logits over all
E experts, summed over the prompt, for every architecture (it is what Qwen3-MoE,
Mixtral and OLMoE route on; GPT-OSS and DeepSeek-V3 route on other functions of the same
logits, recorded the same way so that representations stay comparable).

torch and transformers are imported lazily (the ``capture`` extra).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eldr._progress import Progress
from eldr.capture.payload import topk_to_counts
from eldr.traces.trace import Trace, TraceMeta

__all__ = ["ROUTER_CLASSES", "RequestRouting", "RoutingRecorder", "capture_ids",
           "capture_texts", "find_routers"]

# config.model_type -> class name of its router module (one per MoE layer)
ROUTER_CLASSES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
    "olmoe": "OlmoeTopKRouter",
    "gpt_oss": "GptOssTopKRouter",
    "deepseek_v3": "DeepseekV3TopkRouter",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model) -> list:
    """The router modules of ``model``, one per MoE layer, in layer order.

    Raises ``ValueError`` for an architecture not in :data:`ROUTER_CLASSES`, or when no
    router module (or two in one layer) is found.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ROUTER_CLASSES:
        raise ValueError(f"capture: model type {model_type!r} is not supported; supported: "
                         f"{sorted(ROUTER_CLASSES)}")
    cls_name = ROUTER_CLASSES[model_type]
    found: dict[int, object] = {}
    for name, module in model.named_modules():
        if type(module).__name__ != cls_name:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"capture: router {name!r} is not inside a numbered layer")
        layer = int(match.group(1))
        if layer in found:
            raise ValueError(f"capture: two {cls_name} modules in layer {layer}")
        found[layer] = module
    if not found:
        raise ValueError(f"capture: no {cls_name} module found in this {model_type} model "
                         f"(transformers version mismatch?)")
    return [found[i] for i in sorted(found)]


class RoutingRecorder:
    """Context manager: forward hooks on every router, collecting per-token routing.

    ``take()`` returns what was recorded since the last call and clears it:
    ``(topk, logits)``, (T, L, k) int16 expert ids and (T, L, E) float32 router logits,
    in token order. Only whole forward passes may be taken (every layer saw the same T).
    """

    def __init__(self, routers: Sequence) -> None:
        if not routers:
            raise ValueError("RoutingRecorder: no routers given")
        self.routers = list(routers)
        self.num_layers = len(self.routers)
        first = self.routers[0]
        self.top_k = int(first.top_k)
        self.num_experts = int(getattr(first, "num_experts", 0) or first.weight.shape[0])
        self._ids: list[list] = [[] for _ in self.routers]
        self._logits: list[list] = [[] for _ in self.routers]
        self._handles: list = []

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, _scores, indices = output
            self._logits[layer].append(logits.detach().reshape(-1, logits.shape[-1]).float())
            self._ids[layer].append(indices.detach().reshape(-1, indices.shape[-1]))
        return hook

    def __enter__(self) -> RoutingRecorder:
        self._handles = [r.register_forward_hook(self._hook(i))
                         for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        import torch

        if any(len(x) != len(self._ids[0]) for x in self._ids):
            raise RuntimeError("RoutingRecorder: layers saw different numbers of passes")
        if not self._ids[0]:
            return (np.zeros((0, self.num_layers, self.top_k), np.int16),
                    np.zeros((0, self.num_layers, self.num_experts), np.float32))
        ids = torch.stack([torch.cat(x) for x in self._ids], dim=1)  # (T, L, k)
        logits = torch.stack([torch.cat(x) for x in self._logits], dim=1)  # (T, L, E)
        self._ids = [[] for _ in self.routers]
        self._logits = [[] for _ in self.routers]
        return ids.cpu().numpy().astype(np.int16), logits.cpu().numpy().astype(np.float32)


@dataclass(frozen=True)
class RequestRouting:
    """The routing of one request, as captured."""

    prompt_ids: np.ndarray  # (P,) int32 prompt token ids
    output_ids: np.ndarray  # (n,) int32 generated token ids, n >= 1
    prefill_topk: np.ndarray  # (P, L, k) int16 expert ids per prompt token
    prefill_logits: np.ndarray  # (P, L, E) float32 router logits per prompt token
    decode_topk: np.ndarray  # (n - 1, L, k) int16 expert ids per fed-back generated token


def capture_ids(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                eos_token_id: int | None = None, progress: bool | None = None
                ) -> list[RequestRouting]:
    """Greedy-generate from each prompt (token ids) one at a time, recording the routing.

    Batch size one keeps the capture exact: no padding tokens are routed and every token's
    routing is attributed to its own request.
    """
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"capture: max_new_tokens must be >= 1, got {max_new_tokens}")
    recorder = RoutingRecorder(find_routers(model))
    device = next(model.parameters()).device
    results = []
    model.eval()
    with recorder, torch.no_grad(), Progress(len(prompts), "capture", enabled=progress) as bar:
        for r, prompt in enumerate(prompts):
            ids = np.asarray(prompt, dtype=np.int64)
            if ids.ndim != 1 or ids.size == 0:
                raise ValueError(f"capture: prompt {r} must be a non-empty 1-D list of ids")
            out = model(input_ids=torch.from_numpy(ids)[None].to(device), use_cache=True)
            pre_topk, pre_logits = recorder.take()
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            generated = [token]
            while len(generated) < max_new_tokens and token != eos_token_id:
                step = torch.tensor([[token]], device=device)
                out = model(input_ids=step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
            dec_topk, _ = recorder.take()
            results.append(RequestRouting(
                prompt_ids=ids.astype(np.int32), output_ids=np.array(generated, np.int32),
                prefill_topk=pre_topk, prefill_logits=pre_logits, decode_topk=dec_topk))
            bar.update(1)
    return results


def to_trace(results: Sequence[RequestRouting], *, model_name: str, num_experts: int,
             domains: Sequence[str] | None = None, block_size: int = 16) -> Trace:
    """Assemble captured requests into a :class:`~eldr.traces.trace.Trace` (all optional fields)."""
    if not results:
        raise ValueError("capture: no requests to assemble")
    _, L, k = results[0].prefill_topk.shape
    pre_counts = np.stack([topk_to_counts(x.prefill_topk, num_experts) for x in results])
    dec_counts = np.stack([topk_to_counts(x.decode_topk, num_experts) for x in results])
    probs, logit_sums = [], []
    for x in results:
        z = x.prefill_logits.astype(np.float64)
        p = np.exp(z - z.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        probs.append(p.sum(axis=0))
        logit_sums.append(z.sum(axis=0))
    kw: dict = {}
    if domains is not None:
        names = tuple(dict.fromkeys(domains))
        kw["domain_names"] = names
        kw["domains"] = np.array([names.index(d) for d in domains], dtype=np.int32)
    return Trace(
        meta=TraceMeta(model=model_name, num_layers=int(L), num_experts=int(num_experts),
                       top_k=int(k), block_size=block_size, source="captured:transformers"),
        prefill_counts=pre_counts, decode_counts=dec_counts,
        prompt_lens=np.array([len(x.prompt_ids) for x in results], dtype=np.int64),
        output_lens=np.array([len(x.output_ids) for x in results], dtype=np.int64),
        prefill_gate_prob=np.stack(probs).astype(np.float32),
        prefill_gate_logit=np.stack(logit_sums).astype(np.float32),
        prefill_topk=np.concatenate([x.prefill_topk for x in results]),
        decode_topk=np.concatenate([x.decode_topk for x in results]),
        prompt_token_ids=np.concatenate([x.prompt_ids for x in results]),
        **kw,
    )


def capture_texts(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                  domains: Sequence[str] | None = None, model_name: str = "model",
                  max_prompt_tokens: int | None = None, progress: bool | None = None
                  ) -> Trace:
    """Tokenize ``prompts`` (no special tokens added), capture, and return a trace.

    ``max_prompt_tokens`` keeps only the first tokens of longer prompts.
    """
    if domains is not None and len(domains) != len(prompts):
        raise ValueError(f"capture: {len(domains)} domain labels for {len(prompts)} prompts")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if max_prompt_tokens is not None:
        ids = [x[:max_prompt_tokens] for x in ids]
    results = capture_ids(model, ids, max_new_tokens=max_new_tokens,
                          eos_token_id=tokenizer.eos_token_id, progress=progress)
    num_experts = RoutingRecorder(find_routers(model)).num_experts
    return to_trace(results, model_name=model_name, num_experts=num_experts, domains=domains)
