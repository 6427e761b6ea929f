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
  a leaking run is judged as without its leak (more GPUs only delay it);
- when a plan exists (analyzer.diagnose.plan, a run that does not fit a known device), it decides what to try
  first: `plan.agree` moves `try_first` to the remedy of its first step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pandas as pd

from analyzer.core.units import gib, human_bytes
from analyzer.core.vocabulary import (
    UNATTRIBUTED,
    Category,
    FindingKind,
    Phase,
    RemedyId,
    Word,
    category_plural,
)
from analyzer.diagnose.attention import fused
from analyzer.diagnose.blocks import block_paths, blocks, most_blocks, profiler_names, torch_layer_loop
from analyzer.diagnose.kv_cache import cache_scaled, uncached
from analyzer.diagnose.transforms import (
    Stream,
    accumulation,
    bf16,
    checkpointing,
    micro_batch,
    optimizer_state,
    zero,
    zero3,
)
from analyzer.result import ListedRemedy, Replayed

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
_BATCH = (Category.ACTIVATION, Category.INPUT, Category.TEMPORARY)
_STATES = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)
#: what each ZeRO stage shards over its GPUs: its estimate, its plan lever and its replay all take it from here
ZERO_SHARDED: dict[str, tuple[Category, ...]] = {RemedyId.ZERO1: (Category.OPTIMIZER_STATE,),
                                                 RemedyId.ZERO2: (Category.OPTIMIZER_STATE, Category.GRADIENT),
                                                 RemedyId.ZERO3: _STATES}


@dataclass
class Demand:
    """What the run needed at its worst moment, split by category (bytes), and facts remedies depend on."""

    total: int
    by_category: dict[str, int]
    capacity: int | None
    world_size: int | None                   # GPUs the job can shard over: --gpus, else the trace's world size
    layers: int | None                       # repeated blocks seen in module names
    split_blocks: int | None = None          # repeated blocks alive at the worst moment (None: no module named)
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
    scatter_excess: int = 0                  # batch memory above an even split of nn.DataParallel's scatter
    # counterfactual replay (analyzer.diagnose.counterfactual): remedy id -> the replayed run's peak allocated and
    # reserved bytes and whether it would still run out of memory; a remedy with one takes its saving from it
    replayed: dict[str, Replayed] = field(default_factory=dict)
    # eager attention's b·h·s² tensors alive at the worst moment, by category (analyzer.diagnose.attention)
    attention_scores: dict[str, int] = field(default_factory=dict)
    attention: bool | None = None            # the model has attention (None: the recording cannot say)
    attention_share: float = RELEVANT_SHARE  # ... its s² tensors worth fusing from this share of the peak (Thresholds)
    kv_cache_bytes: int = 0                  # a KV cache alive at the peak (analyzer.diagnose.kv_cache)
    kv_cache_quantized: bool = False         # ... which the frames show quantized already

    def bytes(self, *categories: str) -> int:
        return sum(self.by_category.get(c, 0) for c in categories)


class LeverName(Word):
    """A plan lever: one variable practitioners change, in the order the plan's search takes them
    (analyzer.diagnose.plan); a remedy is one level of one lever."""

    CHECKPOINT_SAVE = "checkpoint_save"
    FIRST_STEP = "first_step"
    ATTENTION = "attention"
    SCATTER = "scatter"
    BATCH = "batch"
    PRECISION = "precision"
    CHECKPOINTING = "checkpointing"
    OPTIMIZER = "optimizer"
    ZERO = "zero"
    TP = "tp"
    PP = "pp"
    WEIGHTS = "weights"
    LAYOUT = "layout"


class Breakdown:
    """A peak's bytes by category as a plan's changes compose: each change acts on what the previous left."""

    def __init__(self, by_category: dict[str, int], total: int):
        self.c = {k: float(v) for k, v in by_category.items()}
        self.total = float(total)

    def get(self, category: str) -> float:
        return self.c.get(category, 0.0)

    def shrink(self, category: str, factor: float) -> None:
        before = self.c.get(category, 0.0)
        self.c[category] = before * factor
        self.total -= before - self.c[category]

    def add(self, category: str, amount: float) -> None:
        self.c[category] = self.c.get(category, 0.0) + amount
        self.total += amount


#: a remedy's formula at a level (k micro-batches, N GPUs), acting on a breakdown: what the plan composes
Formula = Callable[[Demand, Breakdown, int], None]


@dataclass(frozen=True)
class Price:
    """What a change costs beside memory, as the plan names it."""

    throughput: str
    communication: str
    code: str


@dataclass(frozen=True)
class PlanLever:
    """A remedy as a level of a plan lever: its cost in the remedy list's order (so that the plan's cheapest
    single change is the list's), its formula, and the level the list's entry is at (2 micro-batches, N GPUs)."""

    lever: LeverName
    cost: float
    formula: Formula | None                       # None: only the allocator's layout changes
    value: Callable[[Demand], int | None] = lambda d: None
    layout_first_cost: float | None = None        # its cost when the OOM is fragmentation (the layout leads)
    divides_batch: bool = False                   # levels at 2, 4 and 8 micro-batches, each halving costing once


@dataclass(frozen=True)
class Replay:
    """How the counterfactual replay edits the recorded stream (analyzer.diagnose.transforms) at a level: k
    micro-batches (2 by default), or, `sharded`, the GPU count the remedy's title names."""

    transform: Callable[[Stream, int], Stream]
    expandable: bool = False     # replayed with expandable segments on
    sharded: bool = False


@dataclass(frozen=True)
class EstimateTerm:
    """The remedy as a level of `analyze estimate`'s lattice: its words, its cost in the method's order (the batch
    first, offload last; roughly the throughput it takes, so that ZeRO-1 on data-parallel GPUs, the same traffic as
    data parallel, is nearly free), and the optimizer it switches to (analyzer.diagnose.theory.OPTIMIZERS)."""

    title: str
    cost: float
    optimizer: str | None = None


@dataclass(frozen=True, kw_only=True)
class Remedy:
    """One remedy, whole: every part is given (None where it has none), so none is forgotten."""

    id: RemedyId
    title: str | Callable[[Demand], str]
    cost: str | Callable[[Demand], str]
    how: str | Callable[[Demand], str]                     # code, or code written for this run
    estimate: Callable[[Demand], tuple[int | None, str]]   # (bytes saved, confidence)
    applies: Callable[[Demand], bool]
    acts_on: tuple[str, ...]    # the categories it shrinks (what a before/after diff must show shrinking)
    price: Price | None         # throughput, communication, code: the plan's words for what it costs
    plan: PlanLever | None      # its place in a recording's plan; None: not a lever
    replay: Replay | None       # None: the formula alone predicts it
    estimate_term: EstimateTerm | None   # None: `analyze estimate` does not offer it
    docs: str                   # the estimate in words, for the remedies table of the docs
    first: bool = False         # tried before everything else whenever it applies, fit or not
    conditional: bool = False   # rests on a premise the recording cannot confirm: listed, never tried first
    beyond_one_gpu: bool = False  # parallelism or offload: for states or a batch that do not fit one GPU

    @property
    def layout_only(self) -> bool:
        """Frees reserved-but-unused memory: the allocated peak stays, the layout fits it (RemedyId.layout_only)."""
        return self.id.layout_only

    @property
    def variables(self) -> tuple[str, ...]:
        """The run log's config variables it changes (RemedyId.variables)."""
        return self.id.variables


def fits_any_gpu(d: Demand) -> bool:
    """Without a known device: the run would fit as it is on the smallest GPU people train on (SMALLEST_GPU),
    so it fits on any of them, whichever it ran on."""
    return d.capacity is None and fits_as_is(replace(d, capacity=SMALLEST_GPU))


def fits_as_is(d: Demand) -> bool:
    """No OOM, a known device, AMPLE_HEADROOM of it left at the allocated peak and the reserve within it; and
    no leak, which runs out later whatever the headroom today."""
    if d.oomed or d.capacity is None or FindingKind.LEAK in d.findings:
        return False
    reserved = d.reserved_peak if d.reserved_peak is not None else d.total
    return d.total <= (1 - AMPLE_HEADROOM) * d.capacity and reserved <= FIT_HEADROOM * d.capacity


def needs_beyond_one_gpu(d: Demand) -> bool:
    """Parallelism and offload are worth their cost: the run does not fit as it is, or its model states hold at
    least SHARD_TO_GROW_SHARE of the device (SMALLEST_GPU where it is not known), leaving the batch too little.
    A leak is judged without it: more GPUs only delay an out of memory that grows every step, as a smaller batch
    does."""
    if FindingKind.LEAK in d.findings:
        d = replace(d, findings=d.findings - {FindingKind.LEAK})
    if not (fits_as_is(d) or fits_any_gpu(d)):
        return True
    device = d.capacity if d.capacity is not None else SMALLEST_GPU
    return d.bytes(*_STATES) >= SHARD_TO_GROW_SHARE * device


def _splittable(d: Demand) -> bool:
    """Tensor and pipeline parallelism split repeated blocks: where the recording names the modules alive at the
    worst moment, at least PIPELINE_MIN_LAYERS blocks must be among them (`split_blocks`); a graph network's loop
    over one torch.nn layer, or a frozen encoder's blocks run before the peak, are none. Where it names none
    (None), the model's structure is unknown and is not held against them."""
    return d.split_blocks is None or d.split_blocks >= PIPELINE_MIN_LAYERS


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
    """The categories hold at least RELEVANT_SHARE of the peak, and something: a device that held nothing (a
    peak of 0 B) has no remedy."""
    return lambda d: 0 < d.bytes(*categories) >= RELEVANT_SHARE * d.total


def _trains(d: Demand) -> bool:
    """Remedies of a backward pass or of gradients: training, or a run that ended before it could show one."""
    return d.workload != FORWARD_ONLY


def _shards_possible(d: Demand) -> bool:
    return d.world_size != 1


def _batch_advice(d: Demand) -> bool:
    """Batch size acts on activations, inputs and temporaries; against a leak it only delays the out of memory."""
    return d.triage != "leak" and _relevant(*_BATCH)(d)


def _micro_batch_title(d: Demand) -> str:
    """A forward's batch is its inputs: a sequence for a model with attention, an image size for a CNN."""
    if d.workload != FORWARD_ONLY:
        return "Halve the micro-batch"
    return "Halve the batch (or the input size)" if d.attention is False else "Halve the batch (or the sequence length)"


def _micro_batch_how(d: Demand) -> str:
    """The KV cache is named only where the recording shows one: a BERT forward or a CNN keeps none."""
    if d.workload != FORWARD_ONLY:
        return "batch_size = batch_size // 2   # keep the global batch with gradient accumulation"
    if d.kv_cache_bytes:
        return "batch_size = batch_size // 2   # fewer sequences at once: the KV cache and activations scale with batch x sequence"
    return "batch_size = batch_size // 2   # fewer inputs at once: the activations scale with the batch"


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


def scores_relevant(d: Demand) -> bool:
    """Eager attention's s² tensors hold at least `attention_share` (RELEVANT_SHARE) of the peak."""
    return 0 < sum(d.attention_scores.values()) >= d.attention_share * d.total


def _fused_formula(d: Demand, b: Breakdown, k: int) -> None:
    """Each category less its s² tensors, in the share they hold of it at the recorded peak."""
    for category, scores in d.attention_scores.items():
        recorded = d.by_category.get(category, 0)
        if recorded:
            b.shrink(category, max(0.0, 1 - scores / recorded))


def _kv_relevant(d: Demand) -> bool:
    return d.workload == FORWARD_ONLY and 0 < d.kv_cache_bytes >= RELEVANT_SHARE * d.total


def _model_changes_title(d: Demand) -> str:
    """Attention's changes only for a model the recording shows has attention; a CNN's are its layers."""
    if d.attention is False:
        return "Model changes: fewer or narrower layers (or a smaller input)"
    gqa = ("GQA/MQA (4 query heads a KV head: 3/4 of the KV cache)" if d.kv_cache_bytes else "GQA/MQA")
    if d.attention:
        return f"Model changes: {gqa}, fewer or narrower layers"
    return "Model changes: fewer or narrower layers; with attention, GQA/MQA or fused attention (SDPA/FlashAttention)"


def _model_changes_how(d: Demand) -> str:
    if d.attention is False:
        return "# a smaller configuration of the same architecture: fewer blocks, fewer channels"
    if d.attention:
        return "# GQA: num_key_value_heads = num_attention_heads // 4 (needs retraining or uptraining)"
    return "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)"


# ---- formulas: each acts on a breakdown at a level, as its remedy's estimate does on the recorded one ----

def _divide(*categories: str) -> Formula:
    """Each category 1/k: the batch split into k, or a state sharded over k GPUs."""
    def formula(d: Demand, b: Breakdown, k: int) -> None:
        for category in categories:
            b.shrink(category, 1 / k)
    return formula


def _even_split_formula(d: Demand, b: Breakdown, k: int) -> None:
    """The batch-scaled memory less this GPU's share above an even split, each category in proportion."""
    batch = sum(b.get(c) for c in _BATCH)
    for category in _BATCH:
        b.shrink(category, 1 - d.scatter_excess / batch if batch else 1.0)


def _accumulation_formula(d: Demand, b: Breakdown, k: int) -> None:
    """The batch-scaled memory 1/k, and the gradients of the trainable part kept alive through the micro-batches."""
    _divide(*_BATCH)(d, b, k)
    b.add(Category.GRADIENT, max(0.0, b.get(Category.PARAMETER) * (1 - (d.frozen_share or 0.0)) - b.get(Category.GRADIENT)))


def _bf16_formula(d: Demand, b: Breakdown, k: int) -> None:
    act = b.get(Category.ACTIVATION)
    b.shrink(Category.ACTIVATION, max(0.0, 1 - max(0.0, act / 2 - b.get(Category.PARAMETER) / 2) / act) if act else 1.0)


def _checkpointing_formula(d: Demand, b: Breakdown, k: int) -> None:
    act, recorded = b.get(Category.ACTIVATION), float(d.by_category.get(Category.ACTIVATION, 0) or 1)
    saved = (d.checkpointable if d.checkpointable is not None else recorded / 2) * act / recorded
    b.shrink(Category.ACTIVATION, 1 - saved / act if act else 1.0)


@dataclass(frozen=True)
class _SmallerMoments:
    """An optimizer whose moments keep `kept` of Adam's (8-bit: a byte of four, Adafactor's factored second
    moment ~1/10): the one number its estimate, its formula and its replay take."""

    kept: float

    def estimate(self, d: Demand) -> int:
        return int(_optimizer_moments(d) * (1 - self.kept))

    def formula(self, d: Demand, b: Breakdown, k: int) -> None:
        b.shrink(Category.OPTIMIZER_STATE, 1 - (1 - self.kept) * (8 / 12 if d.mixed_precision else 1.0))

    def transform(self, s: Stream, k: int) -> Stream:
        return optimizer_state(s, self.kept)


_ADAM_8BIT = _SmallerMoments(0.25)
_ADAFACTOR = _SmallerMoments(0.1)


def _offload_optimizer_formula(d: Demand, b: Breakdown, k: int) -> None:
    b.shrink(Category.OPTIMIZER_STATE, 0.0)


def _quantized(saved_share: float) -> Formula:
    """The untrained weights `saved_share` smaller (8-bit: half of 16-bit weights, 4-bit: three quarters)."""
    def formula(d: Demand, b: Breakdown, k: int) -> None:
        parameters = float(d.bytes(Category.PARAMETER))
        share = untrained_weights(d) / parameters if parameters else 0.0
        b.shrink(Category.PARAMETER, 1 - share * saved_share)
    return formula


def _offload_formula(d: Demand, b: Breakdown, k: int) -> None:
    b.shrink(Category.PARAMETER, 0.0)
    if d.workload != FORWARD_ONLY:
        b.shrink(Category.ACTIVATION, 0.5)


def _state_dict_offload_formula(d: Demand, b: Breakdown, k: int) -> None:
    b.shrink(Category.OTHER, 0.0)


def _sharded_save_formula(d: Demand, b: Breakdown, k: int) -> None:
    b.shrink(Category.OTHER, 1 / gpus_for(d, d.bytes(Category.OTHER))[0])


def _init_state_formula(d: Demand, b: Breakdown, k: int) -> None:
    temporary = b.get(Category.TEMPORARY)
    b.shrink(Category.TEMPORARY, max(0.0, 1 - (d.first_step_excess or 0) / temporary) if temporary else 1.0)


def _zero_shards_of(remedy: RemedyId) -> Callable[[Demand], int | None]:
    return lambda d: zero_shards(d)[remedy]


def _zero_transform(stage: int) -> Callable[[Stream, int], Stream]:
    return (lambda s, n: zero3(s, n)) if stage == 3 else (lambda s, n: zero(s, stage, n))


def _never(d: Demand) -> bool:
    return False


_BATCH_PRICE = Price("smaller matmuls, k accumulation steps per optimizer step", "none",
                     "divide the batch, accumulate k micro-batches (same global batch)")
_ZERO_TRAFFIC = "the same traffic (a reduce-scatter and an all-gather)"

# The registry: one spec a remedy, in the order practitioners try them (the remedy list's order)
REMEDIES: list[Remedy] = [
    Remedy(id=RemedyId.FIX_LEAK, title="Fix the leak: stop keeping memory from every step", cost="a code change",
           how=_fix_leak_how, estimate=lambda d: (d.leak_bytes, "high"), applies=lambda d: d.triage == "leak",
           acts_on=(), price=None, plan=None, replay=None, estimate_term=None, first=True,
           docs="what the leaking stacks keep (first, and the only size advice withheld, when the triage says leak)"),
    # the saving-a-checkpoint spike has its own cheap fixes, tried before anything that changes training
    Remedy(id=RemedyId.STATE_DICT_OFFLOAD, title="Gather the state dict to CPU while saving", cost="a slower save",
           how="from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions\n"
               "sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))",
           estimate=lambda d: (d.bytes(Category.OTHER), "medium"), applies=lambda d: FindingKind.CHECKPOINT_GATHER in d.findings,
           acts_on=(Category.OTHER,), price=Price("a slower save", "none", "get_state_dict(..., cpu_offload=True)"),
           plan=PlanLever(LeverName.CHECKPOINT_SAVE, 0.1, _state_dict_offload_formula), replay=None, estimate_term=None,
           docs="the gathered copies (when a checkpoint gather spike is found)"),
    Remedy(id=RemedyId.SHARDED_SAVE, title="Save a sharded checkpoint (torch.distributed.checkpoint)",
           cost="a directory of shards instead of one file",
           how="import torch.distributed.checkpoint as dcp\ndcp.save({'model': model.state_dict()}, checkpoint_id=path)",
           estimate=lambda d: (int(d.bytes(Category.OTHER) * (1 - 1 / gpus_for(d, d.bytes(Category.OTHER))[0])), "medium"),
           applies=lambda d: FindingKind.CHECKPOINT_GATHER in d.findings and _shards_possible(d), acts_on=(Category.OTHER,),
           price=Price("none measurable", "none", "torch.distributed.checkpoint.save (a directory of shards)"),
           plan=PlanLever(LeverName.CHECKPOINT_SAVE, 0.2, _sharded_save_formula), replay=None, estimate_term=None,
           docs="(1 − 1/N) of the gathered copies, N GPUs (when a checkpoint gather spike is found)"),
    # story 5: the first optimizer step OOMs while later ones would fit: create Adam's state up front, in a clean
    # allocator, instead of lazily on top of the first step's gradients and temporaries
    Remedy(id=RemedyId.INIT_OPTIMIZER_STATE, title="Create the optimizer state before the first batch",
           cost="one extra step at lr 0 (Adam's step counter starts at 1: the first bias correction differs slightly)",
           how="for p in model.parameters():\n    p.grad = torch.zeros_like(p)\nlrs = [g['lr'] for g in optimizer.param_groups]\n"
               "for g in optimizer.param_groups:\n    g['lr'] = 0.0\noptimizer.step(); optimizer.zero_grad(set_to_none=True)\n"
               "for g, lr in zip(optimizer.param_groups, lrs):\n    g['lr'] = lr",
           estimate=lambda d: (d.first_step_excess, "low"), applies=lambda d: d.lazy_state_trouble,
           acts_on=(Category.TEMPORARY,),
           price=Price("one extra step at lr 0", "none", "create the optimizer state before the first batch"),
           plan=PlanLever(LeverName.FIRST_STEP, 0.3, _init_state_formula), replay=None, estimate_term=None,
           docs="when the first optimizer step (lazy state creation) OOMs or peaks above the later ones: how much "
                "higher it peaks (unquantified when no later step was recorded)"),
    # a forward-only run that keeps the autograd graph holds every activation for a backward that never comes
    Remedy(id=RemedyId.NO_GRAD, title="If the forward runs with autograd on: run it under torch.inference_mode()",
           cost="none, when no backward follows",
           how="with torch.inference_mode():   # or torch.no_grad()\n    out = model(batch)",
           estimate=lambda d: (d.graph_bytes, "low"), applies=lambda d: d.graph_kept, acts_on=(Category.ACTIVATION,),
           price=None, plan=None, replay=None, estimate_term=None, conditional=True,
           docs="forward only with activations kept: all of them but the latest (the output); conditional"),
    # nn.DataParallel scattered the batch by count and this GPU got the larger inputs (analyzer.diagnose.imbalance):
    # an even split keeps the batch, so it comes before any cut of it
    Remedy(id=RemedyId.BALANCE_SCATTER,
           title="Split each batch by size, not by count: nn.DataParallel gave this GPU the larger inputs",
           cost="a balancing split of each batch; the same batch",
           how="loads, shares = [0] * n_gpus, [[] for _ in range(n_gpus)]\n"
               "for i in sorted(range(len(batch)), key=lambda i: -size(batch[i])):   # nodes, edges or tokens\n"
               "    g = loads.index(min(loads)); shares[g].append(batch[i]); loads[g] += size(batch[i])",
           estimate=lambda d: (d.scatter_excess, "low"), applies=lambda d: d.scatter_excess > 0, acts_on=_BATCH,
           price=Price("none measurable", "none", "split each batch by size"),
           plan=PlanLever(LeverName.SCATTER, 0.5, _even_split_formula), replay=None, estimate_term=None,
           docs="what this GPU holds of the batch above the devices' mean, when nn.DataParallel's split by count "
                "made it the heavy one (the imbalance finding's scatter cause); low confidence: whole samples"),
    # eager attention's b·h·s² scores and probabilities, and their gradients, which fused attention never makes
    Remedy(id=RemedyId.FUSED_ATTENTION,
           title="Fused attention (torch.nn.functional.scaled_dot_product_attention, no s x s scores kept)",
           cost="a code change; faster, and the same result up to rounding",
           how="out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)"
               "   # instead of softmax(q @ k.transpose(-2, -1) / sqrt(d)) @ v",
           estimate=lambda d: (sum(d.attention_scores.values()), "medium"), applies=scores_relevant,
           acts_on=(Category.ACTIVATION, Category.TEMPORARY),
           price=Price("faster (fewer reads and writes of the s x s matrix)", "none",
                       "F.scaled_dot_product_attention in place of the hand-written attention"),
           plan=PlanLever(LeverName.ATTENTION, 0.9, _fused_formula), replay=Replay(lambda s, k: fused(s)),
           estimate_term=None,
           docs="eager attention's b·h·s² tensors (a softmax over a matmul in each repeated block: scores, "
                "probabilities, their gradients) alive at the peak; replayed without them, forward and backward"),
    # a forward-only run's KV cache: its size is batch x context x layers x 2 x KV heads x head size
    Remedy(id=RemedyId.KV_CACHE_OFF, title="If no text is generated: run the forward with use_cache=False",
           cost="none when the outputs are scored, not generated; generation then recomputes every step",
           how="out = model(input_ids, use_cache=False)   # no past_key_values kept",
           estimate=lambda d: (d.kv_cache_bytes, "medium"), applies=_kv_relevant, acts_on=(Category.ACTIVATION,),
           price=None, plan=None, replay=Replay(lambda s, k: uncached(s)), estimate_term=None, conditional=True,
           docs="the KV cache alive at the peak (forward only, when the kv_cache finding names one); replayed with "
                "each of its tensors freed at the end of the layer's call that made it, the formula (the cache's "
                "bytes) without an allocation history; conditional: generation needs the cache"),
    Remedy(id=RemedyId.KV_CACHE_QUANTIZED, title="A quantized KV cache (int8: half of a 16-bit cache), or a paged one",
           cost="small accuracy loss; a paged cache (vLLM) allocates blocks as sequences grow instead",
           how="out = model.generate(**inputs, cache_implementation='quantized',\n"
               "                     cache_config={'backend': 'quanto', 'nbits': 8})",
           estimate=lambda d: (d.kv_cache_bytes // 2, "low"),
           applies=lambda d: _kv_relevant(d) and not d.kv_cache_quantized, acts_on=(Category.ACTIVATION,),
           price=None, plan=None, replay=Replay(lambda s, k: cache_scaled(s, 0.5)), estimate_term=None,
           docs="half the KV cache alive at the peak (int8 from 16 bits; not where the frames show it quantized "
                "already); replayed with each of its tensors at half its bytes, the formula without a history"),
    Remedy(id=RemedyId.MICRO_BATCH, title=_micro_batch_title,
           cost="instant; lower throughput; very small batches can hurt convergence",
           how=_micro_batch_how,
           estimate=lambda d: (_batch_scaled(d) // 2, "high"), applies=_batch_advice, acts_on=_BATCH,
           price=_BATCH_PRICE, plan=PlanLever(LeverName.BATCH, 1.0, _divide(*_BATCH), lambda d: 2, divides_batch=True),
           replay=Replay(micro_batch), estimate_term=EstimateTerm("micro-batch {b} with gradient accumulation x{k}", 0.5),
           docs="half of activations + inputs + temporaries (forward only: \"halve the batch (or the "
                              "sequence length)\", or \"the input size\" for a model without attention; the KV cache "
                              "named only where one is seen)"),
    Remedy(id=RemedyId.BF16, title="Train in bf16 mixed precision",
           cost="small; fp16 needs loss scaling, bf16 needs Ampere or newer",
           how="with torch.autocast(device_type='cuda', dtype=torch.bfloat16):\n    loss = model(batch)",
           estimate=_bf16, applies=lambda d: _trains(d) and d.autocast is not True and d.mixed_precision is not True
           and _relevant(Category.ACTIVATION)(d), acts_on=(Category.ACTIVATION,),
           price=Price("faster on tensor cores", "halved gradient traffic", "torch.autocast(dtype=torch.bfloat16)"),
           plan=PlanLever(LeverName.PRECISION, 1.5, _bf16_formula), replay=Replay(lambda s, k: bf16(s)),
           estimate_term=None,
           docs="half of activations less the bf16 weight copies autocast keeps (an upper bound, low confidence; "
                "training only, offered when autocast is not seen on and the model states do not already look "
                "mixed precision)"),
    Remedy(id=RemedyId.WEIGHT_QUANTIZATION, title=lambda d: _quantized_title(d, "8-bit weights (bitsandbytes LLM.int8)"),
           cost="a new dependency; slower matmuls; small accuracy loss",
           how=lambda d: _quantized_how(d, "load_in_8bit=True"),
           estimate=lambda d: (untrained_weights(d) // 2, "medium"), applies=_quantizable, acts_on=(Category.PARAMETER,),
           price=Price("slower matmuls (weights dequantized on the fly)", "none",
                       "BitsAndBytesConfig(load_in_8bit=True) (a new dependency)"),
           plan=PlanLever(LeverName.WEIGHTS, 1.6, _quantized(0.5)), replay=None, estimate_term=None,
           docs="half of the weights nothing trains (from 16-bit; more from fp32): a forward-only run's, a frozen "
                "base's (QLoRA), all at an OOM while loading; only when they are ≥ 25% of the peak"),
    Remedy(id=RemedyId.WEIGHT_QUANTIZATION_4BIT, title=lambda d: _quantized_title(d, "4-bit weights (bitsandbytes NF4)"),
           cost="a new dependency; slower matmuls; more accuracy loss than 8-bit",
           how=lambda d: _quantized_how(d, "load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                                           "bnb_4bit_compute_dtype=torch.bfloat16"),
           estimate=lambda d: (untrained_weights(d) * 3 // 4, "medium"), applies=_quantizable,
           acts_on=(Category.PARAMETER,), price=Price("slower matmuls (weights dequantized on the fly)", "none",
                                                     "BitsAndBytesConfig(load_in_4bit=True) (a new dependency)"),
           plan=PlanLever(LeverName.WEIGHTS, 1.7, _quantized(0.75)), replay=None, estimate_term=None,
           docs="three quarters of the weights nothing trains, where `weight_quantization` would offer half"),
    Remedy(id=RemedyId.GRADIENT_ACCUMULATION, title="Gradient accumulation: 2 micro-batches of half the size",
           cost="slower steps; the same effective batch (BatchNorm-style layers see smaller batches)",
           how="for i, chunk in enumerate(batch.chunk(2)):\n    (model(chunk).loss / 2).backward()\n"
               "optimizer.step(); optimizer.zero_grad()",
           estimate=_accumulation, applies=lambda d: _trains(d) and _batch_advice(d), acts_on=_BATCH,
           price=_BATCH_PRICE,
           plan=PlanLever(LeverName.BATCH, 1.75, _accumulation_formula, lambda d: 2, divides_batch=True),
           replay=Replay(accumulation), estimate_term=None,
           docs="as `micro_batch`, less the gradients the first micro-batch leaves alive through the second"),
    # `analyze estimate` only: a recording cannot tell the attention core's activations apart from the rest
    Remedy(id=RemedyId.SELECTIVE_CHECKPOINTING, title="Selective activation checkpointing (the attention core)",
           cost="about 5% more compute (attention recomputed)",
           how="# Megatron: --recompute-granularity selective", estimate=lambda d: (None, "low"), applies=_never,
           acts_on=(Category.ACTIVATION,),
           price=Price("about 5% more compute (attention recomputed)", "none",
                       "checkpoint the attention core only (Megatron --recompute-granularity selective)"),
           plan=None, replay=None,
           estimate_term=EstimateTerm("selective activation checkpointing (attention)", 2.0),
           docs="`analyze estimate` only, for attention that is not fused: the attention scores (Korthikanti et al.)"),
    Remedy(id=RemedyId.ACTIVATION_CHECKPOINTING, title="Activation checkpointing of each block",
           cost="about 20-30% more compute",
           how="from torch.utils.checkpoint import checkpoint\nx = checkpoint(block, x, use_reentrant=False)",
           estimate=_checkpointing, applies=lambda d: _trains(d) and _relevant(Category.ACTIVATION)(d),
           acts_on=(Category.ACTIVATION,),
           price=Price("about 20-30% more compute (one more forward)", "none", "torch.utils.checkpoint around each block"),
           plan=PlanLever(LeverName.CHECKPOINTING, 3.0, _checkpointing_formula), replay=Replay(lambda s, k: checkpointing(s)),
           estimate_term=EstimateTerm("full activation checkpointing", 3.0),
           docs="the activations inside the repeated blocks (`layers.N` ...) less each block's output; without block "
                "names, activations × (1 − 2/L), or half"),
    Remedy(id=RemedyId.OPTIMIZER_8BIT, title="8-bit Adam (bitsandbytes)", cost="a new dependency; usually no accuracy loss",
           how="import bitsandbytes as bnb\noptimizer = bnb.optim.AdamW8bit(model.parameters(), lr=lr)",
           estimate=lambda d: (_ADAM_8BIT.estimate(d), "medium"), applies=_relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,),
           price=Price("none measurable", "none", "bitsandbytes AdamW8bit (a new dependency)"),
           plan=PlanLever(LeverName.OPTIMIZER, 4.0, _ADAM_8BIT.formula), replay=Replay(_ADAM_8BIT.transform),
           estimate_term=EstimateTerm("8-bit Adam", 4.5, "adam_8bit"),
           docs="75% of Adam's moments (all state when fp32, 8/12 of it with fp32 master weights)"),
    Remedy(id=RemedyId.ADAFACTOR, title="Adafactor (factored second moment, no first moment)",
           cost="may need tuning of the learning rate",
           how="from transformers.optimization import Adafactor\n"
               "optimizer = Adafactor(model.parameters(), lr=lr, relative_step=False)",
           estimate=lambda d: (_ADAFACTOR.estimate(d), "low"), applies=_relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,),
           price=Price("none measurable", "none", "Adafactor (may need learning-rate tuning)"),
           plan=PlanLever(LeverName.OPTIMIZER, 4.25, _ADAFACTOR.formula), replay=Replay(_ADAFACTOR.transform),
           estimate_term=EstimateTerm("Adafactor", 5.5, "adafactor"),
           docs="90% of Adam's moments (all state when fp32, 8/12 of it with fp32 master weights)"),
    Remedy(id=RemedyId.OPTIMIZER_OFFLOAD, title="Offload optimizer state to CPU", cost=_optimizer_offload_cost,
           how="# DeepSpeed: \"zero_optimization\": {\"stage\": 1, \"offload_optimizer\": {\"device\": \"cpu\"}}",
           estimate=lambda d: (d.bytes(Category.OPTIMIZER_STATE), "medium"), applies=_relevant(Category.OPTIMIZER_STATE),
           acts_on=(Category.OPTIMIZER_STATE,),
           price=Price("optimizer step on the CPU, bounded by PCIe", "gradients and weights over PCIe each step",
                       "DeepSpeed offload_optimizer"),
           plan=PlanLever(LeverName.OPTIMIZER, 4.5, _offload_optimizer_formula),
           replay=Replay(lambda s, k: optimizer_state(s, 0.0, step_temporaries=0.0)),
           estimate_term=EstimateTerm("optimizer state offloaded to CPU", 7.0, "offloaded"),
           beyond_one_gpu=True,
           docs="all of the optimizer state (and, replayed, the optimizer step's temporaries)"),
    Remedy(id=RemedyId.ZERO1, title=lambda d: f"ZeRO-1: shard optimizer state {_over(d, d.bytes(Category.OPTIMIZER_STATE))}",
           cost="communication; needs data parallelism",
           how="torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)",
           estimate=_zero(*ZERO_SHARDED[RemedyId.ZERO1]),
           applies=lambda d: _shards_possible(d) and _relevant(*ZERO_SHARDED[RemedyId.ZERO1])(d),
           acts_on=ZERO_SHARDED[RemedyId.ZERO1], price=Price("throughput about that of data parallel", _ZERO_TRAFFIC,
                                                            "ZeroRedundancyOptimizer / DeepSpeed stage 1"),
           plan=PlanLever(LeverName.ZERO, 4.75, _divide(*ZERO_SHARDED[RemedyId.ZERO1]), _zero_shards_of(RemedyId.ZERO1)),
           replay=Replay(_zero_transform(1), sharded=True), estimate_term=EstimateTerm("ZeRO-1", 0.25),
           beyond_one_gpu=True,
           docs="(1 − 1/N) of optimizer state; N named in the title; not with one GPU"),
    Remedy(id=RemedyId.ZERO2, title=_zero2_title, cost="more communication",
           how="# DeepSpeed: \"zero_optimization\": {\"stage\": 2}  |  FSDP: ShardingStrategy.SHARD_GRAD_OP",
           estimate=_zero(*ZERO_SHARDED[RemedyId.ZERO2]),
           applies=lambda d: _shards_possible(d) and _relevant(*ZERO_SHARDED[RemedyId.ZERO2])(d),
           acts_on=ZERO_SHARDED[RemedyId.ZERO2], price=Price("throughput about that of data parallel", _ZERO_TRAFFIC,
                                                            "FSDP SHARD_GRAD_OP / DeepSpeed stage 2"),
           plan=PlanLever(LeverName.ZERO, 5.0, _divide(*ZERO_SHARDED[RemedyId.ZERO2]), _zero_shards_of(RemedyId.ZERO2)),
           replay=Replay(_zero_transform(2), sharded=True), estimate_term=EstimateTerm("ZeRO-2", 5.0),
           beyond_one_gpu=True,
           docs="(1 − 1/N) of optimizer state and gradients; N named in the title; not with one GPU"),
    Remedy(id=RemedyId.ZERO3, title=lambda d: f"ZeRO-3 / FSDP: shard parameters too, {_over(d, d.bytes(*_STATES))}",
           cost="most communication; parameters gathered per layer",
           how="from torch.distributed.fsdp import fully_shard\nfor block in model.layers: fully_shard(block)\n"
               "fully_shard(model)",
           estimate=_zero(*ZERO_SHARDED[RemedyId.ZERO3]),
           applies=lambda d: _trains(d) and _shards_possible(d) and _relevant(*ZERO_SHARDED[RemedyId.ZERO3])(d),
           acts_on=ZERO_SHARDED[RemedyId.ZERO3],
           price=Price("parameters gathered per layer", "1.5x data parallel (all-gather in forward and backward)",
                       "FSDP fully_shard / DeepSpeed stage 3"),
           plan=PlanLever(LeverName.ZERO, 6.0, _divide(*ZERO_SHARDED[RemedyId.ZERO3]), _zero_shards_of(RemedyId.ZERO3)),
           replay=Replay(_zero_transform(3), sharded=True), estimate_term=EstimateTerm("ZeRO-3", 6.0),
           beyond_one_gpu=True,
           docs="(1 − 1/N) of optimizer state, gradients and parameters; N named in the title; "
                                     "not with one GPU, nor for forward only"),
    Remedy(id=RemedyId.TENSOR_PARALLEL, title=lambda d: f"Tensor parallelism over {tp_gpus(d)} GPUs (inside a node)",
           cost="needs model code changes; fast links",
           how="from torch.distributed.tensor.parallel import parallelize_module  # ColwiseParallel / RowwiseParallel",
           estimate=lambda d: (int(d.bytes(*_STATES, Category.ACTIVATION) * (1 - 1 / tp_gpus(d))), "low"),
           applies=lambda d: _splittable(d) and _shards_possible(d) and _relevant(*_STATES, Category.ACTIVATION)(d),
           acts_on=(*_STATES, Category.ACTIVATION),
           price=Price("smaller matmuls per GPU", "2 all-reduces of activations per layer, forward and backward "
                       "(inside a node)", "model code changes (parallelize_module)"),
           plan=PlanLever(LeverName.TP, 8.0, _divide(Category.OPTIMIZER_STATE, Category.GRADIENT, Category.PARAMETER,
                                                 Category.ACTIVATION), tp_gpus),
           replay=None, estimate_term=EstimateTerm("tensor parallel over {k} GPUs", 8.0),
           beyond_one_gpu=True,
           docs="(1 − 1/N) of model states and activations, N = the GPUs given (at most 8, inside a node), else 2"),
    Remedy(id=RemedyId.PIPELINE_PARALLEL, title=_pipeline_title,
           cost="a pipeline bubble ((S-1)/(m+S-1) of the step idle with m micro-batches); the model split into stages",
           how="from torch.distributed.pipelining import pipeline, SplitPoint, ScheduleGPipe  # or Schedule1F1B\n"
               "pipe = pipeline(model, mb_args=(micro_batch,), split_spec={'layers.16': SplitPoint.BEGINNING})",
           estimate=lambda d: (int(_pipelined(d) * (1 - 1 / pipeline_stages(d))), "low"),
           applies=lambda d: _trains(d) and (d.layers or 0) >= PIPELINE_MIN_LAYERS and _splittable(d) and _shards_possible(d)
           and _relevant(*_STATES, Category.ACTIVATION)(d), acts_on=(*_STATES, Category.ACTIVATION, Category.TEMPORARY),
           price=Price("pipeline bubble: (p-1)/(m+p-1) of the step idle with m micro-batches",
                       "activations point to point between stages",
                       "split the model into stages (torch.distributed.pipelining)"),
           # remedies._pipelined: a stage's layers, S micro-batches in flight
           plan=PlanLever(LeverName.PP, 8.5, _divide(Category.OPTIMIZER_STATE, Category.GRADIENT, Category.PARAMETER,
                                                 Category.ACTIVATION, Category.TEMPORARY), pipeline_stages),
           replay=None, estimate_term=EstimateTerm("{k} pipeline stages (1F1B)", 8.5),
           beyond_one_gpu=True,
           docs="(1 − 1/S) of model states, activations and temporaries (1F1B, the batch as S micro-batches: the first "
                "stage holds S of them in flight over L/S layers), S = the GPUs given (at most L), else the fewest "
                "that fit, else 8; a run that trains, L ≥ 2 repeated blocks, not one GPU; low confidence (a formula)"),
    Remedy(id=RemedyId.MODEL_CHANGES, title=_model_changes_title,
           cost="changes the model; may need retraining",
           how=_model_changes_how,
           estimate=lambda d: (d.kv_cache_bytes * 3 // 4 if _kv_relevant(d) else None, "low"),
           applies=_relevant(Category.ACTIVATION), acts_on=(Category.ACTIVATION,),
           price=None, plan=None, replay=None, estimate_term=None, conditional=True,
           docs="GQA/MQA, fused attention, smaller model: listed, not quantified, but for GQA's 3/4 of a KV cache "
                "the kv_cache finding names (a formula: the change is offered beyond the cache, and the group count "
                "is assumed); attention's changes only where the recording shows attention (none for a CNN)"),
    # a transient no tensor holds, where convolutions run: cuDNN's workspace, its autotuner's trials the largest
    Remedy(id=RemedyId.CUDNN_BENCHMARK_OFF, title="Turn cuDNN's autotuner off (torch.backends.cudnn.benchmark = False)",
           cost="convolutions may pick slower algorithms; or cap the workspace instead (CUDNN_CONV_WSCAP_DBG=<MiB>)",
           how="torch.backends.cudnn.benchmark = False   # or: export CUDNN_CONV_WSCAP_DBG=1024  (MiB of workspace)",
           estimate=lambda d: (d.bytes(UNATTRIBUTED), "low"), applies=lambda d: FindingKind.CONV_WORKSPACE in d.findings,
           acts_on=(), price=None, plan=None, replay=None, estimate_term=None,   # no category: a transient
           conditional=True, docs="the transient no tensor holds where convolutions run (when the conv_workspace "
                                  "finding names cuDNN's workspace or autotuner)"),
    Remedy(id=RemedyId.EXPANDABLE_SEGMENTS, title="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
           cost="none measurable", how="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
           estimate=lambda d: (d.recoverable_fragmentation, "medium"),
           applies=lambda d: d.expandable_segments is not True and (FindingKind.FRAGMENTATION in d.findings
                                                                    or FindingKind.RESERVED_GROWTH in d.findings or d.oom_verdict == "fragmentation"),
           acts_on=(), price=Price("none measurable", "none", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
           plan=PlanLever(LeverName.LAYOUT, 9.0, None, layout_first_cost=0.05),
           replay=Replay(lambda s, k: s, expandable=True), estimate_term=None,
           docs="the free pieces inside used segments given back (not the cache); only when fragmentation caused or "
                "nearly caused an OOM; first when the OOM is fragmentation"),
    Remedy(id=RemedyId.MAX_SPLIT_SIZE, title="PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (expandable segments already on)",
           cost="may raise reserved memory for large blocks",
           how="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512",
           estimate=lambda d: (d.recoverable_fragmentation // 2, "low"),
           applies=lambda d: d.expandable_segments is True and d.oom_verdict == "fragmentation", acts_on=(),
           price=Price("none measurable", "none", "PYTORCH_CUDA_ALLOC_CONF=...,max_split_size_mb:512"),
           plan=PlanLever(LeverName.LAYOUT, 9.5, None, layout_first_cost=0.06), replay=None, estimate_term=None,
           docs="half the free pieces inside used segments, when expandable segments are on and the OOM is fragmentation"),
    Remedy(id=RemedyId.OFFLOAD, title=lambda d: "Offload the weights to CPU (accelerate device_map='auto')"
           if d.workload == FORWARD_ONLY else "Offload parameters / activations to CPU", cost=_offload_cost,
           how=lambda d: ("model = AutoModel.from_pretrained(name, device_map='auto', max_memory={0: '20GiB', 'cpu': '200GiB'})"
                          if d.workload == FORWARD_ONLY else
                          "# FSDP: CPUOffload(offload_params=True)  |  torch.autograd.graph.save_on_cpu() for activations"),
           estimate=lambda d: (d.bytes(Category.PARAMETER)
                               + (0 if d.workload == FORWARD_ONLY else d.bytes(Category.ACTIVATION) // 2), "low"),
           applies=lambda d: _relevant(Category.PARAMETER, *(() if d.workload == FORWARD_ONLY else (Category.ACTIVATION,)))(d),
           acts_on=(Category.PARAMETER, Category.ACTIVATION),
           price=Price("large slowdown, bounded by PCIe", "weights over PCIe every step", "FSDP CPUOffload / ZeRO-Infinity"),
           plan=PlanLever(LeverName.WEIGHTS, 12.0, _offload_formula), replay=None,
           estimate_term=EstimateTerm("parameters and optimizer state offloaded to CPU", 12.0),
           beyond_one_gpu=True,
           docs="parameters + half the activations (forward only: the weights)"),
]


LAYOUT_ONLY = {r.id for r in REMEDIES if r.layout_only}
CONDITIONAL = {r.id for r in REMEDIES if r.conditional}
FIRST = {r.id for r in REMEDIES if r.first}
BY_ID: dict[str, Remedy] = {r.id: r for r in REMEDIES}


def count_layers(modules: list[str]) -> int | None:
    """Repeated blocks seen in module names (analyzer.diagnose.blocks: `layers.N` of qualified names, the calls
    `forward[N]` one line made, a profiler's repeated classes), at least PIPELINE_MIN_LAYERS; else None. A torch.nn
    layer called N times (`torch/nn/modules/linear.py`: an MLP's Linear layers) is no block to split."""
    most = most_blocks(blocks(modules).values())
    return most if most >= PIPELINE_MIN_LAYERS else None


def blocks_alive(modules: list[str]) -> int | None:
    """Repeated blocks among the modules alive at a moment (count_layers' reading of them). 0 where the names show
    the structure and fewer than two blocks hold memory: a profiler's names, or a line calling one torch.nn layer
    again and again (a graph network's message passing over nn.Linear). None where they do not show it: nothing
    named, or call paths without a loop (a snapshot's frames name the lines, not the blocks, of a transformer
    too)."""
    found = blocks(modules)
    most = most_blocks(found.values())
    if most >= PIPELINE_MIN_LAYERS:
        return most
    return 0 if profiler_names(found) or torch_layer_loop(found.values()) else None


def checkpointable_bytes(live: pd.DataFrame) -> int | None:
    """Activations alive in repeated blocks (analyzer.diagnose.blocks), less each block's output (the next
    block's input, which checkpointing keeps): the latest activation each block made. None without at least two
    blocks."""
    activations = live[live["category"] == Category.ACTIVATION]
    block = block_paths(activations["module"])
    inside = activations[block.notna()].assign(block=block[block.notna()])
    if inside["block"].nunique() < 2:
        return None
    latest = inside.sort_values("t_alloc_us").groupby("block").tail(1)
    return int(inside["allocated_bytes"].sum() - latest["allocated_bytes"].sum())


def rank_remedies(demand: Demand) -> list[ListedRemedy]:
    """The remedies that act on this run, cheapest first, with their estimates; a `first` remedy (fixing a leak)
    leads and is `try_first`, else the cheapest that fits is, and none when the run fits as it is.

    When the OOM is fragmentation, the allocator settings (free to try) come first. Their `saved_bytes` is
    reserved memory given back; the allocated peak stays, and it fits when it is within the device."""
    layout_first = demand.oom_verdict == "fragmentation"
    order = sorted(REMEDIES, key=lambda r: (not r.first, layout_first and not r.layout_only))
    grow = fits_as_is(demand) or fits_any_gpu(demand)
    out: list[ListedRemedy] = []
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
        out.append({"id": remedy.id.value, "rank": len(out) + 1, "title": title, "saved_bytes": saved,
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


def _same_saving(d: Demand, remedy: Remedy, saved: int | None, cheaper: list[ListedRemedy]) -> str | None:
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
    alike = "the same saving" if human_bytes(same["saved_bytes"]) == human_bytes(saved) else \
        f"about the same saving ({human_bytes(saved)} against {human_bytes(same['saved_bytes'])})"
    return (f"{alike} as #{same['rank']} ({same['title']}): both estimates rest on the {what} at the peak; "
            "the cheaper one is listed first")


def describe(remedy: ListedRemedy, capacity: int | None) -> str:
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
