"""Every number that decides what a user is told, in one value the Python API takes:

    analyzer.analyze("snapshot.pickle", thresholds=Thresholds(imbalance_ratio=1.6, graph_kept_share=0.02))

Each default is the constant beside the code that uses it (documented there: a detector, the attribution's rule
of a frozen base, the verdict, the remedies, `analyze estimate`'s plan), and each of these takes it as a keyword
argument with that default, so a part called alone is tuned the same way (`find_imbalance(peaks, ratio=1.6)`,
`recognise(ctx, graph_kept_share=0.02)`, `analyzer.commands.estimate.estimate(..., thresholds=...)`). Every one
is pinned by a test on each side of it that restates the number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from analyzer.attribute import model_states
from analyzer.diagnose import (
    before_recording,
    conv_workspace,
    fragmentation,
    imbalance,
    kv_cache,
    leak,
    oom,
    outside,
    plan,
    remedies,
    reserved_growth,
    workload,
)


@dataclass(frozen=True)
class Thresholds:
    """The detectors' thresholds (shares are of the quantity each names; bytes are bytes)."""

    #: the worst device's peak over the median one from which the spread is an `imbalance` finding (1.5)
    imbalance_ratio: float = imbalance.IMBALANCE_RATIO
    #: ... and the least gap between them (256 MiB: two small devices that differ by 2x are no story)
    imbalance_min_gap_bytes: int = imbalance.MIN_GAP_BYTES
    #: a device whose peak is under this share of the largest is idle, not part of the job (0.02)
    idle_share: float = imbalance.IDLE_SHARE
    #: activations of a forward-only run above this share of its peak: an autograd graph is kept (0.05)
    graph_kept_share: float = workload.GRAPH_KEPT_SHARE
    #: gradients of at least this share of the parameters show training without a backward seen (0.05)
    gradient_share: float = workload.GRADIENT_SHARE
    #: trainable bytes under this share of the parameters: the rest is a frozen base (0.5)
    frozen_below: float = workload.FROZEN_SHARE
    #: the reserve at the peak above this share of the device: fragmentation nearly caused an OOM (0.95)
    near_oom_share: float = fragmentation.NEAR_OOM_SHARE
    #: free memory worth reporting as fragmentation: at least this share of what is reserved (0.05)
    recovery_share: float = fragmentation.RECOVERY_THRESHOLD
    #: at an OOM, more than this share of the device neither free nor PyTorch's: the cause is outside it (0.10)
    oom_outside_share: float = oom.OUTSIDE_THRESHOLD
    #: memory outside PyTorch (seen by Nsight) below this share of the device is noise (0.01)
    outside_share: float = outside.OUTSIDE_SHARE
    #: ... and from this share on it is the first thing to explain (0.10)
    outside_significant_share: float = outside.SIGNIFICANT_SHARE
    #: a leak's rate below this share of the largest step peak is noise (0.001)
    leak_min_share_of_peak: float = leak.MIN_SHARE_OF_PEAK
    #: the step-start levels must grow by at least this share of the leak's kept rate (0.5)
    leak_level_agreement: float = leak.LEVEL_AGREEMENT
    #: reserve growth per step below this share of the reserved peak is noise (0.005)
    reserved_growth_min_share: float = reserved_growth.MIN_SHARE_OF_RESERVED
    #: a forward-only run's KV cache from this share of the peak is named, with its remedies (0.05)
    kv_cache_share: float = kv_cache.KV_CACHE_SHARE
    #: torch's "unknown" transient from this share of the peak is named as cuDNN's workspace, likely (0.5)
    conv_workspace_share: float = conv_workspace.UNKNOWN_SHARE
    #: eager attention's s x s tensors from this share of the peak: fused attention offered, and the verdict names
    #: them (0.05)
    attention_share: float = remedies.RELEVANT_SHARE
    #: memory made before the recording that nothing attributes, from this share of the peak, leads the verdict (0.5)
    unseen_share: float = before_recording.UNSEEN_SHARE
    #: a training profiler trace's memory from before it is a frozen base's parameters where the gradients one step
    #: makes, with Adam's moments of them, are under this share of it (model_states rule 6: LoRA) (0.5)
    frozen_lump_share: float = model_states.FROZEN_LUMP_SHARE
    #: `analyze estimate`'s plan: a micro-batch of this many tokens or more keeps the matmuls large, so halving it
    #: with accumulation costs little, and comes before checkpointing (2048)
    busy_tokens: int = plan.BUSY_TOKENS

    def imbalance(self) -> dict[str, Any]:
        """The keyword arguments of `imbalance.find_imbalance`."""
        return {"ratio": self.imbalance_ratio, "min_gap_bytes": self.imbalance_min_gap_bytes,
                "idle_share": self.idle_share}
