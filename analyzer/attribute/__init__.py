"""Attribute every allocation to a phase, a category, a module and a step, saying which signal decided.

Signals, strongest first (the first one that speaks decides; `label_source` names it):
1. explicit tags: `tensor::ROLE::FQN::ADDR` marks naming the module and role of a parameter, buffer,
   gradient or optimizer state at an address, the allocator's `user_metadata` (torch >= 2.10), then
   `phase::NAME` and
   `module::forward|backward::FQN` ranges written by analyzer's capture helpers (where module ranges
   overlap, the deepest module wins), FSDP ranges carrying FQNs (`FSDP::pre_forward (layers.3)`);
2. annotations: `Optimizer.step#…`, `Optimizer.zero_grad#…`, `enumerate(DataLoader)#…`, torch.compile
   `(dynamo_timed)` ranges (phase `compile`: compile-time memory is not training memory), `ProfilerStep#N`
   (steps), user `record_function` ranges named like a phase (`forward`, `backward`, `optimizer` ...);
3. stack frames: torch frames that identify a phase (autograd, torch.optim, torch.save / state_dict,
   load_state_dict / Module.to, activation-checkpoint recomputation), the user `forward` frame (module
   `Class.forward` when the source is readable here, else `file:line forward`);
4. timing: allocations with no Python frames in a recording that has them come from autograd's thread:
   backward;
5. lifetime, for categories: see `analyzer.attribute.category`.
Where nothing decides, the label is `unattributed`: a guess is never shown as a fact.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import annotation_labels, metadata_labels, tensor_marks
from analyzer.attribute.category import categorise
from analyzer.attribute.frames import stack_facts
from analyzer.attribute.modules import assign_modules
from analyzer.attribute.steps import number_steps
from analyzer.trace import UNATTRIBUTED, MemoryTrace

CONFIDENCE = {"tag": 1.0, "annotation": 0.95, "frames": 0.9, "timing": 0.7, "lifetime": 0.8, "size-match": 0.6}


def _confidence(source: object) -> float:
    return CONFIDENCE.get(str(source).split(":")[0], 0.0) if source else 0.0


def attribute(trace: MemoryTrace) -> MemoryTrace:
    """Fill module, phase, category, step, label_source and confidence of `trace.allocations` (in place)."""
    parts = [_attribute_device(trace, d) for d in sorted(trace.allocations["device"].unique())]
    if not parts:
        return trace
    labels = pd.concat(parts).sort_index()
    a = trace.allocations
    for column in ("module", "phase", "category", "label_source"):
        a[column] = pd.Categorical(labels[column].fillna(UNATTRIBUTED).to_numpy(dtype=object))
    a["step"] = pd.array(labels["step"].to_numpy(), dtype="Int64")
    a["confidence"] = labels["confidence"].to_numpy(dtype=np.float64)
    return trace


def _attribute_device(trace: MemoryTrace, device: int) -> pd.DataFrame:
    a = trace.allocations[trace.allocations["device"] == device]
    ann = trace.annotations[trace.annotations["device"] == device].reset_index(drop=True)
    t_alloc = a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    stacks = a["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    facts = [stack_facts(f) for f in trace.stacks["frames"]]
    has_python = np.asarray([f.has_python for f in facts] + [False], dtype=bool)[stacks]
    frame_phase = np.asarray([f.phase for f in facts] + [None], dtype=object)[stacks]
    frame_signal = np.asarray([f.phase_signal for f in facts] + [None], dtype=object)[stacks]
    frame_module = np.asarray([f.module for f in facts] + [None], dtype=object)[stacks]
    timed = ~np.isnan(t_alloc)
    times = np.where(timed, t_alloc, -np.inf)

    phase = np.full(len(a), None, dtype=object)
    source = np.full(len(a), None, dtype=object)
    metadata = a["user_metadata"].astype(str).to_numpy()
    _fill(phase, source, *metadata_labels(metadata, "phase"))
    for kind in ("tag", "annotation"):
        values, signals = annotation_labels(ann, times, kind, "phase")
        _fill(phase, source, values, signals)
    _fill(phase, source, frame_phase, frame_signal)
    recorded_python = bool(has_python[timed].any())
    frameless = timed & ~has_python & recorded_python
    _fill(phase, source, np.where(frameless, "backward", None), np.where(frameless, "timing:no-python-frames", None))
    _fill(phase, source, *_between_neighbours(phase, t_alloc))

    step = number_steps(ann, t_alloc, phase)
    marked_role, marked_module = _marked_tensors(a, tensor_marks(ann))
    category, category_source = categorise(a, phase, step, ann)
    has_mark = np.asarray([r is not None for r in marked_role], dtype=bool)
    category[has_mark] = np.where(marked_role[has_mark] == "buffer", "parameter", marked_role[has_mark])
    category_source[has_mark] = "tag:tensor"
    module, module_source = assign_modules(a, ann, times, frame_module, category, metadata_labels(metadata, "module"))
    module[has_mark], module_source[has_mark] = marked_module[has_mark], "tag:tensor"
    label_source = [f"phase={p or 'none'};category={c or 'none'};module={m or 'none'}"
                    for p, c, m in zip(source, category_source, module_source)]
    confidence = [min(_confidence(p), _confidence(c)) for p, c in zip(source, category_source)]
    return pd.DataFrame({"module": module, "phase": phase, "category": category, "step": step,
                         "label_source": label_source, "confidence": confidence}, index=a.index)


def _marked_tensors(a: pd.DataFrame, marks: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Role and module of each allocation that a `tensor::` mark names: same address, alive at the mark."""
    role = np.full(len(a), None, dtype=object)
    module = np.full(len(a), None, dtype=object)
    if marks.empty:
        return role, module
    rows = pd.DataFrame({"row": np.arange(len(a)), "addr": a["addr"].to_numpy(),
                         "t_alloc": a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=-np.inf),
                         "t_free": a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.inf)})
    joined = rows.merge(marks, on="addr")
    joined = joined[(joined["t_alloc"] <= joined["t_us"]) & (joined["t_us"] < joined["t_free"])]
    joined = joined.sort_values("t_us").drop_duplicates("row", keep="last")
    role[joined["row"].to_numpy()] = joined["role"].to_numpy()
    module[joined["row"].to_numpy()] = joined["module"].to_numpy()
    return role, module


_NEIGHBOUR_RULES = {("forward", "forward"): "forward", ("forward", "backward"): "forward",
                    ("backward", "backward"): "backward", ("optimizer", "optimizer"): "optimizer",
                    ("load", "load"): "load", (None, "load"): "load", ("load", "forward"): "load"}


def _between_neighbours(phase: np.ndarray, t_alloc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unlabelled timed allocations take the phase their labelled neighbours in time agree on (a loss
    computed between the model's forward and backward is forward; a buffer made while loading is load)."""
    order = np.argsort(np.where(np.isnan(t_alloc), np.inf, t_alloc), kind="stable")
    labelled = [phase[i] for i in order]
    values = np.full(len(phase), None, dtype=object)
    previous = None
    pending: list[int] = []
    for i, p in zip(order, labelled):
        if np.isnan(t_alloc[i]):
            break
        if p is None:
            pending.append(i)
            continue
        decided = _NEIGHBOUR_RULES.get((previous, p))
        for j in pending:
            values[j] = decided
        pending, previous = [], p
    for j in pending:  # after the last labelled allocation
        values[j] = _NEIGHBOUR_RULES.get((previous, None))
    return values, np.where(np.asarray([v is not None for v in values], dtype=bool), "timing:neighbours", None)


def _fill(target: np.ndarray, source: np.ndarray, values: np.ndarray, signals: np.ndarray) -> None:
    """Set labels where none is set yet: earlier signals take precedence."""
    free = np.asarray([t is None for t in target], dtype=bool) & np.asarray([v is not None for v in values], dtype=bool)
    target[free] = values[free]
    source[free] = signals[free]
