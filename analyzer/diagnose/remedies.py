"""Remedies in the order practitioners try them (USER-STORIES.md "Fix order"), each with the bytes it would save
on THIS run, offered only where it acts on the workload the recording shows (analyzer.diagnose.workload).

The list is data (`REMEDIES`, cheapest first); each estimate is computed from the breakdown of the run's own peak
(or, after an OOM, of the memory it needed: what was allocated plus the failed request). Rules:
- a run that fits (no OOM, AMPLE_HEADROOM of the known device memory left at its allocated peak, and its
  reserved peak under FIT_HEADROOM of it) has nothing to fix: no remedy is `try_first`, and the list is of
  optional ways to grow the batch or the model (`purpose: grow`);
- otherwise the cheapest remedy whose new peak fits the device is `try_first` (on an unknown device, the
  cheapest that saves a tenth of the peak); the list order is the cost order, and `rank` is the position in
  it. A remedy whose premise the recording cannot confirm (`no_grad`: is autograd on?) is listed in its
  place and says its condition, but is never what to try first;
- a remedy is listed only when the memory it acts on is a meaningful part of the peak, or when a finding calls
  for it, and only when it saves more than MIN_SAVING_SHARE of it (never 0 B or less);
- two remedies with the same saving say so: the dearer one names the cheaper one and what both act on;
- a remedy that needs N GPUs names N: `--gpus` (or the trace's world size); without it, the fewest GPUs that
  fit; without a known device memory either, 8, said to be assumed. With one GPU, sharding is not offered;
- when the triage says leak, fixing the leak comes first and is what to try first, and batch-size advice is
  left out: a smaller batch only delays the out of memory.
- quantized weights (8-bit, 4-bit) are offered only for weights nothing trains (a forward-only run, a frozen base,
  an out of memory while loading the model) that are at least QUANTIZE_SHARE of the peak; pipeline parallelism
  only for a run that trains, on more than one GPU, with at least PIPELINE_MIN_LAYERS repeated blocks seen;
  a torch.nn layer called in a loop (an MLP's Linear layers) is no such block;
- parallelism (ZeRO, tensor, pipeline) and offload are for a model whose states do not fit one GPU, or a batch
  that does not: a run that fits as it is (its remedies would only grow the batch) is offered them only when
  its model states hold at least SHARD_TO_GROW_SHARE of the device (of SMALLEST_GPU where it is not known);
- when a plan exists (analyzer.diagnose.plan, a run that does not fit a known device), it decides what to try
  first: `plan.agree` moves `try_first` to the remedy of its first step.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from analyzer.core.units import gib, human_bytes
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, UNATTRIBUTED, Category, Phase, category_plural

RELEVANT_SHARE = 0.05     # a remedy must act on at least this share of the peak to be listed
MIN_SAVING_SHARE = 0.01   # a remedy must save more than this share of the peak to be listed
SAME_SAVING_SHARE = 0.01  # two savings closer than this share of the peak are the same saving
FIT_HEADROOM = 0.95       # a new peak "fits" when it uses at most this share of the device
AMPLE_HEADROOM = 0.20     # a run with no OOM whose peak leaves this share of the device free fits as it is
#: the least memory of the GPUs people train on (8 GB consumer cards and up): without a known device, a run that
#: fits this one as it is fits any of them
SMALLEST_GPU = 8 * 2**30
ASSUMED_GPUS = 8          # GPUs a sharding estimate assumes when neither --gpus nor the device memory is known
MAX_GPUS = 64             # the most GPUs "the fewest that fit" looks at
NODE_GPUS = 8             # tensor parallelism stays inside a node
#: host memory a GPU server node usually has (8-GPU servers ship with 1-2 TiB): what offload can count on
NODE_HOST_MEMORY = 2**40
#: quantized weights act where the weights are this share of the peak or more (8-bit then saves an eighth of it)
#: and are not trained: a forward-only run, a frozen base (QLoRA), or an out of memory while loading them
QUANTIZE_SHARE = 0.25
PIPELINE_MIN_LAYERS = 2   # pipeline stages split repeated blocks: at least two must be seen in the module names
#: a run that fits is offered parallelism or offload (to grow its batch) only when its model states hold this share
#: of the device: a smaller model leaves the batch room to grow on one GPU as it is
SHARD_TO_GROW_SHARE = 0.5
TRAINING, FORWARD_ONLY, UNKNOWN = "training", "forward_only", "unknown"
_LAYER = re.compile(r"^(?:.*\.)?(?:layers|layer|h|blocks|block|encoder\.layer|decoder\.layers)\.(\d+)(?:\.|$)")
_CALL = re.compile(r"^(.*?)\[(\d+)\]")     # a call path's first numbered call: `model.py:382 forward[3]`
_TORCH_LAYER = "torch/nn/modules/"         # the files of torch.nn's own layers (Linear, Conv2d, LayerNorm ...)
_BATCH = (Category.ACTIVATION, Category.INPUT, Category.TEMPORARY)
_STATES = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)
#: what each ZeRO stage shards over its GPUs: its estimate, its plan lever and its replay all take it from here
ZERO_SHARDED: dict[str, tuple[Category, ...]] = {"zero1": (Category.OPTIMIZER_STATE,),
                                                 "zero2": (Category.OPTIMIZER_STATE, Category.GRADIENT),
                                                 "zero3": _STATES}


@dataclass
class Demand:
    """What the run needed at its worst moment, split by category (bytes), and facts remedies depend on."""

    total: int
    by_category: dict[str, int]
    capacity: int | None
    world_size: int | None                   # GPUs the job can shard over: --gpus, else the trace's world size
    layers: int | None                       # repeated blocks seen in module names
    findings: set[str] = field(default_factory=set)
    oom_verdict: str | None = None
    oomed: bool = False                      # the recording ends with an out-of-memory
    oom_phase: str | None = None             # the phase the out-of-memory came in (load: while loading the model)
    reserved_peak: int | None = None         # the most the allocator reserved over the recording
    workload: str = TRAINING                 # training | forward_only | unknown (analyzer.diagnose.workload)
    frozen_share: float | None = None        # share of the parameters that train nothing (fine-tuning)
    graph_kept: bool = False                 # forward-only, with activations kept for a backward
    graph_bytes: int = 0                     # what no_grad would free: activations but the latest (the output)
    autocast: bool | None = None             # mixed precision already on (autocast seen in the stacks)
    mixed_precision: bool | None = None      # from the theory check of model states
    expandable_segments: bool | None = None
    recoverable_fragmentation: int = 0       # free pieces inside used segments at the worst moment (not cache)
    checkpointable: int | None = None        # activations inside repeated blocks minus the blocks' inputs
    first_step_excess: int | None = None     # how much higher the first optimizer step peaks than later ones
    lazy_state_trouble: bool = False         # the first optimizer step (lazy state creation) OOMed or peaks highest
    triage: str | None = None                # analyzer.diagnose.triage verdict
    leak_bytes: int = 0                      # leaked memory alive at the worst moment
    leak_stacks: list[str] = field(default_factory=list)   # where the leaked memory was allocated, with its rate
    # counterfactual replay (analyzer.diagnose.counterfactual): remedy id -> the replayed run's peak allocated and
    # reserved bytes and whether it would still run out of memory; a remedy with one takes its saving from it
    replayed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def bytes(self, *categories: str) -> int:
        return sum(self.by_category.get(c, 0) for c in categories)


@dataclass(frozen=True)
class Remedy:
    id: str
    title: str | Callable[[Demand], str]
    cost: str | Callable[[Demand], str]
    how: str | Callable[[Demand], str]                     # code, or code written for this run
    estimate: Callable[[Demand], tuple[int | None, str]]   # (bytes saved, confidence)
    applies: Callable[[Demand], bool]
    acts_on: tuple[str, ...] = ()   # the categories it shrinks (what a before/after diff must show shrinking)
    layout_only: bool = False   # frees reserved-but-unused memory: the allocated peak stays, the layout fits it
    first: bool = False         # tried before everything else whenever it applies, fit or not
    conditional: bool = False   # rests on a premise the recording cannot confirm: listed, never tried first
    beyond_one_gpu: bool = False  # parallelism or offload: for states or a batch that do not fit one GPU


def fits_any_gpu(d: Demand) -> bool:
    """Without a known device: the run would fit as it is on the smallest GPU people train on (SMALLEST_GPU),
    so it fits on any of them, whichever it ran on."""
    return d.capacity is None and fits_as_is(replace(d, capacity=SMALLEST_GPU))


def fits_as_is(d: Demand) -> bool:
    """No OOM, a known device, AMPLE_HEADROOM of it left at the allocated peak and the reserve within it; and
    no leak, which runs out later whatever the headroom today."""
    if d.oomed or d.capacity is None or "leak" in d.findings:
        return False
    reserved = d.reserved_peak if d.reserved_peak is not None else d.total
    return d.total <= (1 - AMPLE_HEADROOM) * d.capacity and reserved <= FIT_HEADROOM * d.capacity


def needs_beyond_one_gpu(d: Demand) -> bool:
    """Parallelism and offload are worth their cost: the run does not fit as it is, or its model states hold at
    least SHARD_TO_GROW_SHARE of the device (SMALLEST_GPU where it is not known), leaving the batch too little."""
    if not (fits_as_is(d) or fits_any_gpu(d)):
        return True
    device = d.capacity if d.capacity is not None else SMALLEST_GPU
    return d.bytes(*_STATES) >= SHARD_TO_GROW_SHARE * device


def _batch_scaled(d: Demand) -> int:
    return d.bytes(*_BATCH)


def _accumulation(d: Demand) -> tuple[int, str]:
    """Half the batch-scaled memory, less the gradients accumulation keeps alive through the second micro-batch
    (where the peak had none: with zero_grad(set_to_none=True) the forward and early backward run without them).
    Gradients are as large as the parameters that train: all of them when the model states match Adam's 16Ψ,
    the unfrozen part of a fine-tune; otherwise the optimizer state, when there is one, bounds the trainable
    part (Adam keeps 2x the gradients, SGD with momentum 1x)."""
    trainable = d.bytes(Category.PARAMETER)
    if d.frozen_share is not None:
        trainable = int(trainable * (1 - d.frozen_share))
    elif d.mixed_precision is None and d.bytes(Category.OPTIMIZER_STATE):
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


def _sharded(*categories: str) -> Callable[[Demand], int]:
    return lambda d: d.bytes(*categories)


def gpus_for(d: Demand, sharded: int) -> tuple[int, str]:
    """(N, how N was chosen) for a remedy that shards `sharded` bytes over N GPUs."""
    if d.world_size:
        return d.world_size, ""
    if d.capacity is not None:
        for n in range(2, MAX_GPUS + 1):
            if d.total - sharded * (1 - 1 / n) <= FIT_HEADROOM * d.capacity:
                return n, "the fewest that fit; pass --gpus for your count"
    return ASSUMED_GPUS, "assumed; pass --gpus for your count"


def zero_shards(d: Demand) -> dict[str, int]:
    """The GPUs each ZeRO stage shards over, as its remedy's title names them."""
    return {remedy: gpus_for(d, d.bytes(*categories))[0] for remedy, categories in ZERO_SHARDED.items()}


def _over(d: Demand, sharded: int) -> str:
    n, how = gpus_for(d, sharded)
    return f"over {n} GPUs" + (f" ({how})" if how else "")


def _zero(*categories: str) -> Callable[[Demand], tuple[int, str]]:
    def estimate(d: Demand) -> tuple[int, str]:
        sharded = d.bytes(*categories)
        n, how = gpus_for(d, sharded)
        return int(sharded * (1 - 1 / n)), "high" if not how else "medium"
    return estimate


def tp_gpus(d: Demand) -> int:
    return min(d.world_size, NODE_GPUS) if d.world_size else 2


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


def _trains(d: Demand) -> bool:
    """Remedies of a backward pass or of gradients: training, or a run that ended before it could show one."""
    return d.workload != FORWARD_ONLY


def _shards_possible(d: Demand) -> bool:
    return d.world_size != 1


def _batch_advice(d: Demand) -> bool:
    """Batch size acts on activations, inputs and temporaries; against a leak it only delays the out of memory."""
    return d.triage != "leak" and _relevant(*_BATCH)(d)


def _micro_batch_title(d: Demand) -> str:
    return "Halve the batch (or the sequence length)" if d.workload == FORWARD_ONLY else "Halve the micro-batch"


def _zero2_title(d: Demand) -> str:
    frozen = "" if d.frozen_share is None else " (of the trainable part: the frozen base has neither)"
    return f"ZeRO-2: shard optimizer state and gradients {_over(d, d.bytes(Category.OPTIMIZER_STATE, Category.GRADIENT))}{frozen}"


def untrained_weights(d: Demand) -> int:
    """The parameter bytes nothing trains, which quantized weights can hold: all of a forward-only run's, or of
    a run that ran out of memory while loading its model (nothing trained yet); the frozen base of a fine-tune."""
    parameters = d.bytes(Category.PARAMETER)
    if d.workload == FORWARD_ONLY or (d.workload == UNKNOWN and d.oom_phase == Phase.LOAD.value):
        return parameters
    return int(parameters * d.frozen_share) if d.frozen_share is not None else 0


def _quantizable(d: Demand) -> bool:
    """Quantized loading acts where the untrained weights are at least QUANTIZE_SHARE of the peak. The saving is
    of 16-bit weights (a half at 8 bits, three quarters at 4): fp32 weights would save more."""
    return untrained_weights(d) >= QUANTIZE_SHARE * d.total


def _quantized_title(d: Demand, what: str) -> str:
    if d.workload == FORWARD_ONLY:
        return what
    if d.frozen_share is not None and d.workload != UNKNOWN:
        return f"{what} for the frozen base (QLoRA)"
    return f"{what} when loading, if these weights are not trained"


def _quantized_how(d: Demand, option: str) -> str:
    return ("from transformers import BitsAndBytesConfig\n"
            f"model = AutoModelForCausalLM.from_pretrained(name, quantization_config=BitsAndBytesConfig({option}))")


def _pipelined(d: Demand) -> int:
    """What a pipeline stage holds 1/S of: the model states of its layers, and (1F1B, the batch split into S
    micro-batches, S of them in flight on the first stage, each over L/S layers) the activations and temporaries."""
    return d.bytes(*_STATES, Category.ACTIVATION, Category.TEMPORARY)


def pipeline_stages(d: Demand) -> int:
    """S: the GPUs given, the fewest that fit, or 8 assumed (remedies.gpus_for), at most one stage per layer."""
    return min(gpus_for(d, _pipelined(d))[0], d.layers or 1)


def _pipeline_title(d: Demand) -> str:
    s, how = pipeline_stages(d), gpus_for(d, _pipelined(d))[1]
    return (f"Pipeline parallelism over {s} GPUs: the {d.layers} layers as {s} stages (1F1B, the batch as {s} "
            "micro-batches)"
            + (f" ({how})" if how else ""))


def host_memory(d: Demand, host: int, what: str) -> str:
    """'needs 12.00 GiB of host memory (what); 96.00 GiB for the 8 GPUs of a node, within the 1 TiB ...': what an
    offload moves to the CPU, per GPU and for the GPUs of one node that each offload their own (at most
    NODE_GPUS), against NODE_HOST_MEMORY."""
    gpus = min(d.world_size or 1, NODE_GPUS)
    node = host * gpus
    where = f"; {gib(node)} for the {gpus} GPUs of a node" if gpus > 1 else ""
    verdict = ("within" if node <= NODE_HOST_MEMORY else "beyond")
    return (f"needs {gib(host)} of host memory ({what}){where}, {verdict} the {human_bytes(NODE_HOST_MEMORY)} a "
            "GPU server node usually has")


def _optimizer_offload_cost(d: Demand) -> str:
    """Adam's state moves to the host: 12 bytes a parameter (two fp32 moments, fp32 master weights) in mixed
    precision, 8 in fp32 (the moments); as measured otherwise."""
    what = ("the optimizer state as measured" if d.mixed_precision is None else
            "12 bytes a parameter: Adam's two fp32 moments and the fp32 master weights" if d.mixed_precision else
            "8 bytes a parameter: Adam's two fp32 moments")
    return "slower optimizer steps, bounded by PCIe; " + host_memory(d, d.bytes(Category.OPTIMIZER_STATE), what)


def _offload_cost(d: Demand) -> str:
    """The weights (and, training, the activations saved on the CPU) move to the host."""
    if d.workload == FORWARD_ONLY:
        return "large slowdown, bounded by PCIe; " + host_memory(d, d.bytes(Category.PARAMETER), "the weights")
    return ("large slowdown, bounded by PCIe; " + host_memory(
        d, d.bytes(Category.PARAMETER) + d.bytes(Category.ACTIVATION) // 2, "the parameters and half the activations"))


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
           lambda d: (d.bytes(Category.OTHER), "medium"), lambda d: "checkpoint_gather" in d.findings,
           acts_on=(Category.OTHER,)),
    Remedy("sharded_save", "Save a sharded checkpoint (torch.distributed.checkpoint)", "a directory of shards instead of one file",
           "import torch.distributed.checkpoint as dcp\ndcp.save({'model': model.state_dict()}, checkpoint_id=path)",
           lambda d: (int(d.bytes(Category.OTHER) * (1 - 1 / gpus_for(d, d.bytes(Category.OTHER))[0])), "medium"),
           lambda d: "checkpoint_gather" in d.findings and _shards_possible(d), acts_on=(Category.OTHER,)),
    # story 5: the first optimizer step OOMs while later ones would fit: create Adam's state up front, in a clean
    # allocator, instead of lazily on top of the first step's gradients and temporaries
    Remedy("init_optimizer_state", "Create the optimizer state before the first batch", "one extra step at lr 0 "
           "(Adam's step counter starts at 1: the first bias correction differs slightly)",
           "for p in model.parameters():\n    p.grad = torch.zeros_like(p)\nlrs = [g['lr'] for g in optimizer.param_groups]\n"
           "for g in optimizer.param_groups:\n    g['lr'] = 0.0\noptimizer.step(); optimizer.zero_grad(set_to_none=True)\n"
           "for g, lr in zip(optimizer.param_groups, lrs):\n    g['lr'] = lr",
           lambda d: (d.first_step_excess, "low"), lambda d: d.lazy_state_trouble, acts_on=(Category.TEMPORARY,)),
    # a forward-only run that keeps the autograd graph holds every activation for a backward that never comes
    Remedy("no_grad", "If the forward runs with autograd on: run it under torch.inference_mode()",
           "none, when no backward follows", "with torch.inference_mode():   # or torch.no_grad()\n    out = model(batch)",
           lambda d: (d.graph_bytes, "low"), lambda d: d.graph_kept, acts_on=(Category.ACTIVATION,), conditional=True),
    Remedy("micro_batch", _micro_batch_title, "instant; lower throughput; very small batches can hurt convergence",
           lambda d: ("batch_size = batch_size // 2   # fewer sequences at once: the KV cache and activations scale "
                      "with batch x sequence" if d.workload == FORWARD_ONLY else
                      "batch_size = batch_size // 2   # keep the global batch with gradient accumulation"),
           lambda d: (_batch_scaled(d) // 2, "high"), _batch_advice, acts_on=_BATCH),
    Remedy("bf16", "Train in bf16 mixed precision", "small; fp16 needs loss scaling, bf16 needs Ampere or newer",
           "with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n    loss = model(batch)",
           _bf16, lambda d: _trains(d) and d.autocast is not True and d.mixed_precision is not True
           and _relevant(Category.ACTIVATION)(d), acts_on=(Category.ACTIVATION,)),
    Remedy("weight_quantization", lambda d: _quantized_title(d, "8-bit weights (bitsandbytes LLM.int8)"),
           "a new dependency; slower matmuls; small accuracy loss",
           lambda d: _quantized_how(d, "load_in_8bit=True"),
           lambda d: (untrained_weights(d) // 2, "medium"), _quantizable, acts_on=(Category.PARAMETER,)),
    Remedy("weight_quantization_4bit", lambda d: _quantized_title(d, "4-bit weights (bitsandbytes NF4)"),
           "a new dependency; slower matmuls; more accuracy loss than 8-bit",
           lambda d: _quantized_how(d, "load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.bfloat16"),
           lambda d: (untrained_weights(d) * 3 // 4, "medium"), _quantizable, acts_on=(Category.PARAMETER,)),
    Remedy("gradient_accumulation", "Gradient accumulation: 2 micro-batches of half the size",
           "slower steps; the same effective batch (BatchNorm-style layers see smaller batches)",
           "for i, chunk in enumerate(batch.chunk(2)):\n    (model(chunk).loss / 2).backward()\noptimizer.step(); optimizer.zero_grad()",
           _accumulation, lambda d: _trains(d) and _batch_advice(d), acts_on=_BATCH),
    Remedy("activation_checkpointing", "Activation checkpointing of each block", "about 20-30% more compute",
           "from torch.utils.checkpoint import checkpoint\nx = checkpoint(block, x, use_reentrant=False)",
           _checkpointing, lambda d: _trains(d) and _relevant(Category.ACTIVATION)(d), acts_on=(Category.ACTIVATION,)),
    Remedy("optimizer_8bit", "8-bit Adam (bitsandbytes)", "a new dependency; usually no accuracy loss",
           "import bitsandbytes as bnb\noptimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)",
           lambda d: (int(_optimizer_moments(d) * 0.75), "medium"), _relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,)),
    Remedy("adafactor", "Adafactor (factored second moment, no first moment)", "may need tuning of the learning rate",
           "from transformers.optimization import Adafactor\noptimizer = Adafactor(model.parameters(), lr=lr, relative_step=False)",
           lambda d: (int(_optimizer_moments(d) * 0.9), "low"), _relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,)),
    Remedy("optimizer_offload", "Offload optimizer state to CPU", _optimizer_offload_cost,
           "# DeepSpeed: \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"cpu\"}}",
           lambda d: (d.bytes(Category.OPTIMIZER_STATE), "medium"), _relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,), beyond_one_gpu=True),
    Remedy("zero1", lambda d: f"ZeRO-1: shard optimizer state {_over(d, d.bytes(Category.OPTIMIZER_STATE))}",
           "communication; needs data parallelism",
           "torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)",
           _zero(*ZERO_SHARDED["zero1"]),
           lambda d: _shards_possible(d) and _relevant(*ZERO_SHARDED["zero1"])(d), acts_on=ZERO_SHARDED["zero1"],
           beyond_one_gpu=True),
    Remedy("zero2", _zero2_title, "more communication",
           "# DeepSpeed: \"zero_optimization\": {\"stage\": 2}  |  FSDP: ShardingStrategy.SHARD_GRAD_OP",
           _zero(*ZERO_SHARDED["zero2"]),
           lambda d: _shards_possible(d) and _relevant(*ZERO_SHARDED["zero2"])(d), acts_on=ZERO_SHARDED["zero2"],
           beyond_one_gpu=True),
    Remedy("zero3", lambda d: f"ZeRO-3 / FSDP: shard parameters too, {_over(d, d.bytes(*_STATES))}",
           "most communication; parameters gathered per layer",
           "from torch.distributed.fsdp import fully_shard\nfor block in model.layers: fully_shard(block)\nfully_shard(model)",
           _zero(*ZERO_SHARDED["zero3"]),
           lambda d: _trains(d) and _shards_possible(d) and _relevant(*ZERO_SHARDED["zero3"])(d),
           acts_on=ZERO_SHARDED["zero3"], beyond_one_gpu=True),
    Remedy("tensor_parallel", lambda d: f"Tensor parallelism over {tp_gpus(d)} GPUs (inside a node)",
           "needs model code changes; fast links",
           "from torch.distributed.tensor.parallel import parallelize_module  # ColwiseParallel / RowwiseParallel",
           lambda d: (int(d.bytes(*_STATES, Category.ACTIVATION) * (1 - 1 / tp_gpus(d))), "low"),
           lambda d: _shards_possible(d) and _relevant(*_STATES, Category.ACTIVATION)(d),
           acts_on=(*_STATES, Category.ACTIVATION), beyond_one_gpu=True),
    Remedy("pipeline_parallel", _pipeline_title,
           "a pipeline bubble ((S-1)/(m+S-1) of the step idle with m micro-batches); the model split into stages",
           "from torch.distributed.pipelining import pipeline, SplitPoint, ScheduleGPipe  # or Schedule1F1B\n"
           "pipe = pipeline(model, mb_args=(micro_batch,), split_spec={'layers.16': SplitPoint.BEGINNING})",
           lambda d: (int(_pipelined(d) * (1 - 1 / pipeline_stages(d))), "low"),
           lambda d: _trains(d) and (d.layers or 0) >= PIPELINE_MIN_LAYERS and _shards_possible(d)
           and _relevant(*_STATES, Category.ACTIVATION)(d), acts_on=(*_STATES, Category.ACTIVATION, Category.TEMPORARY),
           beyond_one_gpu=True),
    Remedy("model_changes", "Model changes: GQA/MQA, efficient attention (SDPA/FlashAttention), fewer or narrower layers",
           "changes the model; may need retraining", "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)",
           lambda d: (None, "low"), _relevant(Category.ACTIVATION), acts_on=(Category.ACTIVATION,)),
    # a transient no tensor holds, where convolutions run: cuDNN's workspace, its autotuner's trials the largest
    Remedy("cudnn_benchmark_off", "Turn cuDNN's autotuner off (torch.backends.cudnn.benchmark = False)",
           "convolutions may pick slower algorithms; or cap the workspace instead (CUDNN_CONV_WSCAP_DBG=<MiB>)",
           "torch.backends.cudnn.benchmark = False   # or: export CUDNN_CONV_WSCAP_DBG=1024  (MiB of workspace)",
           lambda d: (d.bytes(UNATTRIBUTED), "low"), lambda d: "conv_workspace" in d.findings,
           acts_on=(UNATTRIBUTED,), conditional=True),
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
    Remedy("offload", lambda d: "Offload the weights to CPU (accelerate device_map='auto')" if d.workload == FORWARD_ONLY
           else "Offload parameters / activations to CPU", _offload_cost,
           lambda d: ("model = AutoModel.from_pretrained(name, device_map='auto', max_memory={0: '20GiB', 'cpu': '200GiB'})"
                      if d.workload == FORWARD_ONLY else
                      "# FSDP: CPUOffload(offload_params=True)  |  torch.autograd.graph.save_on_cpu() for activations"),
           lambda d: (d.bytes(Category.PARAMETER) + (0 if d.workload == FORWARD_ONLY else d.bytes(Category.ACTIVATION) // 2),
                      "low"),
           lambda d: _relevant(Category.PARAMETER, *(() if d.workload == FORWARD_ONLY else (Category.ACTIVATION,)))(d),
           acts_on=(Category.PARAMETER, Category.ACTIVATION), beyond_one_gpu=True),
]


LAYOUT_ONLY = {r.id for r in REMEDIES if r.layout_only}
CONDITIONAL = {r.id for r in REMEDIES if r.conditional}
FIRST = {r.id for r in REMEDIES if r.first}
BY_ID = {r.id: r for r in REMEDIES}


def count_layers(modules: list[str]) -> int | None:
    """Repeated blocks seen in module names: `layers.N`, `h.N`, `blocks.N` ... of qualified names; else, in call
    paths (Python frames only), the most calls `forward[N]` one line made (a loop over the layers). A torch.nn
    layer called N times (`torch/nn/modules/linear.py`: an MLP's Linear layers) is no block to split."""
    numbers = {m.group(1) for name in modules if (m := _LAYER.match(name))}
    if numbers:
        return len(numbers)
    calls: dict[str, set[str]] = {}
    for name in modules:
        if (m := _CALL.match(name)) is not None and _TORCH_LAYER not in m.group(1).rsplit(MODULE_PATH_SEPARATOR, 1)[-1]:
            calls.setdefault(m.group(1), set()).add(m.group(2))
    most = max((len(n) for n in calls.values()), default=0)
    return most if most >= 2 else None


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
    """The remedies that act on this run, cheapest first, with their estimates; a `first` remedy (fixing a leak)
    leads and is `try_first`, else the cheapest that fits is, and none when the run fits as it is.

    When the OOM is fragmentation, the allocator settings (free to try) come first. Their `saved_bytes` is
    reserved memory given back; the allocated peak stays, and it fits when it is within the device."""
    layout_first = demand.oom_verdict == "fragmentation"
    order = sorted(REMEDIES, key=lambda r: (not r.first, layout_first and not r.layout_only))
    grow = fits_as_is(demand) or fits_any_gpu(demand)
    out: list[dict[str, Any]] = []
    for remedy in order:
        if not remedy.applies(demand) or (remedy.beyond_one_gpu and not needs_beyond_one_gpu(demand)):
            continue
        saved, confidence = remedy.estimate(demand)
        replay = demand.replayed.get(remedy.id)
        if replay is not None and not remedy.layout_only:     # the replayed run, not the formula, says what it saves
            saved = demand.total - int(replay["peak_allocated_bytes"])
        if saved is not None and saved <= MIN_SAVING_SHARE * demand.total:
            continue
        new_peak = None if saved is None else demand.total - (0 if remedy.layout_only else saved)
        limit = 1.0 if remedy.layout_only else FIT_HEADROOM
        fits = None if new_peak is None or demand.capacity is None else new_peak <= limit * demand.capacity
        if replay is not None and replay["oom"] is not None:
            fits = bool(fits or remedy.layout_only) and not replay["oom"]
        title = remedy.title(demand) if callable(remedy.title) else remedy.title
        out.append({"id": remedy.id, "rank": len(out) + 1, "title": title, "saved_bytes": saved,
                    "new_peak_bytes": new_peak, "fits": fits, "confidence": confidence, "try_first": False,
                    "purpose": "grow" if grow else "fix", "note": _same_saving(demand, remedy, saved, out),
                    "how": remedy.how(demand) if callable(remedy.how) else remedy.how, "cost": remedy.cost(demand) if callable(remedy.cost) else remedy.cost,
                    "saving_source": "formula" if replay is None or remedy.layout_only else "replay", "replay": replay,
                    "plan_step": None})
    if grow:
        return out
    candidates = [r for r in out if r["id"] not in CONDITIONAL]
    first = next((r for r in out if r["id"] in FIRST), None) or next((r for r in candidates if r["fits"]), None)
    if first is None and demand.capacity is None:
        first = next((r for r in candidates if r["saved_bytes"] and r["saved_bytes"] >= 0.1 * demand.total), None)
    if first is not None:
        first["try_first"] = True
    return out


def _same_saving(d: Demand, remedy: Remedy, saved: int | None, cheaper: list[dict[str, Any]]) -> str | None:
    """'the same saving as #1 (Halve the micro-batch): both act on activations': why two remedies tie."""
    if saved is None:
        return None
    same = next((r for r in cheaper if r["saved_bytes"] is not None
                 and abs(r["saved_bytes"] - saved) <= SAME_SAVING_SHARE * d.total), None)
    if same is None:
        return None
    other = BY_ID[same["id"]]
    shared = [c for c in remedy.acts_on if c in other.acts_on and d.bytes(c)] or list(remedy.acts_on)
    what = " and ".join(category_plural(str(c)) for c in shared) or "the same memory"
    return (f"the same saving as #{same['rank']} ({same['title']}): both estimates rest on the {what} at the peak; "
            "the cheaper one is listed first")


def describe(remedy: dict[str, Any], capacity: int | None) -> str:
    """'Halve the micro-batch (peak 61.2 → 38.4 GiB, fits in 80 GiB)'."""
    saved, new_peak = remedy["saved_bytes"], remedy["new_peak_bytes"]
    low = "; low confidence" if remedy.get("confidence") == "low" else ""
    if saved is None or new_peak is None:
        return remedy["title"]
    fit = ""
    if capacity is not None:
        fit = f", fits in {gib(capacity)}" if remedy["fits"] else f", still above {gib(capacity)}"
    if remedy["id"] in LAYOUT_ONLY:
        return f"{remedy['title']} (gives back {gib(saved)} of fragmented memory; needed {gib(new_peak)}{fit}{low})"
    return f"{remedy['title']} (peak {gib(new_peak + saved)} → {gib(new_peak)}{fit}{low})"
