"""Memory allocated before the recording began that nothing attributes: from UNSEEN_SHARE of the peak it is the
largest thing the verdict can name, so the verdict leads with it and says how to see what it is (the weights,
most likely, when the recording started after the model was loaded)."""
from __future__ import annotations

from analyzer.core.units import gib
from analyzer.core.vocabulary import RECORD_HISTORY, UNATTRIBUTED
from analyzer.diagnose.context import DeviceContext

#: memory alive before the recording began, unattributed, at this share of the peak or more leads the verdict
UNSEEN_SHARE = 0.5


def unseen(ctx: DeviceContext, share: float = UNSEEN_SHARE) -> tuple[str, str]:
    """Where memory alive at the peak that was allocated before the recording began, and that nothing attributes,
    is `share` of the peak or more: the clause that says so ('12.55 GiB of it (82%) was allocated before the
    recording began ...') and the line that shows how to see what it is; two empty strings otherwise."""
    live, peak = ctx.d.peak.live, ctx.d.peak.allocated_bytes
    before = int(live.loc[(live["origin"].astype(str) != "trace") & (live["category"].astype(str) == UNATTRIBUTED),
                          "allocated_bytes"].sum())
    if not peak or before < share * peak:
        return "", ""
    how = (f"call {RECORD_HISTORY} before the model is loaded and dump the snapshot again" if ctx.trace.has_segments
           else "start the profiler (profile_memory=True, with_stack=True) before the model is loaded")
    return (f"{gib(before)} of it ({before / peak:.0%}) was allocated before the recording began, and no history "
            "says what it is (the weights, most likely, when the recording started after the model was loaded)",
            f" To see what the {gib(before)} is, {how}.")
