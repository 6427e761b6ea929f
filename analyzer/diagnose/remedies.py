"""Remedies, cheapest first, each with the bytes it would save on THIS run.

The list is data (`REMEDIES`, in the order practitioners try them: USER-STORIES.md "Fix order"); each
estimate is computed from the breakdown of the run's own peak (or, after an OOM, of the memory it needed:
what was allocated plus the failed request). The cheapest remedy whose new peak fits the device is marked
`try_first`. A remedy is listed only when the memory it acts on is a meaningful part of the peak, or when a
finding calls for it. When the triage says leak, fixing the leak comes first and is what to try first, and
batch-size advice is left out: a smaller batch only delays the out of memory.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analyzer.core.units import gib
from analyzer.core.vocabulary import Category

RELEVANT_SHARE = 0.05     # a remedy must act on at least this share of the peak to be listed
FIT_HEADROOM = 0.95       # a new peak "fits" when it uses at most this share of the device
_LAYER = re.compile(r"^(?:.*\.)?(?:layers|layer|h|blocks|block|encoder\.layer|decoder\.layers)\.(\d+)(?:\.|$)")


@dataclass
class Demand:
    """What the run needed at its worst moment, split by category (bytes), and facts remedies depend on."""

    total: int
    by_category: dict[str, int]
    capacity: int | None
    world_size: int | None
    layers: int | None                       # repeated blocks seen in module names
    findings: set[str] = field(default_factory=set)
    oom_verdict: str | None = None
    mixed_precision: bool | None = None      # from the theory check of model states
    expandable_segments: bool | None = None
    recoverable_fragmentation: int = 0       # reserved bytes expandable segments would give back
    checkpointable: int | None = None        # activations inside repeated blocks minus the blocks' inputs
    first_step_excess: int | None = None     # how much higher the first optimizer step peaks than later ones
    lazy_state_trouble: bool = False         # the first optimizer step (lazy state creation) OOMed or peaks highest
    triage: str | None = None                # analyzer.diagnose.triage verdict
    leak_bytes: int = 0                      # leaked memory alive at the worst moment
    leak_stacks: list[str] = field(default_factory=list)   # where the leaked memory was allocated, with its rate

    def bytes(self, *categories: str) -> int:
        return sum(self.by_category.get(c, 0) for c in categories)


@dataclass(frozen=True)
class Remedy:
    id: str
    title: str
    cost: str
    how: str | Callable[[Demand], str]                     # code, or code written for this run
    estimate: Callable[[Demand], tuple[int | None, str]]   # (bytes saved, confidence)
    applies: Callable[[Demand], bool]
    layout_only: bool = False   # frees reserved-but-unused memory: the allocated peak stays, the layout fits it
    first: bool = False         # tried before everything else whenever it applies, fit or not


def _batch_scaled(d: Demand) -> int:
    return d.bytes(Category.ACTIVATION, Category.INPUT, Category.TEMPORARY)


def _accumulation(d: Demand) -> tuple[int, str]:
    """Half the batch-scaled memory, less the gradients accumulation keeps alive through the second micro-batch
    (where the peak had none: with zero_grad(set_to_none=True) the forward and early backward run without them).
    Gradients are as large as the parameters when the model states match Adam's 16Ψ (every parameter trains);
    otherwise some may be frozen, and the optimizer state, when there is one, bounds the trainable part (Adam
    keeps 2x the gradients, SGD with momentum 1x)."""
    trainable = d.bytes(Category.PARAMETER)
    if d.mixed_precision is None and d.bytes(Category.OPTIMIZER_STATE):
        trainable = min(trainable, d.bytes(Category.OPTIMIZER_STATE))
    kept_gradients = max(0, trainable - d.bytes(Category.GRADIENT))
    return _batch_scaled(d) // 2 - kept_gradients, "high" if d.mixed_precision is not None else "medium"


def _bf16(d: Demand) -> tuple[int, str]:
    """At most half the activations, less the bf16 copy of each fp32 weight autocast keeps from forward to
    backward. Norms, softmax (on CUDA), the loss and the residual stream stay fp32, which only the module and
    tensor sizes could tell apart: measured savings are a quarter to a third of the activations with fused
    attention, none or a loss with hand-written attention under CUDA's autocast (benchmarks/results/
    remedy_accuracy.md), hence "low"."""
    return d.bytes(Category.ACTIVATION) // 2 - d.bytes(Category.PARAMETER) // 2, "low"


def _optimizer_moments(d: Demand) -> int:
    """Adam's two moments: all of the optimizer state in fp32, 8 of 12 bytes a parameter with fp32 master weights."""
    return int(d.bytes(Category.OPTIMIZER_STATE) * (8 / 12 if d.mixed_precision else 1.0))


def _shards(d: Demand) -> int:
    return d.world_size or 8


def _checkpointing(d: Demand) -> tuple[int, str]:
    """Checkpointing each block keeps only its input: what the blocks hold beyond their inputs is saved. Without
    module names (no repeated blocks found), a share of all activations by the layer count, or half."""
    if d.checkpointable is not None:
        return d.checkpointable, "high"
    activations = d.bytes(Category.ACTIVATION)
    if d.layers and d.layers >= 2:
        return int(activations * (1 - 2 / d.layers)), "medium"
    return activations // 2, "low"


def _relevant(*categories: str) -> Callable[[Demand], bool]:
    return lambda d: d.bytes(*categories) >= RELEVANT_SHARE * d.total


def _batch_advice(d: Demand) -> bool:
    """Batch size acts on activations and inputs; against a leak it only delays the out of memory."""
    return d.triage != "leak" and _relevant(Category.ACTIVATION, Category.INPUT)(d)


def _fix_leak_how(d: Demand) -> str:
    return ("# memory kept from every step, by where it was allocated:\n"
            + "".join(f"#   {line}\n" for line in d.leak_stacks)
            + "# keep numbers or detached tensors, not tensors that carry their autograd graph:\n"
              "losses.append(loss.item())   # not losses.append(loss)\n"
              "# and clear lists and caches that outlive the step (self.cache.clear())")


REMEDIES: list[Remedy] = [
    Remedy("fix_leak", "Fix the leak: stop keeping memory from every step", "a code change",
           _fix_leak_how, lambda d: (d.leak_bytes, "high"), lambda d: d.triage == "leak", first=True),
    # the saving-a-checkpoint spike has its own cheap fixes, tried before anything that changes training
    Remedy("state_dict_offload", "Gather the state dict to CPU while saving", "a slower save",
           "from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions\n"
           "sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))",
           lambda d: (d.bytes(Category.OTHER), "medium"), lambda d: "checkpoint_gather" in d.findings),
    Remedy("sharded_save", "Save a sharded checkpoint (torch.distributed.checkpoint)", "a directory of shards instead of one file",
           "import torch.distributed.checkpoint as dcp\ndcp.save({'model': model.state_dict()}, checkpoint_id=path)",
           lambda d: (int(d.bytes(Category.OTHER) * (1 - 1 / _shards(d))), "medium"), lambda d: "checkpoint_gather" in d.findings),
    # story 5: the first optimizer step OOMs while later ones would fit: create Adam's state up front, in a clean
    # allocator, instead of lazily on top of the first step's gradients and temporaries
    Remedy("init_optimizer_state", "Create the optimizer state before the first batch", "one extra step at lr 0 "
           "(Adam's step counter starts at 1: the first bias correction differs slightly)",
           "for p in model.parameters():\n    p.grad = torch.zeros_like(p)\nlrs = [g['lr'] for g in optimizer.param_groups]\n"
           "for g in optimizer.param_groups:\n    g['lr'] = 0.0\noptimizer.step(); optimizer.zero_grad(set_to_none=True)\n"
           "for g, lr in zip(optimizer.param_groups, lrs):\n    g['lr'] = lr",
           lambda d: (d.first_step_excess, "low"), lambda d: d.lazy_state_trouble),
    Remedy("micro_batch", "Halve the micro-batch", "instant; lower throughput; very small batches can hurt convergence",
           "batch_size = batch_size // 2   # keep the global batch with gradient accumulation (next remedy)",
           lambda d: (_batch_scaled(d) // 2, "high"), _batch_advice),
    Remedy("bf16", "Train in bf16 mixed precision", "small; fp16 needs loss scaling, bf16 needs Ampere or newer",
           "with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n    loss = model(batch)",
           _bf16, lambda d: d.mixed_precision is not True and _relevant(Category.ACTIVATION)(d)),
    Remedy("gradient_accumulation", "Gradient accumulation: 2 micro-batches of half the size",
           "slower steps; the same effective batch (BatchNorm-style layers see smaller batches)",
           "for i, chunk in enumerate(batch.chunk(2)):\n    (model(chunk).loss / 2).backward()\noptimizer.step(); optimizer.zero_grad()",
           _accumulation, _batch_advice),
    Remedy("activation_checkpointing", "Activation checkpointing of each block", "about 20-30% more compute",
           "from torch.utils.checkpoint import checkpoint\nx = checkpoint(block, x, use_reentrant=False)",
           lambda d: _checkpointing(d), _relevant(Category.ACTIVATION)),
    Remedy("optimizer_8bit", "8-bit Adam (bitsandbytes)", "a new dependency; usually no accuracy loss",
           "import bitsandbytes as bnb\noptimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)",
           lambda d: (int(_optimizer_moments(d) * 0.75), "medium"), _relevant(Category.OPTIMIZER_STATE)),
    Remedy("adafactor", "Adafactor (factored second moment, no first moment)", "may need tuning of the learning rate",
           "from transformers.optimization import Adafactor\noptimizer = Adafactor(model.parameters(), lr=lr, relative_step=False)",
           lambda d: (int(_optimizer_moments(d) * 0.9), "low"), _relevant(Category.OPTIMIZER_STATE)),
    Remedy("optimizer_offload", "Offload optimizer state to CPU", "slower optimizer steps, bounded by PCIe",
           "# DeepSpeed: \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"cpu\"}}",
           lambda d: (d.bytes(Category.OPTIMIZER_STATE), "medium"), _relevant(Category.OPTIMIZER_STATE)),
    Remedy("zero1", "ZeRO-1: shard optimizer state over the GPUs", "communication; needs data parallelism",
           "torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)",
           lambda d: (int(d.bytes(Category.OPTIMIZER_STATE) * (1 - 1 / _shards(d))), "high" if d.world_size else "medium"),
           _relevant(Category.OPTIMIZER_STATE)),
    Remedy("zero2", "ZeRO-2: shard optimizer state and gradients", "more communication",
           "# DeepSpeed: \"zero_optimization\": {\"stage\": 2}  |  FSDP: ShardingStrategy.SHARD_GRAD_OP",
           lambda d: (int(d.bytes(Category.OPTIMIZER_STATE, Category.GRADIENT) * (1 - 1 / _shards(d))), "high" if d.world_size else "medium"),
           _relevant(Category.OPTIMIZER_STATE, Category.GRADIENT)),
    Remedy("zero3", "ZeRO-3 / FSDP: shard parameters too", "most communication; parameters gathered per layer",
           "from torch.distributed.fsdp import fully_shard\nfor block in model.layers: fully_shard(block)\nfully_shard(model)",
           lambda d: (int(d.bytes(Category.OPTIMIZER_STATE, Category.GRADIENT, Category.PARAMETER) * (1 - 1 / _shards(d))),
                      "high" if d.world_size else "medium"),
           _relevant(Category.OPTIMIZER_STATE, Category.GRADIENT, Category.PARAMETER)),
    Remedy("tensor_parallel", "Tensor parallelism over 2 GPUs (inside a node)", "needs model code changes; fast links",
           "from torch.distributed.tensor.parallel import parallelize_module  # ColwiseParallel / RowwiseParallel",
           lambda d: (d.bytes(Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.ACTIVATION) // 2, "low"),
           _relevant(Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.ACTIVATION)),
    Remedy("model_changes", "Model changes: GQA/MQA, efficient attention (SDPA/FlashAttention), fewer or narrower layers",
           "changes the model; may need retraining", "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)",
           lambda d: (None, "low"), _relevant(Category.ACTIVATION)),
    Remedy("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "none measurable",
           "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
           lambda d: (d.recoverable_fragmentation, "medium"),
           lambda d: d.expandable_segments is not True and ("fragmentation" in d.findings or "reserved_growth" in d.findings
                                                            or d.oom_verdict == "fragmentation"),
           layout_only=True),
    Remedy("max_split_size", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (expandable segments already on)",
           "may raise reserved memory for large blocks", "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512",
           lambda d: (d.recoverable_fragmentation // 2, "low"),
           lambda d: d.expandable_segments is True and d.oom_verdict == "fragmentation", layout_only=True),
    Remedy("offload", "Offload parameters / activations to CPU", "large slowdown, bounded by PCIe",
           "# FSDP: CPUOffload(offload_params=True)  |  torch.autograd.graph.save_on_cpu() for activations",
           lambda d: (d.bytes(Category.PARAMETER) + d.bytes(Category.ACTIVATION) // 2, "low"), _relevant(Category.PARAMETER, Category.ACTIVATION)),
]


LAYOUT_ONLY = {r.id for r in REMEDIES if r.layout_only}
FIRST = {r.id for r in REMEDIES if r.first}


def count_layers(modules: list[str]) -> int | None:
    """Repeated blocks (`layers.N`, `h.N`, `blocks.N` ...) seen in module names."""
    numbers = {m.group(1) for name in modules if (m := _LAYER.match(name))}
    return len(numbers) or None


def checkpointable_bytes(live: pd.DataFrame) -> int | None:
    """Activations alive in repeated blocks, less each block's output (the next block's input, which
    checkpointing keeps): the latest activation each block made. None without at least two blocks."""
    activations = live[live["category"] == Category.ACTIVATION]
    blocks = activations["module"].astype(str).str.extract(_LAYER.pattern, expand=False)
    inside = activations[blocks.notna()].assign(block=blocks[blocks.notna()])
    if inside["block"].nunique() < 2:
        return None
    latest = inside.sort_values("t_alloc_us").groupby("block").tail(1)
    return int(inside["allocated_bytes"].sum() - latest["allocated_bytes"].sum())


def rank_remedies(demand: Demand) -> list[dict[str, Any]]:
    """The applicable remedies in priority order with their estimates; a `first` remedy (fixing a leak) leads
    and is `try_first`, else the first that fits is.

    When the OOM is fragmentation, the allocator settings (free to try) come first. Their `saved_bytes` is
    reserved memory given back; the allocated peak stays, and it fits when it is within the device."""
    layout_first = demand.oom_verdict == "fragmentation"
    order = sorted(REMEDIES, key=lambda r: (not r.first, layout_first and not r.layout_only))
    out: list[dict[str, Any]] = []
    for remedy in order:
        if not remedy.applies(demand):
            continue
        saved, confidence = remedy.estimate(demand)
        new_peak = None if saved is None else demand.total - (0 if remedy.layout_only else saved)
        limit = 1.0 if remedy.layout_only else FIT_HEADROOM
        fits = None if new_peak is None or demand.capacity is None else new_peak <= limit * demand.capacity
        out.append({"id": remedy.id, "rank": len(out) + 1, "title": remedy.title, "saved_bytes": saved,
                    "new_peak_bytes": new_peak, "fits": fits, "confidence": confidence, "try_first": False,
                    "how": remedy.how(demand) if callable(remedy.how) else remedy.how, "cost": remedy.cost})
    first = next((r for r in out if r["id"] in FIRST), None) or next((r for r in out if r["fits"]), None)
    if first is None and demand.capacity is None:
        first = next((r for r in out if r["saved_bytes"] and r["saved_bytes"] >= 0.1 * demand.total), None)
    if first is not None:
        first["try_first"] = True
    return out


def describe(remedy: dict[str, Any], capacity: int | None) -> str:
    """'Halve the micro-batch (peak 61.2 → 38.4 GiB, fits in 80 GiB)'."""
    saved, new_peak = remedy["saved_bytes"], remedy["new_peak_bytes"]
    if saved is None or new_peak is None:
        return remedy["title"]
    fit = ""
    if capacity is not None:
        fit = f", fits in {gib(capacity)}" if remedy["fits"] else f", still above {gib(capacity)}"
    if remedy["id"] in LAYOUT_ONLY:
        return f"{remedy['title']} (gives back {gib(saved)} of cached memory; needed {gib(new_peak)}{fit})"
    return f"{remedy['title']} (peak {gib(new_peak + saved)} → {gib(new_peak)}{fit})"
