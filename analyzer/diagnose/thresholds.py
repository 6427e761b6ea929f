"""Every number that decides which finding a user is told, in one value the Python API takes:

    analyzer.analyze("snapshot.pickle", thresholds=Thresholds(imbalance_ratio=1.6, graph_kept_share=0.02))

Each default is the constant beside the detector that uses it (documented there), and each detector takes it as
a keyword argument with that default, so a detector called alone is tuned the same way
(`find_imbalance(peaks, ratio=1.6)`, `recognise(ctx, graph_kept_share=0.02)`). Every one is pinned by a test on
each side of it that restates the number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from analyzer.diagnose import (
    conv_workspace,
    fragmentation,
    imbalance,
    kv_cache,
    leak,
    oom,
    outside,
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

    def imbalance(self) -> dict[str, Any]:
        """The keyword arguments of `imbalance.find_imbalance`."""
        return {"ratio": self.imbalance_ratio, "min_gap_bytes": self.imbalance_min_gap_bytes,
                "idle_share": self.idle_share}
