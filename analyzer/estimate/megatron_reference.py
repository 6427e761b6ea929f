"""Megatron-LM's own estimate (megatron/training/theoretical_memory_usage.py, `report_theoretical_memory`),
restated on a TrainingConfig so that the benchmark can put its error beside ours on the same cases.

What it computes: the most loaded shard's parameters (1/PP of the layers, the embedding, and the output layer
when untied without PP) at 18 bytes each, or 6 + 12/DP with the distributed optimizer (experts at their expert
DP); activations of the first stage, which keeps PP micro-batches in flight: per layer s·b·h·(10 + 24/TP)
bytes, + 5% (without sequence parallelism or selective recompute), or s·b·h·(18 + 4·ffn/h)/TP with both, scaled
for the interleaved schedule, plus the embedding's and (without PP) the output layer's. It ignores recompute
and context parallelism otherwise, and the attention's s² terms.
"""
from __future__ import annotations

from analyzer.estimate.config import TrainingConfig


def weights_and_optimizer(c: TrainingConfig) -> float:
    h, gated = c.hidden, 1.5 if c.swiglu else 1.0
    q = c.head_dim * c.heads
    norm = 1 if c.normalization == "RMSNorm" else 2
    attention = 2 * h * h * (1 + c.groups / c.heads) * q / h
    if c.mla is not None:
        m = c.mla
        q_term = (m.q_lora * (h + c.heads * (m.qk_head + m.qk_pos) + norm) if m.q_lora
                  else h * c.heads * (m.qk_head + m.qk_pos))
        attention = (q_term + m.kv_lora * (h + c.heads * (m.qk_head + m.v_head) + norm) + h * m.qk_pos
                     + c.heads * m.v_head * h)
    pattern = (c.moe.layer_pattern or (1,) * c.layers) if c.moe is not None else (0,) * c.layers
    moe_layers = sum(pattern)
    dense_layers = c.layers - moe_layers
    mlp = 2 * h * c.ffn_width * gated
    shared = 2 * h * c.moe.shared_ffn * gated if c.moe else 0.0
    routed = 2 * h * (c.moe.ffn or c.ffn_width) * c.moe.experts * gated if c.moe else 0.0
    router = h * c.moe.experts + (c.moe.experts if c.bias else 0) if c.moe else 0.0
    layernorm = 2 * h * norm
    embedding = h * c.padded_vocab
    tp_sharded = (attention + mlp) * dense_layers + (attention + shared) * moe_layers
    replicated = layernorm * dense_layers + (layernorm + router) * moe_layers + norm * h
    expert = routed * moe_layers
    tp_shard = (tp_sharded / c.pp + embedding) / c.tp
    replicated_shard = replicated / c.pp
    expert_shard = expert / c.pp / (c.expert_tp * c.ep)
    if c.untied and c.pp == 1:
        tp_shard += embedding / c.tp

    def per_param(dp: int) -> float:
        return 18 if not c.distributed_optimizer else 6 + 12 / dp
    expert_dp = max(c.gpus // (c.expert_tp * c.ep * c.pp), 1)
    return (tp_shard + replicated_shard) * per_param(c.dp) + expert_shard * per_param(expert_dp)


def _pipeline_factor(c: TrainingConfig) -> float:
    if c.vp > 1:
        return 1 + (c.pp - 1) / (c.pp * c.vp)
    if c.pp > 1:
        return min(1.0, c.micro_batches / c.pp)
    return 1.0


def activations(c: TrainingConfig) -> float:
    s, b, h, t, p = c.seq, c.micro_batch, c.hidden, c.tp, c.pp
    if c.sequence_parallel and c.recompute == "selective":
        memory = s * b * h * (18 + 4 * c.ffn_width / h) * c.layers
        memory += 8 * s * b * p + s * b * h * p
        memory *= _pipeline_factor(c)
        if p == 1:
            memory += s * b * h * 4 * (1 + c.padded_vocab / h)
        return memory / t
    memory = s * b * h * (10 + 24 / t) * c.layers
    memory += 8 * s * b * p + s * b * h * p
    memory *= _pipeline_factor(c)
    if p == 1:
        memory += (s * b * c.padded_vocab / t + s * b * h) * 2
    return memory * 1.05


def estimate(c: TrainingConfig) -> float:
    """Megatron's total: weights and optimizer plus activations, bytes."""
    return weights_and_optimizer(c) + activations(c)
