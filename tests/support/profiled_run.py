"""A tiny CPU training run under torch.profiler, with torch's own memory-profiler category of every allocation
(by address and time), for scoring profiler-trace attribution against the truth torch itself computes."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from support.paths import ROOT

STEPS = 3


def record(out: Path) -> tuple[Path, pd.DataFrame]:
    """Profile STEPS training steps of scripts/record_kineto_fixtures.py's model (profile_memory, record_shapes,
    with_stack, with_modules; one warmup step) and return the trace's path and torch's categories: one row per
    allocation torch saw made (addr, t_us, bytes, torch: its category at creation, None where it gave none)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    sys.path.insert(0, str(ROOT / "scripts"))
    from record_kineto_fixtures import make_model, train_step

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    trace = out / "run.pt.trace.json"
    rows: list[tuple] = []

    def ready(prof: profile) -> None:
        """Export the trace and read torch's categories of the same cycle (the profiler clears it after)."""
        prof.export_chrome_trace(str(trace))
        memory = prof._memory_profile()
        for t_ns, action, (key, version), size in memory.timeline:
            storage = getattr(key, "storage", None)
            if action.name == "CREATE" and storage is not None:
                category = memory._categories.get(key, version)
                rows.append((storage.ptr, t_ns // 1000, size, category.name.lower() if category else None))

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=STEPS),
                 on_trace_ready=ready, profile_memory=True, record_shapes=True, with_stack=True,
                 with_modules=True) as prof:
        for _ in range(STEPS + 1):
            train_step(model, optimizer)
            prof.step()
    return trace, pd.DataFrame(rows, columns=["addr", "t_us", "bytes", "torch"])


def aligned(ours: pd.DataFrame, truth: pd.DataFrame) -> pd.DataFrame:
    """`ours` (columns addr, t_us, bytes, ...) joined to torch's row of the same address, size and time. The two
    clocks differ by a constant: the offset is the most common difference over pairs of equal address and size
    (true pairs share it to the microsecond; false ones scatter), and times then match within 2 µs."""
    pairs = ours.merge(truth, on=["addr", "bytes"], suffixes=("", "_torch"))
    offset = int((pairs["t_us"] - pairs["t_us_torch"]).mode().iloc[0])
    shifted = truth.assign(t_us=truth["t_us"] + offset).sort_values("t_us")
    return pd.merge_asof(ours.sort_values("t_us"), shifted, on="t_us", by=["addr", "bytes"], tolerance=2,
                         direction="nearest").dropna(subset=["torch"])
