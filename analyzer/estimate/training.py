"""Per-GPU memory of a Megatron-style training job, stage by stage: what `torch.cuda.max_memory_allocated()` on
one rank of each pipeline stage would show.

Weights, gradients and optimizer state per rank (Megatron-LM's DistributedDataParallel and optimizers): every
parameter's 16-bit copy (4 bytes in fp32), its gradient in the contiguous grad buffer (fp32 under bf16, the
"main_grad": 18 bytes a parameter in all with Adam, not the ZeRO paper's 16), and Adam's fp32 master copy,
exp_avg and exp_avg_sq (12 bytes), divided over the data-parallel group only (DP×CP ranks; the experts' over
the expert-data-parallel group) with the distributed optimizer: 6 + 12/DP bytes a parameter. Tensor parallelism
splits the attention and MLP matrices (norms and row-parallel biases are whole on every rank), expert
parallelism the experts, pipeline parallelism the layers; the first stage holds the embedding, the last the
final norm and the output layer (a copy of the embedding when tied and PP > 1).

Activations per layer (Korthikanti et al. 2022, written per tensor so that GQA, SwiGLU, the FFN width and
fused attention change it): the norms' and the first linears' inputs (whole sequence, or split over TP with
sequence parallelism), Q, K, V and the attention output (split over TP), FlashAttention's fp32 log-sum-exp or
the unfused softmax (and its dropout), the FFN's activation input and output, the dropout masks, all over the
CP-local sequence. Full recompute keeps only each checkpointed chunk's input plus one chunk being recomputed;
selective drops the attention core. The 1F1B schedule keeps PP − stage micro-batches in flight on a stage
(interleaved: (PP − stage − 1)·2 + (VP − 1)·PP + 1 model chunks), capped by the micro-batches of a step. The
last stage's loss (Megatron's vocab-parallel cross entropy) keeps the logits in bf16 and their fp32 softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from analyzer.estimate.config import TrainingConfig
from analyzer.estimate.device import Device, workspaces

ADAM_STATES = 2                 # exp_avg, exp_avg_sq
FP32 = 4
MASK = 1                        # a dropout mask keeps a byte a value
PARTS = ("weights", "gradients", "optimizer_state", "activations", "communication_buffers", "workspaces")


@dataclass(frozen=True)
class Params:
    """Parameters on one rank, by how they are sharded: `dense` over DP×CP, `expert` over expert DP."""

    dense: float
    expert: float

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's rank: its layers, the micro-batches it keeps in flight and its bytes by part."""

    stage: int
    layers: int
    in_flight: float            # micro-batches' worth of this stage's activations at the peak
    moment: str                 # "backward" (every activation kept) or "optimizer" (the step's fp32 gradients)
    parameters: int             # on this rank
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    communication_buffers: int
    workspaces: int

    @property
    def per_gpu_bytes(self) -> int:
        return sum(getattr(self, part) for part in PARTS)

    def json(self) -> dict[str, int | float | str]:
        return {"stage": self.stage, "layers": self.layers, "in_flight_micro_batches": self.in_flight,
                "moment": self.moment,
                "parameters": self.parameters, "per_gpu_bytes": self.per_gpu_bytes,
                **{part: getattr(self, part) for part in PARTS}}


def chunk_layers(c: TrainingConfig) -> list[int]:
    """Transformer layers of each of the PP·VP model chunks, in pipeline order (chunk k is on stage k mod PP).
    When the split counts the embedding (and the loss) as a layer, the first (last) chunk holds one fewer."""
    chunks = c.pp * c.vp
    if c.pp > 1 and c.vp == 1 and (c.first_stage_layers is not None or c.last_stage_layers is not None):
        first, last = c.first_stage_layers, c.last_stage_layers
        inner = c.pp - (first is not None) - (last is not None)
        each = (c.layers - (first or 0) - (last or 0)) // inner if inner else 0
        sizes = [each] * c.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
    else:
        each = (c.layers + c.embedding_as_layer + c.loss_as_layer) // chunks
        sizes = [each] * chunks
        sizes[0] -= c.embedding_as_layer
        sizes[-1] -= c.loss_as_layer
    sizes[-1] += c.layers - sum(sizes)
    return sizes


def stage_layers(c: TrainingConfig) -> list[int]:
    """Transformer layers on each pipeline stage (all its model chunks), first to last."""
    sizes = chunk_layers(c)
    return [sum(sizes[stage::c.pp]) for stage in range(c.pp)]


def _moe_layers(c: TrainingConfig, stage: int, layers: list[int]) -> int:
    if c.moe is None:
        return 0
    if c.moe.layer_pattern is None:
        return layers[stage]
    start = sum(layers[:stage])
    return sum(c.moe.layer_pattern[start:start + layers[stage]])


def attention_params(c: TrainingConfig) -> float:
    """The attention's parameters on one rank. MLA's down projections and latent norms are whole on every rank
    (Megatron builds them 'duplicated'), its up projections and output split over TP."""
    h, t = c.hidden, c.tp
    norm = 2 if c.normalization == "LayerNorm" else 1
    if c.mla is not None:
        m = c.mla
        whole = h * (m.kv_lora + m.qk_pos) + norm * m.kv_lora + (h * m.q_lora + norm * m.q_lora if m.q_lora else 0)
        split = ((m.q_lora or h) * c.heads * (m.qk_head + m.qk_pos) + m.kv_lora * c.heads * (m.qk_head + m.v_head)
                 + c.heads * m.v_head * h)
        return whole + split / t + (h if c.bias else 0)
    q, kv = c.head_dim * c.heads, c.head_dim * c.groups
    return (h * (q + 2 * kv) + q * h + (q + 2 * kv if c.bias else 0)) / t + (h if c.bias else 0)


def layer_params(c: TrainingConfig, moe: bool) -> Params:
    """One layer's parameters on one rank."""
    h, t, gated = c.hidden, c.tp, 2 if c.swiglu else 1
    norm = 2 if c.normalization == "LayerNorm" else 1
    attention = attention_params(c)
    replicated = 2 * norm * h + (2 * norm * c.head_dim if c.qk_layernorm else 0)
    if not moe or c.moe is None:
        f = c.ffn_width
        mlp = (h * f * gated + f * h + (f * gated if c.bias else 0)) / t + (h if c.bias else 0)
        return Params(attention + mlp + replicated, 0.0)
    f = c.moe.ffn or c.ffn_width
    shared = (h * c.moe.shared_ffn * gated + c.moe.shared_ffn * h) / t
    router = h * c.moe.experts
    experts = c.moe.experts / c.ep * (h * f * gated + f * h + (f * gated + h if c.bias else 0)) / c.expert_tp
    return Params(attention + shared + router + replicated, experts)


def stage_params(c: TrainingConfig, stage: int, layers: list[int]) -> Params:
    """Parameters on a rank of `stage`: its layers, the embedding on the first, the output layer on the last."""
    moe = _moe_layers(c, stage, layers)
    dense_layer, moe_layer = layer_params(c, False), layer_params(c, True)
    dense = (layers[stage] - moe) * dense_layer.dense + moe * moe_layer.dense
    expert = moe * moe_layer.expert
    embedding = c.padded_vocab * c.hidden / c.tp
    if stage == 0:
        dense += embedding + (c.max_position or c.seq) * c.hidden * (c.position_embedding == "learned_absolute")
    if stage == c.pp - 1:
        dense += c.hidden * (2 if c.normalization == "LayerNorm" else 1)
        if c.untied or c.pp > 1:
            dense += embedding
    return Params(dense, expert)


def in_flight(c: TrainingConfig, stage: int) -> float:
    """Micro-batches' worth of a stage's activations kept at its peak: under 1F1B, PP − stage of them (capped by
    the micro-batches of a step); interleaved, the schedule itself is followed (Megatron's warm-up of
    (PP − stage − 1)·2 + (VP − 1)·group forwards, then one forward and one backward at a time, in its order of
    model chunks), counting the layers of the chunks in flight after each forward."""
    m = c.micro_batches
    if c.pp == 1:
        return 1.0
    if c.vp == 1:
        return float(min(c.pp - stage, m))
    layers = stage_layers(c)[stage]
    return held_layers(c, stage) / layers if layers else 0.0


SCHEDULE_GROUPS = 4     # the interleaved schedule repeats per group of micro-batches: a few show its peak


def held_layers(c: TrainingConfig, stage: int) -> int:
    """Interleaved 1F1B on one stage: the most layer-activations (layers × micro-batches) held at once."""
    group = c.vp_group or c.pp
    m = min(c.micro_batches, SCHEDULE_GROUPS * group)
    sizes = chunk_layers(c)[stage::c.pp]            # this stage's chunks, in order
    table = [(mb, chunk) for start in range(0, m, group) for chunk in range(c.vp)
             for mb in range(start, min(start + group, m))]
    forwards = [sizes[chunk] for _, chunk in table]
    backwards = [sizes[c.vp - 1 - chunk] for _, chunk in table]   # backward runs the chunks last first
    warmup = min((c.pp - stage - 1) * 2 + (c.vp - 1) * group, len(table))
    held = peak = sum(forwards[:warmup])
    done = 0
    for forward in forwards[warmup:]:
        held += forward
        peak = max(peak, held)
        held -= backwards[done]
        done += 1
    return peak


def layer_activations(c: TrainingConfig, moe: bool) -> float:
    """What one layer keeps for backward for one micro-batch, on one rank (bytes)."""
    b, h, t = c.micro_batch, c.hidden, c.tp
    s = c.seq / c.cp
    sb = s * b
    v = c.param_bytes
    r = t if c.sequence_parallel else 1                 # tensors whole on each TP rank unless SP splits them
    dropout = MASK * sb * h / r if c.hidden_dropout > 0 else 0.0
    if c.mla is not None:
        # norm and down-projection input; the latents (down output, norm output: the up projections' input);
        # Q and K with their RoPE part, V, the output (the projection's input)
        m = c.mla
        latents = 2 * (m.q_lora or 0) + m.kv_lora + m.qk_pos + m.kv_lora
        qkv = c.heads * (2 * (m.qk_head + m.qk_pos) + m.v_head)
        attention = 2 * v * sb * h / r + v * sb * latents + v * sb * qkv / t + v * sb * c.heads * m.v_head / t
    else:
        q, kv = c.head_dim * c.heads, c.head_dim * c.groups
        # attention: norm input, QKV input, Q K V, the output (the projection's input)
        attention = 2 * v * sb * h / r + v * sb * (q + 2 * kv) / t + v * sb * q / t
    attention += dropout                                # the residual's dropout mask
    if c.recompute != "selective":
        if c.flash_attention:
            attention += FP32 * sb * c.heads / t          # log-sum-exp
        else:
            scores = b * c.heads * s * c.seq / t        # the local queries against every key
            attention += (v + (FP32 if c.softmax_fp32_copy else 0)) * scores
            if c.attention_dropout > 0:
                attention += (MASK + v) * scores
    gated = 2 if c.swiglu else 1
    if moe and c.moe is not None:
        f = c.moe.ffn or c.ffn_width
        tokens = routed_tokens(c)
        mlp = 2 * v * sb * h / r + (FP32 if c.moe.router_fp32 else v) * sb / r * c.moe.experts
        mlp += v * tokens * (h + f * gated / c.expert_tp + f / c.expert_tp) + v * tokens * h
        if c.moe.dispatcher == "allgather":     # every token of the expert-parallel group, gathered
            mlp += v * sb / r * c.ep * c.expert_tp * h
        if c.moe.shared_ffn:
            mlp += v * sb * (c.moe.shared_ffn * gated + c.moe.shared_ffn) / t
        return attention + mlp + dropout
    f = c.ffn_width
    mlp = 2 * v * sb * h / r + v * sb * f * gated / t + v * sb * f / t + dropout
    return attention + mlp


def routed_tokens(c: TrainingConfig) -> float:
    """Tokens an expert-parallel rank computes for one micro-batch: its share of every token's top-k choices
    (gathered over expert TP), dropless routing assumed balanced, or the capacity's bound when one is set."""
    assert c.moe is not None
    local = c.seq / c.cp * c.micro_batch / c.tp     # MoE with TP > 1 needs sequence parallelism
    tokens = local * c.moe.top_k * c.expert_tp
    if c.moe.capacity_factor is not None:
        tokens *= c.moe.capacity_factor
    return tokens


def stage_activations(c: TrainingConfig, stage: int, layers: list[int]) -> float:
    """The stage's activations at its peak: in-flight micro-batches of its layers, under the recompute chosen,
    with the embedding's on the first stage and the loss's on the last."""
    count = layers[stage]
    moe = _moe_layers(c, stage, layers)
    per_layer = ((count - moe) * layer_activations(c, False) + moe * layer_activations(c, True)) / max(count, 1)
    sb = c.seq / c.cp * c.micro_batch
    r = c.tp if c.sequence_parallel else 1
    layer_input = c.param_bytes * sb * c.hidden / r
    flight = in_flight(c, stage)
    if c.recompute == "full":
        n = min(c.recompute_layers, count)
        if c.recompute_method == "block":
            kept = flight * (n * layer_input + (count - n) * per_layer)
            recomputing = per_layer
        else:
            kept = flight * math.ceil(count / max(n, 1)) * layer_input
            recomputing = n * per_layer
        acts = kept + recomputing
    else:
        acts = flight * count * per_layer
    if stage == 0 and c.hidden_dropout > 0:
        acts += flight * MASK * sb * c.hidden / r                 # the embedding's dropout mask
    if stage == c.pp - 1:
        acts += 2 * c.param_bytes * sb * c.hidden / r             # the final norm's input, the output layer's
        copies = c.param_bytes + FP32 * (2 if c.cross_entropy_fusion else 1)
        acts += copies * sb * c.padded_vocab / c.tp                 # logits and their fp32 softmax
    return acts


def communication(c: TrainingConfig) -> float:
    """Buffers the collectives need inside PyTorch's allocator: the pipeline's send and receive tensors, the
    sequence-parallel all-gather of a layer's input, and under ZeRO-3 the gathered weights of two layers (the one
    computing and the one prefetched)."""
    sb = c.seq / c.cp * c.micro_batch
    r = c.tp if c.sequence_parallel else 1
    buffers = 0.0
    if c.zero >= 3:
        buffers += 2 * c.param_bytes * max(layer_params(c, moe).total for moe in (False, c.moe is not None))
    if c.pp > 1:
        buffers += 2 * c.param_bytes * sb * c.hidden / r
    if c.sequence_parallel and c.tp > 1:
        buffers += c.param_bytes * sb * c.hidden
    return buffers


def optimizer_bytes_per_param(c: TrainingConfig) -> int:
    """Adam's state and the fp32 master copy (none when the weights are fp32 already)."""
    return (0 if c.precision == "fp32" else FP32) + ADAM_STATES * FP32


def stages(c: TrainingConfig, device: Device = Device()) -> list[Stage]:
    """Every pipeline stage's rank, first to last, at its peak. The distributed optimizer (ZeRO-1) shards the
    optimizer's bytes over DP×CP (per optimizer instance; the experts' over expert DP), ZeRO-2 the gradients
    too, ZeRO-3 the weights too. The peak is at the start of backward (every activation kept, the loss's logits
    on the last stage), unless the optimizer step makes more: with fp16 gradients, Megatron's mixed-precision
    optimizer copies the (sharded) gradients to fp32 for the step, 4 bytes a parameter, when the activations
    are gone."""
    layers = stage_layers(c)
    optimizer = optimizer_bytes_per_param(c)
    sharded = c.distributed_optimizer or c.zero >= 1
    shard = max(c.dp * c.cp // c.optimizer_instances, 1) if sharded else 1
    expert_shard = max(c.expert_dp // c.optimizer_instances, 1) if sharded else 1
    result = []
    for stage in range(c.pp):
        params = stage_params(c, stage, layers)
        spread = params.dense / shard + params.expert / expert_shard
        activations = int(stage_activations(c, stage, layers))
        step = int(FP32 * spread) if c.grad_bytes < FP32 and c.precision != "fp32" else 0
        at_step = step > activations
        result.append(Stage(
            stage=stage, layers=layers[stage], in_flight=in_flight(c, stage),
            moment="optimizer" if at_step else "backward", parameters=int(params.total),
            weights=int(c.param_bytes * (spread if c.zero >= 3 else params.total)),
            gradients=int(c.grad_bytes * (spread if c.zero >= 2 else params.total)) + (step if at_step else 0),
            optimizer_state=int(optimizer * spread), activations=0 if at_step else activations,
            communication_buffers=int(communication(c)), workspaces=workspaces(c, device)))
    return result


def total_parameters(c: TrainingConfig) -> int:
    """The model's parameter count (every shard of every stage, the tied embedding once)."""
    whole = replace(c, tp=1, pp=1, ep=1, etp=1, vp=1, first_stage_layers=None, last_stage_layers=None,
                    embedding_as_layer=False, loss_as_layer=False)
    return int(stage_params(whole, 0, [c.layers]).total)
