"""Score attribution against ground truth (the simulator's `.truth.json` sidecars): bytes-weighted agreement
of the labels of the allocations live at the peak. Used by tests and benchmarks/attribution_accuracy.py."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from analyzer.errors import UnsupportedFormat
from analyzer.pipeline import analyze
from analyzer.attribute import attribute
from analyzer.attribute.annotations import classify
from analyzer.ingest import load
from analyzer.ingest.memory_timeline import CATEGORIES, CREATE
from analyzer.ingest.sniff import open_input
from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import ROOT_MODULE, UNATTRIBUTED, Category, Role
from analyzer.result import Analysis

# parameters and buffers are both model state made at load time: the recording cannot tell them apart;
# the truth's empty module is the root module (or no module at all, which we call unattributed)
_SAME: dict[str, str] = {Role.BUFFER: Role.BUFFER.category.value, "": ROOT_MODULE}
_EITHER = {("", UNATTRIBUTED)}
_ONE_RECORDING = "a set of ranks: agreement is scored for one recording"


def _same(label: str | None) -> str | None:
    """The label in the form truth and attribution share (None: the truth has no label here)."""
    return None if label is None else _SAME.get(label, label)


def without_tags(trace: MemoryTrace) -> MemoryTrace:
    """The same recording as if it had been made without analyzer's capture helpers (no phase/module tags)."""
    kinds = [classify(n)[3] for n in trace.annotations["name"]]
    keep = [k not in ("tag:phase", "tag:module", "tag:tensor") for k in kinds]
    return replace(trace, annotations=trace.annotations[keep].reset_index(drop=True),
                   allocations=trace.allocations.copy())


def peak_agreement(snapshot: Path, tags: bool = True) -> dict[str, float]:
    """Share of peak bytes whose category, phase and module match the truth; also the attributed share."""
    truth = json.loads(snapshot.with_name(snapshot.stem + ".truth.json").read_text())
    trace = load(snapshot)
    if not isinstance(trace, MemoryTrace):
        raise UnsupportedFormat(snapshot, _ONE_RECORDING, "pass one rank's file")
    if not tags:
        trace = without_tags(trace)
    trace = attribute(trace)
    live = find_peak(trace, truth["device"]).live
    labels = truth["allocations"]
    weights = live["allocated_bytes"].to_numpy(dtype=np.float64)
    keys = [str(int(s)) if s == s and s is not None else None for s in live["seq_alloc"].astype("float64")]
    scores: dict[str, float] = {}
    for field in ("category", "phase", "module"):
        ours = live[field].astype(str).to_numpy()
        theirs = [labels[k][field] if k in labels else None for k in keys]
        match = np.asarray([_same(t) == _same(o) or (t, o) in _EITHER for o, t in zip(ours, theirs)])
        scores[field] = float(weights[match].sum() / weights.sum()) if weights.sum() else 1.0
        scores[f"{field}_attributed"] = float(weights[ours != UNATTRIBUTED].sum() / weights.sum()) if weights.sum() else 1.0
    return scores


# torch's memory profiler calls the intermediate gradients of backward AUTOGRAD_DETAIL: our temporaries
_TORCH_SAME = {"autograd_detail": Category.TEMPORARY.value}


def profiler_agreement(trace_path: Path, raw_timeline_path: Path) -> dict[str, float]:
    """Category agreement with torch's own memory profiler for the same profiled run: each allocation of the
    Kineto trace is joined to the `export_memory_timeline` raw CREATE event of the same time (µs) and size.
    Bytes-weighted, at the peak and over the whole recording; allocations torch leaves uncategorised, and
    those made before the profiled window (no CREATE event), are not scored."""
    with open_input(raw_timeline_path) as stream:
        rows = json.load(stream)
    created = pd.DataFrame([(int(ts) // 1000, int(size), CATEGORIES[category]) for ts, action, size, category in rows
                            if action == CREATE and category is not None],
                           columns=["t", "bytes", "torch"]).drop_duplicates(["t", "bytes"], keep=False)
    analysis = analyze(trace_path)
    if not isinstance(analysis, Analysis):
        raise UnsupportedFormat(trace_path, _ONE_RECORDING, "pass one rank's trace")
    everything = analysis.trace.allocations
    scores: dict[str, float] = {}
    for scope, rows_ in (("overall", everything),
                         ("peak", pd.concat([d.peak.live for d in analysis.devices]))):
        timed = rows_[rows_["t_alloc_us"].notna()]
        ours = pd.DataFrame({"t": timed["t_alloc_us"].astype("int64").to_numpy(), "bytes": timed["requested_bytes"].to_numpy(),
                             "ours": timed["category"].astype(str).to_numpy(), "weight": timed["allocated_bytes"].to_numpy()})
        joined = ours.merge(created, on=["t", "bytes"])
        joined = joined[joined["torch"] != UNATTRIBUTED]
        theirs = joined["torch"].replace(_TORCH_SAME)
        total = joined["weight"].sum()
        scores[scope] = float(joined.loc[joined["ours"] == theirs, "weight"].sum() / total) if total else 1.0
        scores[f"{scope}_scored_bytes"] = int(total)
    return scores
