"""Splits of the memory live at a moment (by category, phase, module) and per-step peaks.

Every split is over the same rows as the total it splits, so its parts sum to that total exactly; a long
tail is folded into one "other (N)" row rather than dropped.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analyzer.core.trace import MemoryTrace

TOP_MODULES = 20
TOP_SITES = 10


def split(live: pd.DataFrame, column: str, top: int | None = None) -> list[dict[str, Any]]:
    """[{name, bytes, share}] largest first; with `top`, the rest folded into one row."""
    total = int(live["allocated_bytes"].sum())
    sums = live.groupby(column, observed=True)["allocated_bytes"].sum().sort_values(ascending=False, kind="stable")
    rows: list[dict[str, Any]] = [{"name": str(name), "bytes": int(b)} for name, b in sums.items() if b]
    if top is not None and len(rows) > top:
        rest = rows[top - 1:]
        rows = rows[: top - 1] + [{"name": f"other ({len(rest)} {column}s)", "bytes": sum(r["bytes"] for r in rest)}]
    for r in rows:
        r["share"] = r["bytes"] / total if total else 0.0
    return rows


def by_site(trace: MemoryTrace, live: pd.DataFrame, top: int = TOP_SITES) -> list[dict[str, Any]]:
    """[{top_user_frame, allocations, bytes, share}]: the live rows grouped by the user line that made them,
    largest first, the `top` largest (None: allocations without Python frames)."""
    if live.empty:
        return []
    frames = trace.stacks["top_user_frame"]
    # object dtype first: mapping an all-NA Int64 column keeps Int64, which cannot be filled with ""
    where = live["stack_id"].astype(object).map(lambda s: None if pd.isna(s) else frames.iat[int(s)])
    grouped = live.assign(where=where.fillna("")).groupby("where")["allocated_bytes"].agg(["count", "sum"])
    grouped = grouped.sort_values("sum", ascending=False, kind="stable").head(top)
    total = int(live["allocated_bytes"].sum())
    return [{"top_user_frame": str(w) or None, "allocations": int(row["count"]), "bytes": int(row["sum"]),
             "share": int(row["sum"]) / total if total else 0.0} for w, row in grouped.iterrows()]


def event_labels(trace: MemoryTrace, device: int) -> pd.DataFrame:
    """Step and phase in force after each event of a device: those of the latest allocation made so far."""
    a = trace.allocations[(trace.allocations["device"] == device) & trace.allocations["seq_alloc"].notna()]
    n = int(trace.devices[device].trace_entries)
    step = np.full(n, np.nan)
    phase = np.full(n, None, dtype=object)
    seq = a["seq_alloc"].to_numpy(dtype=np.int64)
    step[seq] = a["step"].to_numpy(dtype=np.float64, na_value=np.nan)
    phase[seq] = a["phase"].to_numpy(dtype=object)
    labels = pd.DataFrame({"step": step, "phase": pd.Series(phase, dtype=object)}).ffill()
    return labels


def step_peaks(labels: pd.DataFrame, timeline: pd.DataFrame) -> list[dict[str, Any]]:
    """Per step: its highest allocated bytes, when, and the phase running then (`labels` from event_labels)."""
    events = timeline[timeline["seq"] >= 0].reset_index(drop=True)
    if events.empty or labels.empty:
        return []
    steps = labels["step"].to_numpy()[: len(events)]
    phases = labels["phase"].to_numpy(dtype=object)[: len(events)]
    allocated = events["allocated_bytes"].to_numpy()
    keep = np.flatnonzero(~np.isnan(steps) & (np.nan_to_num(steps, nan=-1) >= 0))
    if not len(keep):
        return []
    peaks = pd.Series(allocated[keep]).groupby(steps[keep]).idxmax()  # position in `keep` of each step's peak
    out = []
    for step, position in peaks.items():
        i = keep[position]
        t_us = events["t_us"].iat[i]
        out.append({"step": int(step), "peak_allocated_bytes": int(allocated[i]), "phase": phases[i],
                    "event_index": int(events["seq"].iat[i]), "time_us": None if pd.isna(t_us) else int(t_us)})
    return out


def labels_at(labels: pd.DataFrame, seq: int) -> tuple[int | None, str | None]:
    """(step, phase) in force just after event `seq` (`labels` from event_labels)."""
    if seq < 0 or seq >= len(labels):
        return None, None
    row = labels.iloc[seq]
    return (None if pd.isna(row["step"]) or row["step"] < 0 else int(row["step"])), row["phase"]
