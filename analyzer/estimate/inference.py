"""Serving memory per GPU: the weights, the KV cache of a batch at a context length, the activation peak of a
prefill, and what a vLLM-style `gpu_memory_utilization` leaves for the cache.

The KV cache keeps, per token and layer, K and V for each key/value head (GQA: the groups, not the query heads):
2 · groups · head_dim · bytes, the groups split over TP (replicated when TP exceeds them), the layers over PP.
A prefill keeps nothing for backward; its peak inside a layer is the MLP's: the FFN's input and (gated) output and
the activation's output for every token of the prefill, split over TP, beside a few hidden-state copies; after the
last layer, the fp32 logits of each sequence's last token (what vLLM computes; Hugging Face's `generate` makes
them for every position). vLLM sizes its cache as memory × gpu_memory_utilization minus the weights, the
profiled activation peak and the memory outside PyTorch; that remainder divided by a token's KV bytes is how many
tokens it can cache.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from analyzer.core.units import gib
from analyzer.estimate.config import TrainingConfig
from analyzer.estimate.device import CUDA_CONTEXT, NCCL_CHANNEL_BUFFERS, NCCL_CHANNELS, Device
from analyzer.estimate.training import FP32, stage_layers, stage_params, total_parameters

CACHE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
HIDDEN_COPIES = 4               # the residual stream, the norm's output, the attention's output and the sum
DEFAULT_UTILIZATION = 0.9       # vLLM's default gpu_memory_utilization


def kv_bytes_per_token(c: TrainingConfig, cache: str) -> float:
    """K and V of one token on one GPU of the first stage (the stage with the most layers)."""
    groups = max(c.groups / c.tp, 1)
    return 2 * max(stage_layers(c)) * groups * c.head_dim * CACHE_BYTES[cache]


def prefill_bytes(c: TrainingConfig, tokens: int, batch: int) -> float:
    """The activation peak of one prefill of `tokens` tokens (all sequences together), one GPU."""
    gated = 2 if c.swiglu else 1
    f = (c.moe.ffn or c.ffn_width) * c.moe.top_k if c.moe else c.ffn_width
    layer = c.param_bytes * tokens * ((gated + 1) * f / c.tp + HIDDEN_COPIES * c.hidden)
    logits = FP32 * batch * c.padded_vocab / c.tp
    return max(layer, logits)


def inference_estimate(c: TrainingConfig, device: Device, cache: str = "bf16",
                       utilization: float = DEFAULT_UTILIZATION, prefill_tokens: int | None = None) -> dict[str, Any]:
    """The JSON of a serving estimate; `c.micro_batch` is the batch, `c.seq` the context."""
    layers = stage_layers(c)
    weight_bytes = 1 if c.fp8 else c.param_bytes
    weights = max(weight_bytes * stage_params(c, s, layers).total for s in range(c.pp))
    per_token = kv_bytes_per_token(c, cache)
    batch, context = c.micro_batch, c.seq
    kv = per_token * batch * context
    tokens = prefill_tokens or batch * context
    acts = prefill_bytes(c, tokens, batch)
    groups = sum(1 for size in (c.tp, c.pp) if size > 1)
    outside = {"cuda_context": CUDA_CONTEXT, "nccl_buffers": int(groups * 2 * NCCL_CHANNELS * NCCL_CHANNEL_BUFFERS)}
    per_gpu = int(weights) + int(kv) + int(acts)
    needed = per_gpu + sum(outside.values())
    result: dict[str, Any] = {
        "model": "inference", "params": total_parameters(c), "gpus": c.tp * c.pp,
        "layout": {"tp": c.tp, "pp": c.pp, "batch": batch, "context": context, "cache_dtype": cache,
                   "query_groups": c.groups, "head_dim": c.head_dim, "prefill_tokens": tokens},
        "weights_bytes": int(weights), "kv_bytes_per_token": int(per_token), "kv_cache_bytes": int(kv),
        "activation_bytes": int(acts), "per_gpu_bytes": per_gpu, "outside_allocator": outside,
        "device_bytes_needed": needed, "gpu_memory_bytes": device.memory, "gpu_memory_utilization": utilization,
        "fits": None, "kv_cache_budget_bytes": None, "max_cached_tokens": None, "largest_batch": None,
        "largest_context": None}
    if device.memory is not None:
        budget = device.memory * utilization
        left = budget - weights - acts - sum(outside.values())
        cached = max(int(left // per_token), 0)
        result |= {"fits": needed <= budget, "kv_cache_budget_bytes": int(max(left, 0)), "max_cached_tokens": cached,
                   "largest_batch": cached // context, "largest_context": cached // batch}
    return result


def render_inference(result: dict[str, Any]) -> str:
    lay = result["layout"]
    lines = [f"{result['params'] / 1e9:.3g}B parameters served on {result['gpus']} GPU(s) (TP {lay['tp']} × PP "
             f"{lay['pp']}), batch {lay['batch']} × context {lay['context']}, {lay['cache_dtype']} cache:",
             f"  weights {gib(result['weights_bytes'])} + KV cache {gib(result['kv_cache_bytes'])} "
             f"({result['kv_bytes_per_token'] / 2**10:.0f} KiB a token, {lay['query_groups']} key/value groups) "
             f"+ prefill activations {gib(result['activation_bytes'])} = {gib(result['per_gpu_bytes'])} per GPU",
             f"  outside the allocator: CUDA context {gib(result['outside_allocator']['cuda_context'])}, NCCL "
             f"{gib(result['outside_allocator']['nccl_buffers'])}; needs {gib(result['device_bytes_needed'])}"]
    if result["fits"] is not None:
        lines.append(f"{'Fits' if result['fits'] else 'Does NOT fit'} in {result['gpu_memory_utilization']:.0%} of "
                     f"{gib(result['gpu_memory_bytes'])}; that leaves {gib(result['kv_cache_budget_bytes'])} for the "
                     f"KV cache: {result['max_cached_tokens']:,} tokens, a batch of {result['largest_batch']} at "
                     f"context {lay['context']}, or context {result['largest_context']:,} at batch {lay['batch']}.")
    return "\n".join(lines)


def serving(c: TrainingConfig) -> TrainingConfig:
    """The model as served: no dropout, no optimizer sharding, nothing recomputed."""
    return replace(c, hidden_dropout=0.0, attention_dropout=0.0, distributed_optimizer=False, zero=0,
                   recompute="none")
