"""Checkpoint gather spike: saving (state_dict, torch.save, a gathered full state dict) pushes memory above
the training peak."""
from __future__ import annotations

from analyzer.core.units import gib
from analyzer.core.vocabulary import Phase
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
from analyzer.diagnose.phase_peaks import phase_peak
from analyzer.result import CheckpointGatherDetails, CheckpointGatherFinding, Evidence


def detect(ctx: DeviceContext) -> list[CheckpointGatherFinding]:
    peak = phase_peak(ctx, Phase.CHECKPOINT_SAVE)
    if peak is None or peak.bytes <= peak.elsewhere:
        return []
    live = ctx.live_at(peak.seq)
    saving = live[live["phase"] == Phase.CHECKPOINT_SAVE]
    gathered = int(saving["allocated_bytes"].sum())
    return [CheckpointGatherFinding(
        severity="warning", bytes=peak.bytes - peak.elsewhere, gathered_bytes=gathered,
        summary=(f"Saving the checkpoint peaks at {gib(peak.bytes)}, {gib(peak.bytes - peak.elsewhere)} above the "
                 f"training peak: {gib(gathered)} of state gathered onto the GPU"),
        evidence=Evidence(event_index=[peak.seq, peak.seq], allocations=top_allocations(ctx.trace, saving),
                          details=CheckpointGatherDetails(save_peak_bytes=peak.bytes, training_peak_bytes=peak.elsewhere,
                                                          gathered_bytes=gathered)),
    )]
