"""Score attribution against ground truth (the simulator's `.truth.json` sidecars): bytes-weighted agreement
of the labels of the allocations live at the peak, or of every allocation of the recording, and of the module
class. Used by tests, benchmarks/attribution_accuracy.py and benchmarks/zoo_accuracy.py."""
from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from analyzer.attribute import attribute
from analyzer.attribute.annotations import classify
from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import AS_OUR_CATEGORY, NO_MODULE, ROOT_MODULE, UNATTRIBUTED, Role, names_module
from analyzer.errors import UnsupportedFormat
from analyzer.ingest import load
from analyzer.ingest.memory_timeline import CATEGORIES, CREATE
from analyzer.ingest.sniff import open_input
from analyzer.pipeline import analyze
from analyzer.result import Analysis

# parameters and buffers are both model state made at load time: the recording cannot tell them apart;
# the truth's empty module is the root module (or no module at all, which we call unattributed)
_SAME: dict[str, str] = {Role.BUFFER: Role.BUFFER.category.value, "": ROOT_MODULE}
_EITHER = {("", UNATTRIBUTED), ("", NO_MODULE)}
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


def simulator_sources() -> tuple[str, ...]:
    """The folders holding the code the simulator's recordings ran, as `--source-root`s: this package's checkout
    and the installed torch, transformers and peft (the test extra pins their versions, so the copies are the ones
    that ran). Found without importing them."""
    roots = [str(Path(__file__).resolve().parents[2])]
    for name in ("torch", "transformers", "peft"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append(str(Path(next(iter(spec.submodule_search_locations))).parent))
    return tuple(dict.fromkeys(roots))


def _truth_and_attributed(snapshot: Path, tags: bool, source_roots: Sequence[str]) -> tuple[dict, MemoryTrace]:
    truth = json.loads(snapshot.with_name(snapshot.stem + ".truth.json").read_text())
    trace = load(snapshot)
    if not isinstance(trace, MemoryTrace):
        raise UnsupportedFormat(snapshot, _ONE_RECORDING, "pass one rank's file")
    return truth, attribute(trace if tags else without_tags(trace), source_roots=source_roots)


def peak_agreement(snapshot: Path, tags: bool = True, source_roots: Sequence[str] = ()) -> dict[str, float]:
    """Share of peak bytes whose category, phase and module match the truth; also the attributed share."""
    truth, trace = _truth_and_attributed(snapshot, tags, source_roots)
    live = find_peak(trace, truth["device"]).live
    labels = truth["allocations"]
    weights = live["allocated_bytes"].to_numpy(dtype=np.float64)
    keys = _keys(live)
    scores: dict[str, float] = {}
    for field in ("category", "phase", "module"):
        ours = live[field].astype(str).to_numpy()
        theirs = [labels[k][field] if k in labels else None for k in keys]
        match = np.asarray([_same(t) == _same(o) or (t, o) in _EITHER for o, t in zip(ours, theirs, strict=True)])
        scores[field] = float(weights[match].sum() / weights.sum()) if weights.sum() else 1.0
        scores[f"{field}_attributed"] = float(weights[ours != UNATTRIBUTED].sum() / weights.sum()) if weights.sum() else 1.0
    return scores




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
        theirs = joined["torch"].replace(AS_OUR_CATEGORY)
        total = joined["weight"].sum()
        scores[scope] = float(joined.loc[joined["ours"] == theirs, "weight"].sum() / total) if total else 1.0
        scores[f"{scope}_scored_bytes"] = int(total)
    return scores


# ---- over the whole recording, and the module's class (the zoo's bars) -----------------------------------------
def _keys(rows: pd.DataFrame) -> list[str | None]:
    return [None if np.isnan(s) else str(int(s)) for s in rows["seq_alloc"].to_numpy(dtype=np.float64, na_value=np.nan)]


def _category_share(rows: pd.DataFrame, labels: dict) -> float:
    """Bytes-weighted share of `rows` whose category is the truth's (parameters and buffers alike)."""
    weights = rows["allocated_bytes"].to_numpy(dtype=np.float64)
    ours = rows["category"].astype(str).to_numpy()
    theirs = [labels[k]["category"] if k in labels else None for k in _keys(rows)]
    match = np.asarray([_same(t) == _same(o) for o, t in zip(ours, theirs, strict=True)], dtype=bool)
    return float(weights[match].sum() / weights.sum()) if weights.sum() else 1.0


_SEPARATORS = re.compile(r"\s*(?:›|>|/|::)\s*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def label_class(label: str | None, fqn_classes: dict[str, str]) -> str | None:
    """The innermost module class a module label names: the last element of a call path
    (`LlamaForCausalLM › LlamaModel › LlamaDecoderLayer › LlamaMLP`), the class of `LlamaMLP.forward`, or, for
    an FQN (`model.layers.0.mlp`), the class the truth gives that module. None: the label names no class."""
    if not names_module(label):
        return None
    if label in fqn_classes:
        return fqn_classes[label]
    if label == ROOT_MODULE:
        return fqn_classes.get("")
    classes = set(fqn_classes.values())
    for part in reversed(_SEPARATORS.split(label)):
        names = _IDENTIFIER.findall(part)
        known = [n for n in names if n in classes]
        if known:
            return known[-1]
        if names and names[0][:1].isupper():
            return names[0]
        if part in fqn_classes:
            return fqn_classes[part]
    return None


def _module_class_share(rows: pd.DataFrame, labels: dict) -> float:
    """Bytes-weighted share of `rows` whose module label names the class of the truth's module. Rows whose
    truth has no module class (made outside every module's forward and backward) are scored on being labelled
    unattributed or the root module, as `peak_agreement` scores them."""
    fqn_classes = {a["module"]: a["module_class"] for a in labels.values() if a.get("module_class")}
    weights = rows["allocated_bytes"].to_numpy(dtype=np.float64)
    match = []
    for label, key in zip(rows["module"].astype(str), _keys(rows), strict=True):
        truth = labels.get(key) if key is not None else None
        wanted = truth.get("module_class", "") if truth else None
        if not wanted:
            match.append(label in (UNATTRIBUTED, NO_MODULE, ROOT_MODULE, ""))
        else:
            match.append(label_class(label, fqn_classes) == wanted)
    picked = np.asarray(match, dtype=bool)
    return float(weights[picked].sum() / weights.sum()) if weights.sum() else 1.0


def recording_agreement(snapshot: Path, tags: bool = True, source_roots: Sequence[str] = ()) -> dict[str, float]:
    """Category agreement over every allocation of the recording, bytes-weighted (each allocation counted once,
    by its block size, whenever it lived), and the module-class agreement over the same allocations."""
    truth, trace = _truth_and_attributed(snapshot, tags, source_roots)
    rows = trace.allocations[trace.allocations["device"] == truth["device"]]
    return {"category": _category_share(rows, truth["allocations"]),
            "module_class": _module_class_share(rows, truth["allocations"])}


def zoo_scores(snapshot: Path, tags: bool = False, source_roots: Sequence[str] = ()) -> dict[str, float]:
    """The zoo's three measures (without capture tags by default): category agreement at the peak and over
    the recording, and module-class agreement at the peak; each a share of bytes in [0, 1]. Classes are read
    only under `source_roots` (`simulator_sources()` for the code the zoo ran)."""
    truth, trace = _truth_and_attributed(snapshot, tags, source_roots)
    labels = truth["allocations"]
    live = find_peak(trace, truth["device"]).live
    rows = trace.allocations[trace.allocations["device"] == truth["device"]]
    return {"category_peak": _category_share(live, labels), "category_recording": _category_share(rows, labels),
            "module_class_peak": _module_class_share(live, labels)}
