"""Phase and module of a profiler trace's memory events from what the trace says ran on their thread.

A Kineto `[memory]` event carries no op id, but the spans of its thread say what ran then:
- inside an `autograd::engine::evaluate_function: XBackward0` op it is backward work (`ops:autograd-engine`);
  its module is the module of the forward op that made node X (same `Sequence number`: `ops:sequence-number`);
- inside the `nn.Module: Class_N` spans (`with_modules`) it belongs to that module instance, named with its
  enclosing ones outermost first, `Sequential_0 › TinyBlock_1 › Linear_3` (`ops:nn.Module`);
- in a step (`ProfilerStep#N`, else the whole trace) before its first backward op, and at or after its first
  module call where modules were recorded (what comes before the model call is its input), it is forward
  work (`ops:before-backward`); a step without a backward op is inference: all of it is forward;
- an allocation the trace saw freed but not made (made before the profiler started) is forward work when a
  backward op freed it (an activation it consumed), backward work when `Optimizer.zero_grad` freed it (a
  gradient of the step before); memory alive through a trace with no backward op is what was loaded
  (the weights), and nothing is said of it in a trace that trains (weights, gradients and optimizer state
  all look alike in a running total).
Categories then follow from lifetime (analyzer.attribute.category), except in forward, where an op says more:
a tensor freed before the op that made it returned is that op's temporary, one that outlives it is an
activation (`ops:freed-inside-op` / `ops:outlived-op`), as torch's memory profiler defines them. In the optimizer
step lifetime decides: torch's data-flow flood calls single-tensor Adam's `exp_avg_sq.sqrt()` a parameter and its
quotient an activation, which the run contradicts (docs/results/accuracy.md), and the trace keeps no tensor ids
to follow that flow anyway.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import classify
from analyzer.attribute.module_paths import MAX_LEVELS
from analyzer.attribute.ranges import innermost
from analyzer.core.intervals import innermost_open
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, OPTIMIZER_ZERO_GRAD_PREFIX, Category, Phase

#: the autograd engine's ops: evaluate_function wrappers, and in 2021 traces the nodes themselves
_BACKWARD_OP = r"^autograd::engine::evaluate_function: |^\w*Backward\d*$|^torch::autograd::AccumulateGrad$"
_MODULE = "nn.Module: "


@dataclass
class OpLabels:
    """Per allocation of one device (object arrays, None where the ops say nothing)."""

    phase: np.ndarray
    phase_signal: np.ndarray
    module: np.ndarray
    module_signal: np.ndarray
    op_end: np.ndarray      # end of the outermost op that made it (NaN: made outside every op)


def op_labels(trace: MemoryTrace, a: pd.DataFrame, annotations: pd.DataFrame) -> OpLabels | None:
    """Labels for the allocations `a` (one device) of a profiler trace; None for a trace without ops."""
    spans = trace.spans
    if spans is None or trace.event_threads is None or not spans["cat"].isin(["cpu_op", "Operator"]).any():
        return None
    n = len(a)
    labels = OpLabels(np.full(n, None, dtype=object), np.full(n, None, dtype=object), np.full(n, None, dtype=object),
                      np.full(n, None, dtype=object), np.full(n, np.nan))
    t_alloc = a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    t_free = a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    alloc_thread, free_thread = _threads(trace, a)
    names = spans["name"].astype(str)
    operator = (spans["cat"] == "Operator").to_numpy()  # 2021 traces: ops, and record_function ranges named with #
    cpu = (spans["cat"] == "cpu_op").to_numpy() | operator & ~names.str.contains("#", regex=False).to_numpy()
    backward = cpu & names.str.match(_BACKWARD_OP).to_numpy()
    forward_ops = cpu & ~backward
    modules = ((spans["cat"] == "python_function") & names.str.startswith(_MODULE)).to_numpy()
    paths = _module_paths(spans, modules)
    start = spans["start_us"].to_numpy(dtype=np.float64)
    end = spans["end_us"].to_numpy(dtype=np.float64)
    thread = spans["thread"].to_numpy()

    by_thread = pd.Series(np.arange(len(spans))).groupby(thread).indices

    def inside(kind: np.ndarray, times: np.ndarray, threads: np.ndarray, outermost: bool = False) -> np.ndarray:
        """Span row (of `kind`) open at each time on its thread, -1 where none."""
        out = np.full(len(times), -1, dtype=np.int64)
        asked = ~np.isnan(times)
        for t, ask in pd.Series(np.flatnonzero(asked)).groupby(threads[asked]).indices.items():
            ask = np.flatnonzero(asked)[ask]
            rows = by_thread.get(t, np.zeros(0, dtype=np.int64))
            rows = rows[kind[rows]]
            if outermost:  # sorted by start, longest first on ties: an op no earlier one holds ends later than all
                rows = rows[np.lexsort((-end[rows], start[rows]))]
                rows = rows[end[rows] > np.concatenate([[-np.inf], np.maximum.accumulate(end[rows])[:-1]])]
            hit = innermost_open(start[rows], end[rows], times[ask])
            out[ask[hit >= 0]] = rows[hit[hit >= 0]]
        return out

    # backward: inside an autograd engine op; its module is that of the forward op of the same sequence number
    made_in_backward = inside(backward, t_alloc, alloc_thread)
    is_backward = made_in_backward >= 0
    labels.phase[is_backward], labels.phase_signal[is_backward] = Phase.BACKWARD.value, "ops:autograd-engine"
    module_rows = inside(modules, t_alloc, alloc_thread)
    has_module = (module_rows >= 0) & ~is_backward
    labels.module[has_module] = paths[module_rows[has_module]]
    labels.module_signal[has_module] = "ops:nn.Module"
    if modules.any() and is_backward.any():
        forward_module = _forward_modules(spans, forward_ops, backward, inside, modules, paths)
        node = spans["sequence"].to_numpy(dtype=np.float64, na_value=np.nan)[made_in_backward[is_backward]]
        linked = np.asarray([forward_module.get(s) for s in node.tolist()], dtype=object)
        rows = np.flatnonzero(is_backward)[pd.notna(linked)]
        labels.module[rows], labels.module_signal[rows] = linked[pd.notna(linked)], "ops:sequence-number"

    # forward: before the step's first backward op (and from its first module call, where modules are known)
    steps = annotations[np.asarray([classify(n)[0] == "step" for n in annotations["name"]], dtype=bool)]
    step_starts = np.sort(steps["start_us"].to_numpy(dtype=np.float64, na_value=-np.inf))
    window = _window(step_starts, t_alloc)
    forward = ~np.isnan(t_alloc) & ~is_backward & (t_alloc < _first_in_window(step_starts, window, start[backward]))
    if modules.any():
        forward &= t_alloc >= _first_in_window(step_starts, window, start[modules])
    labels.phase[forward], labels.phase_signal[forward] = Phase.FORWARD.value, "ops:before-backward"
    outer = inside(forward_ops, t_alloc, alloc_thread, outermost=True)
    labels.op_end[outer >= 0] = end[outer[outer >= 0]]

    # made before the profiler started: what freed it, or what stayed alive through an inference trace
    before = np.isnan(t_alloc)
    freed_by_backward = before & (inside(backward, t_free, free_thread) >= 0)
    labels.phase[freed_by_backward], labels.phase_signal[freed_by_backward] = Phase.FORWARD.value, "ops:freed-in-backward"
    zero_grad = annotations[annotations["name"].str.startswith(OPTIMIZER_ZERO_GRAD_PREFIX)]
    freed_by_zero_grad = before & _within(zero_grad, t_free) & ~freed_by_backward
    labels.phase[freed_by_zero_grad] = Phase.BACKWARD.value
    labels.phase_signal[freed_by_zero_grad] = "ops:freed-by-zero_grad"
    if not backward.any():
        kept = before & np.isnan(t_free)
        labels.phase[kept], labels.phase_signal[kept] = Phase.LOAD.value, "ops:alive-through-inference"
    return labels


def forward_categories(labels: OpLabels, phase: np.ndarray, category: np.ndarray, source: np.ndarray,
                       t_free: np.ndarray) -> None:
    """Forward tensors made inside an op: temporaries of that op if freed before it returned, else activations
    (in place, over what the lifetime rules said)."""
    rows = (phase == Phase.FORWARD) & ~np.isnan(labels.op_end) & np.isin(source, ["lifetime:forward"])
    freed_inside = rows & (t_free <= labels.op_end)
    category[rows] = Category.ACTIVATION.value
    source[rows] = "ops:outlived-op"
    category[freed_inside], source[freed_inside] = Category.TEMPORARY.value, "ops:freed-inside-op"


def _threads(trace: MemoryTrace, a: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The thread that made and the one that freed each allocation (-1 where not recorded)."""
    assert trace.event_threads is not None
    events = trace.events
    device = a["device"].iloc[0] if len(a) else 0
    mine = (events["device"] == device).to_numpy()
    by_seq = pd.Series(trace.event_threads.to_numpy(dtype=np.float64, na_value=-1.0)[mine],
                       index=events["seq"].to_numpy()[mine])
    by_seq = by_seq[~by_seq.index.duplicated()]
    out = []
    for column in ("seq_alloc", "seq_free"):
        seq = a[column].to_numpy(dtype=np.float64, na_value=np.nan)
        out.append(by_seq.reindex(seq).fillna(-1).to_numpy())
    return out[0], out[1]


def _module_paths(spans: pd.DataFrame, modules: np.ndarray) -> np.ndarray:
    """For every span row, the module path of an `nn.Module` span (its enclosing modules through the Python
    call tree, outermost first), None for other rows. One pass in Python-id order (a caller's id is smaller)."""
    paths = np.full(len(spans), None, dtype=object)
    if not modules.any():
        return paths
    python = spans["python_id"].to_numpy(dtype=np.float64, na_value=np.nan)
    parent = spans["parent_id"].to_numpy(dtype=np.float64, na_value=np.nan)
    names = spans["name"].astype(str).to_numpy()
    rows = np.flatnonzero(~np.isnan(python) & (spans["cat"] == "python_function").to_numpy())
    rows = rows[np.argsort(python[rows], kind="stable")]
    enclosing: dict[float, tuple[str, ...]] = {}   # python id -> path of the nearest module at or above it
    for row in rows.tolist():
        pid, up = python[row], parent[row]
        above = enclosing.get(up, ()) if not math.isnan(up) and up < pid else ()
        if modules[row]:
            above = (*above, names[row][len(_MODULE):])[-MAX_LEVELS:]
            paths[row] = MODULE_PATH_SEPARATOR.join(above)
        enclosing[pid] = above
    return paths


def _forward_modules(spans: pd.DataFrame, forward_ops: np.ndarray, backward: np.ndarray, inside,
                     modules: np.ndarray, paths: np.ndarray) -> dict[float, str]:
    """Module of the forward op of each autograd sequence number that a backward op of the trace carries."""
    sequence = spans["sequence"].to_numpy(dtype=np.float64, na_value=np.nan)
    wanted = set(sequence[backward].tolist())
    rows = np.flatnonzero(forward_ops & np.isin(sequence, list(wanted)))
    if not len(rows):
        return {}
    first = pd.DataFrame({"row": rows, "seq": sequence[rows], "start": spans["start_us"].to_numpy()[rows]})
    first = first.sort_values(["seq", "start"], kind="stable").drop_duplicates("seq")  # the outermost op
    hit = inside(modules, first["start"].to_numpy(dtype=np.float64),
                 spans["thread"].to_numpy()[first["row"].to_numpy()].astype(np.float64))
    return {s: paths[h] for s, h in zip(first["seq"].tolist(), hit.tolist(), strict=True) if h >= 0}


def _window(step_starts: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Index of the ProfilerStep range each time falls in (-1 before the first; all 0 without steps)."""
    if not len(step_starts):
        return np.zeros(len(times), dtype=np.int64)
    return np.searchsorted(step_starts, np.nan_to_num(times, nan=-np.inf), side="right") - 1


def _first_in_window(step_starts: np.ndarray, window: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Per allocation (by its window), the first of `times` in the same step window (inf where none)."""
    firsts = pd.Series(times).groupby(_window(step_starts, times)).min().to_dict() if len(times) else {}
    return np.asarray([firsts.get(w, np.inf) for w in window.tolist()], dtype=np.float64)


def _within(ranges: pd.DataFrame, times: np.ndarray) -> np.ndarray:
    """Whether each time falls inside one of `ranges`."""
    return innermost(ranges.reset_index(drop=True), np.nan_to_num(times, nan=-np.inf)) >= 0
