"""Memory outside PyTorch, when a second source shows the device's usage (an Nsight export of the same run
beside the snapshot): every cudaMalloc the caching allocator did not make (NCCL, cuBLAS/cuDNN workspaces,
extensions), measured by analyzer.diagnose.outside_pytorch, at the OOM (else the peak)."""
from __future__ import annotations

from analyzer.core.units import gib
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.outside_pytorch import outside_pytorch
from analyzer.result import Evidence, OutsidePytorchDetails, OutsidePytorchFinding

OUTSIDE_SHARE = 0.01  # of the device (or of PyTorch's reserved memory): less is noise (a few workspaces)
SIGNIFICANT_SHARE = 0.10  # above this share of the device it is the first thing to explain


def detect(ctx: DeviceContext, *, share: float = OUTSIDE_SHARE,
           significant_share: float = SIGNIFICANT_SHARE) -> list[OutsidePytorchFinding]:
    """Memory outside PyTorch of at least `share` of the device (or of the reserve), critical from
    `significant_share` on."""
    companion = ctx.device_usage
    if companion is None or ctx.device not in companion.devices:
        return []
    measured = outside_pytorch(ctx.trace, companion, ctx.device)
    outside = measured["outside_bytes_at_peak"]
    reference = ctx.capacity_bytes or measured["pytorch_reserved_bytes_at_peak"] or 1
    if outside < share * reference:
        return []
    unseen = measured["unseen_bytes_at_oom"]
    significant = outside >= significant_share * reference
    return [OutsidePytorchFinding(
        severity="critical" if significant else "info", bytes=outside, significant=significant,
        summary=(f"{gib(outside)} of device memory is outside PyTorch at the {measured['at']} (Nsight saw "
                    f"{gib(measured['device_bytes_at_peak'])} in use, PyTorch reserved "
                    f"{gib(measured['pytorch_reserved_bytes_at_peak'])})"
                    + (f"; a further {gib(unseen)} neither tool sees (CUDA context, kernel images, other processes)"
                       if unseen else "")),
        evidence=Evidence(time_us=[measured["t_us"], measured["t_us"]],
                          details=OutsidePytorchDetails(outside_bytes_at_peak=outside,
                                                        outside_bytes_max=measured["outside_bytes_max"],
                                                        unseen_bytes_at_oom=unseen,
                                                        clock_offset_us=measured["clock_offset_us"],
                                                        outside_allocations=int(len(measured["outside_segments"])),
                                                        notes=measured["notes"])),
    )]
