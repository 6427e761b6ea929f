"""Splits of the memory live at a moment (by category, phase, module) and per-step peaks.

Every split is over the same rows as the total it splits, so its parts sum to that total exactly; a long
tail is folded into one "other (N)" row rather than dropped.
"""
from __future__ import annotations

from typing import TypedDict

import numpy as np
import pandas as pd

from analyzer.core.trace import MemoryTrace

TOP_MODULES = 20
TOP_SITES = 10


class SplitRow(TypedDict):
    """One part of a split: a category, phase or module, its bytes and its share of the total split."""

    name: str
    bytes: int
    share: float


class SiteRow(TypedDict):
    """The live memory one user line made (None: allocations without Python frames)."""

    top_user_frame: str | None
    allocations: int
    bytes: int
    share: float


class StepPeak(TypedDict):
    """One step's highest allocated bytes, when, and the phase running then."""

    step: int
    peak_allocated_bytes: int
    phase: str | None
    event_index: int
    time_us: int | None


def split(live: pd.DataFrame, column: str, top: int | None = None) -> list[SplitRow]:
    """[{name, bytes, share}] largest first; with `top`, the rest folded into one row."""
    total = int(live["allocated_bytes"].sum())
    sums = live.groupby(column, observed=True)["allocated_bytes"].sum().sort_values(ascending=False, kind="stable")
    rows = [(str(name), int(b)) for name, b in sums.items() if b]
    if top is not None and len(rows) > top:
        rest = rows[top - 1:]
        rows = rows[: top - 1] + [(f"other ({len(rest)} {column}s)", sum(b for _, b in rest))]
    return [{"name": name, "bytes": b, "share": b / total if total else 0.0} for name, b in rows]


def by_site(trace: MemoryTrace, live: pd.DataFrame, top: int = TOP_SITES) -> list[SiteRow]:
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


def step_peaks(labels: pd.DataFrame, timeline: pd.DataFrame) -> list[StepPeak]:
    """Per step: its highest allocated bytes, when, and the phase running then (`labels` from event_labels)."""
    after_event = timeline["seq"].to_numpy() >= 0      # the columns it reads, not the whole table taken
    seqs = timeline["seq"].to_numpy()[after_event]
    if not len(seqs) or labels.empty:
        return []
    times = timeline["t_us"].array[after_event]
    steps = labels["step"].to_numpy()[: len(seqs)]
    phases = labels["phase"].to_numpy(dtype=object)[: len(seqs)]
    allocated = timeline["allocated_bytes"].to_numpy()[after_event]
    keep = np.flatnonzero(~np.isnan(steps) & (np.nan_to_num(steps, nan=-1) >= 0))
    if not len(keep):
        return []
    peaks = pd.Series(allocated[keep]).groupby(steps[keep]).idxmax()  # position in `keep` of each step's peak
    out: list[StepPeak] = []
    for step, position in peaks.items():
        i = keep[position]
        t_us = times[i]
        out.append({"step": int(step), "peak_allocated_bytes": int(allocated[i]), "phase": phases[i],
                    "event_index": int(seqs[i]), "time_us": None if pd.isna(t_us) else int(t_us)})
    return out


def labels_at(labels: pd.DataFrame, seq: int) -> tuple[int | None, str | None]:
    """(step, phase) in force just after event `seq` (`labels` from event_labels)."""
    if seq < 0 or seq >= len(labels):
        return None, None
    row = labels.iloc[seq]
    return (None if pd.isna(row["step"]) or row["step"] < 0 else int(row["step"])), row["phase"]
