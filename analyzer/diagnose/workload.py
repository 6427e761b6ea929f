"""What kind of run the recording shows, so that only the remedies that act on it are offered.

Read from what the recording holds, never from what a typical run would do:
- training: a backward pass, an optimizer step, optimizer state, or gradients of at least GRADIENT_SHARE of
  the parameters were seen; forward-only otherwise (inference, or a profile of the forward). A recording that
  ends with an out-of-memory (on any of its devices) before any of these shows no backward yet, so whether it
  trains is not known (`unknown`): the remedies of a training run stay, none that needs a forward-only run. A
  recording without a history (a snapshot of the end state alone) shows no pass at all: it is forward-only
  when its end state holds a model (parameters of at least END_STATE_MODEL_SHARE of it) and neither gradients
  nor optimizer state, `unknown` otherwise;
- frozen part: gradients (or, without them, the optimizer state at one state a parameter) cover less than
  FROZEN_SHARE of the parameters: a fine-tune of a frozen base (LoRA ...) whose base has no gradients and no
  optimizer state;
- activations kept: a forward-only run whose activations (tensors that outlive the computation that made
  them) are a meaningful share of the peak: an autograd graph (which `torch.no_grad()` /
  `torch.inference_mode()` would free as the forward goes), or tensors the code keeps (a KV cache, outputs).
  Where the recording says autograd was off (`trace.grad_mode`: a profiler trace's metadata, or no op with
  a sequence number) they are no graph, and the remedy that acts on a graph is not offered; otherwise the
  recording cannot tell which, so it is offered on that condition;
- mixed precision on: the allocator stacks show autocast's weight casts (`at::autocast::cached_cast`, C++
  frames of stacks="all"); unknown without C++ frames;
- GPUs: `--gpus`, else the world size the trace records; unknown otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analyzer.core.vocabulary import Category, GradMode, Phase
from analyzer.diagnose.context import DeviceContext
from analyzer.result import WorkloadFacts

FROZEN_SHARE = 0.5        # trainable bytes under this share of the parameters: the rest is frozen
GRADIENT_SHARE = 0.05     # gradients of at least this share of the parameters show training without a backward seen
GRAPH_KEPT_SHARE = 0.05   # activations at the peak of a forward-only run above this share: a graph is kept
END_STATE_MODEL_SHARE = 0.05  # parameters of at least this share of an end state without history: a model is loaded
_AUTOCAST_FRAME = "at::autocast::"


@dataclass(frozen=True)
class Workload:
    kind: str                      # training | forward_only | unknown
    frozen_share: float | None     # share of the parameter bytes without gradients (fine-tuning), else None
    graph_kept: bool               # forward-only with activations kept (an autograd graph, or a KV cache)
    mixed_precision_on: bool | None  # autocast seen in the stacks; None when the stacks cannot show it
    gpus: int | None               # GPUs the job can shard over, when known
    history: bool = True           # the recording holds a history (False: an end state alone shows no pass)
    grad_mode: str | None = None   # vocabulary.GradMode the recording shows, None where it cannot say
    cache_kept: bool = False       # forward-only with activations kept while autograd was off: a cache or outputs

    @property
    def training(self) -> bool:
        return self.kind == "training"

    @property
    def forward_only(self) -> bool:
        return self.kind == "forward_only"

    def published(self, kv_cache: bool = False) -> WorkloadFacts:
        """What the report shows: the workload's facts and its summary (`kv_cache`: the kv_cache finding named the
        kept activations, so the summary says what they are)."""
        return WorkloadFacts(kind=self.kind, frozen_share=self.frozen_share, graph_kept=self.graph_kept,
                             mixed_precision_on=self.mixed_precision_on, gpus=self.gpus,
                             summary=self.describe(kv_cache))

    def describe(self, kv_cache: bool = False) -> str:
        """'training, bf16 autocast on, 1 GPU': what the advice was chosen for."""
        parts = {"training": "training", "forward_only": "forward only (no backward, no optimizer)",
                 "unknown": "forward so far (the recording ends before any backward)" if self.history else
                 "unknown (no allocation history, and the end state holds no model: no forward, backward or "
                 "optimizer is known)"
                 }[self.kind]
        words = [parts]
        if self.frozen_share is not None:
            words.append(f"{self.frozen_share:.0%} of the parameters frozen (no gradients, no optimizer state)")
        if self.graph_kept:
            words.append("activations kept (autograd on: an autograd graph)" if self.grad_mode is not None else
                         "activations kept (a KV cache, and maybe an autograd graph: the recording cannot tell)"
                         if kv_cache else "activations kept (an autograd graph or a cache: the recording cannot tell)")
        if self.cache_kept:
            words.append(f"activations kept with autograd off ({self.grad_mode}): "
                         + ("a KV cache, not a graph" if kv_cache else "a cache or outputs, not a graph"))
        if self.mixed_precision_on:
            words.append("autocast (mixed precision) on")
        if self.gpus is not None:
            words.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        return ", ".join(words)


def recognise(ctx: DeviceContext, *, gradient_share: float = GRADIENT_SHARE, graph_kept_share: float = GRAPH_KEPT_SHARE,
              frozen_below: float = FROZEN_SHARE) -> Workload:
    """The workload of one device's recording: training with a backward, an optimizer step, optimizer state or
    gradients of `gradient_share` of the parameters; a graph kept by a forward-only run whose activations are
    above `graph_kept_share` of the peak; a frozen part where the trainable bytes are under `frozen_below` of the
    parameters."""
    most = {c: int(ctx.timeline[f"{c.value}_bytes"].max()) if f"{c.value}_bytes" in ctx.timeline else 0
            for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)}
    phases = {str(p) for p in pd.unique(ctx.labels["phase"].to_numpy()) if not pd.isna(p)} if "phase" in ctx.labels else set()
    backward = Phase.BACKWARD.value in phases or Phase.OPTIMIZER.value in phases
    trains = (backward or most[Category.OPTIMIZER_STATE] > 0
              or most[Category.GRADIENT] >= gradient_share * max(most[Category.PARAMETER], 1))
    ended_in_forward = not ctx.trace.ooms.empty and not trains
    no_model = not ctx.trace.has_history and most[Category.PARAMETER] < END_STATE_MODEL_SHARE * ctx.d.peak.allocated_bytes
    kind = "training" if trains else ("unknown" if ended_in_forward or no_model else "forward_only")
    activations = ctx.category_bytes(Category.ACTIVATION)
    kept = kind == "forward_only" and activations > graph_kept_share * max(ctx.d.peak.allocated_bytes, 1)
    grad_mode = ctx.trace.grad_mode
    autograd_off = grad_mode is not None and GradMode(grad_mode).autograd_off
    gpus = ctx.world_size or ctx.trace.world_size
    return Workload(kind=kind, frozen_share=frozen_share(most[Category.PARAMETER], most[Category.GRADIENT],
                                                         most[Category.OPTIMIZER_STATE], frozen_below) if trains else None,
                    graph_kept=kept and not autograd_off, mixed_precision_on=autocast_on(ctx), gpus=gpus,
                    history=ctx.trace.has_history, grad_mode=grad_mode, cache_kept=kept and autograd_off)


def frozen_share(parameters: int, gradients: int, optimizer_state: int, below: float = FROZEN_SHARE) -> float | None:
    """The share of the parameter bytes that trains nothing, when it is at least 1 - `below` (FROZEN_SHARE). Gradients are
    as large as the parameters they belong to. Without any, the optimizer state bounds the trainable part from
    above at one state a parameter (SGD's momentum, a zeroth-order estimator's; Adam keeps two): a part is
    called frozen only when even that bound leaves it without state."""
    if not parameters:
        return None
    trainable = gradients if gradients else optimizer_state
    if not trainable or trainable >= below * parameters:
        return None
    return 1 - trainable / parameters


def autocast_on(ctx: DeviceContext) -> bool | None:
    """Autocast was on when an allocation of this device was made under autocast's dispatch; None when no
    stack of the recording carries C++ frames (Python-only stacks cannot show it)."""
    stacks = ctx.trace.stacks
    if stacks.empty:
        return None
    frames = stacks["frames"]
    native = frames.map(lambda fr: any(not str(f[0]).endswith(".py") and "::" in str(f[2]) for f in fr))
    if not native.any():
        return None
    autocast = set(stacks.loc[frames.map(lambda fr: any(_AUTOCAST_FRAME in str(f[2]) for f in fr)), "stack_id"])
    used = ctx.allocations["stack_id"].dropna().astype(int)
    return bool(used.isin(autocast).any())
