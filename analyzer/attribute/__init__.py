"""Attribute every allocation to a phase, a category, a module and a step, saying which signal decided.

Signals, strongest first (the first one that speaks decides; `label_source` names it):
1. explicit tags: `tensor::ROLE::FQN::ADDR` marks naming the module and role of a parameter, buffer,
   gradient or optimizer state at an address, the allocator's `user_metadata` (torch >= 2.10), then
   `phase::NAME` and
   `module::forward|backward::FQN` ranges written by analyzer's capture helpers (where module ranges
   overlap, the deepest module wins), FSDP ranges carrying FQNs (`FSDP::pre_forward (layers.3)`);
2. the recording's own labels: the category torch's memory profiler gave every tensor of an
   `export_memory_timeline` file (`recording:torch-memory-profiler`, kept over every rule below);
   annotations: `Optimizer.step#…`, `Optimizer.zero_grad#…`, `enumerate(DataLoader)#…`, torch.compile
   `(dynamo_timed)` ranges (phase `compile`: compile-time memory is not training memory), `ProfilerStep#N`
   (steps), user `record_function` ranges named like a phase (`forward`, `backward`, `optimizer` ...);
3. stack frames: torch frames that identify a phase (autograd, torch.optim, torch.save / state_dict,
   load_state_dict / Module.to, activation-checkpoint recomputation), the module call path of the `forward`
   (and constructor) frames, `Outer › Inner` with class names where the source is readable here, else
   `file:line forward` (see `analyzer.attribute.modules` for the module's signals, mirrors of the forward and
   parameters' sizes included);
4. timing: allocations with no Python frames in a recording that has them come from autograd's thread
   (backward), unless its C++ frames say otherwise or they sit inside the forward (`analyzer.attribute.timing`);
   model states from structure where nothing else speaks (`analyzer.attribute.model_states`);
5. lifetime, for categories: see `analyzer.attribute.category`.
Where nothing decides, the label is `unattributed`: a guess is never shown as a fact.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import annotation_labels, metadata_labels, tensor_marks
from analyzer.attribute.category import categorise, recomputed_activations
from analyzer.attribute.frames import FrameMemo, StackFacts, stack_facts
from analyzer.attribute.model_states import (
    FROZEN_LUMP_SHARE,
    REPLACES_PARAMETER,
    REPLACES_STATE,
    frozen_base_before_trace,
    infer_model_states,
)
from analyzer.attribute.module_paths import SourceIndex
from analyzer.attribute.modules import assign_modules
from analyzer.attribute.profiler_ops import forward_categories, op_labels
from analyzer.attribute.steps import number_steps
from analyzer.attribute.timing import frameless_phases
from analyzer.attribute.workspaces import label_workspaces
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import AS_OUR_CATEGORY, TORCH_PROFILER_LABEL_SOURCE, UNATTRIBUTED, Category, Phase, Role

CONFIDENCE = {"tag": 1.0, "recording": 1.0, "annotation": 0.95, "frames": 0.9, "ops": 0.9, "timing": 0.7, "lifetime": 0.8,
              "size-match": 0.6, "structure": 0.6}


#: signals below their kind's confidence: a repeated block told apart by order, not by what was recorded
SIGNAL_CONFIDENCE = {"frames:call-path+order": 0.75, "ops:before-backward": 0.8, "ops:freed-in-backward": 0.7,
                     "ops:freed-by-zero_grad": 0.7, "ops:alive-through-inference": 0.6,
                     "structure:torch-category": 0.8}

#: the phase that makes a tensor of torch's memory-profiler category: an activation is a forward op's output kept
#: for backward, a gradient and the autograd engine's own buffers are made by backward
_PHASE_OF_TORCH_CATEGORY = {Category.ACTIVATION.value: Phase.FORWARD.value, Category.GRADIENT.value: Phase.BACKWARD.value,
                            "autograd_detail": Phase.BACKWARD.value}


def _confidence(source: object) -> float:
    if not source:
        return 0.0
    return SIGNAL_CONFIDENCE.get(str(source), CONFIDENCE.get(str(source).split(":")[0], 0.0))


def _categorical(values: np.ndarray) -> pd.Categorical:
    """A categorical from an object array holding None for unattributed (hash-factorised, not per element)."""
    codes, uniques = pd.factorize(values, use_na_sentinel=True)
    categories = [str(u) for u in uniques]
    if (codes < 0).any():
        if UNATTRIBUTED not in categories:
            categories.append(UNATTRIBUTED)
        codes = np.where(codes < 0, categories.index(UNATTRIBUTED), codes)
    return pd.Categorical.from_codes(codes, categories=categories)


def _combinations(*columns: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
    """(code per row, distinct tuples): rows of several object columns (None allowed) factorised together."""
    codes, uniques = zip(*(pd.factorize(c, use_na_sentinel=False) for c in columns), strict=True)
    combined = np.zeros(len(columns[0]), dtype=np.int64)
    for c, u in zip(codes, uniques, strict=True):
        combined = combined * max(len(u), 1) + c
    inverse, distinct = pd.factorize(combined)      # by hash, not a sort of every row
    first = np.zeros(len(distinct), dtype=np.int64)
    first[inverse[::-1]] = np.arange(len(combined))[::-1]  # a row holding each combination
    return inverse, [tuple(c[i] for c in columns) for i in first]


def _label_sources(phase: np.ndarray, category: np.ndarray, module: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`phase=…;category=…;module=…` and the confidence, built once per distinct combination of signals."""
    codes, combos = _combinations(phase, category, module)
    names = np.asarray([f"phase={p or 'none'};category={c or 'none'};module={m or 'none'}" for p, c, m in combos]
                       or [""], dtype=object)
    # the module's signal counts where it named one (an unattributed module claims nothing)
    confidence = np.asarray([min(_confidence(p), _confidence(c), *([_confidence(m)] if m else []))
                             for p, c, m in combos] or [0.0])
    return names[codes], confidence[codes]


def attribute(trace: MemoryTrace, source_roots: Sequence[str | Path] = (),
              frozen_lump_share: float = FROZEN_LUMP_SHARE) -> MemoryTrace:
    """The trace with module, phase, category (and category_from_seq), step, label_source and confidence filled
    in for every allocation (a new MemoryTrace: the one given is left as it was, and the new one's timeline is built from
    the labels on first use). `source_roots`: local checkouts of the code the recording ran, where the frames'
    source files are looked up (longest suffix of their paths) to read module class names. `frozen_lump_share`:
    model_states rule 6's share (analyzer.Thresholds.frozen_lump_share)."""
    a = trace.allocations.copy(deep=False)
    sources = SourceIndex(source_roots)
    sources.check(set().union(*trace.stacks["frames"]))   # each distinct frame once, however many stacks share it
    memo: FrameMemo = {}
    facts = [stack_facts(f, sources, memo) for f in trace.stacks["frames"]]
    parts = [_attribute_device(trace, d, facts, frozen_lump_share) for d in sorted(a["device"].unique())]
    if not parts:
        return replace(trace, allocations=a)
    order = np.argsort(np.concatenate([np.flatnonzero(a["device"].to_numpy() == d) for d in sorted(a["device"].unique())]))
    labels = {k: np.concatenate([p[k] for p in parts])[order] for k in parts[0]}
    for column in ("module", "phase", "category", "label_source"):
        a[column] = _categorical(labels[column])
    a["step"] = pd.arrays.IntegerArray(labels["step"].astype(np.int64), labels["step"] < 0)
    a["confidence"] = labels["confidence"].astype(np.float64)
    settles = labels["category_from_seq"]
    a["category_from_seq"] = pd.arrays.IntegerArray(np.nan_to_num(settles, nan=0).astype(np.int64), np.isnan(settles))
    return replace(trace, allocations=a)


def _attribute_device(trace: MemoryTrace, device: int, facts: list[StackFacts],
                      frozen_lump_share: float) -> dict[str, np.ndarray]:
    a = trace.allocations[trace.allocations["device"] == device]
    ann = trace.annotations[trace.annotations["device"] == device].reset_index(drop=True)
    t_alloc = a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    stacks = a["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    has_python = np.asarray([f.has_python for f in facts] + [False], dtype=bool)[stacks]
    frame_phase = np.asarray([f.phase for f in facts] + [None], dtype=object)[stacks]
    frame_signal = np.asarray([f.phase_signal for f in facts] + [None], dtype=object)[stacks]
    timed = ~np.isnan(t_alloc)
    times = np.where(timed, t_alloc, -np.inf)

    phase = np.full(len(a), None, dtype=object)
    source = np.full(len(a), None, dtype=object)
    metadata = a["user_metadata"].array
    _fill(phase, source, *metadata_labels(metadata, "phase"))
    for kind in ("tag", "annotation"):
        values, signals = annotation_labels(ann, times, kind, "phase")
        _fill(phase, source, values, signals)
    ops = op_labels(trace, a, ann)
    if ops is not None:  # what a profiler trace's backward ops ran decides before frames; the rest after them
        engine = ops.phase_signal == "ops:autograd-engine"
        _fill(phase, source, np.where(engine, ops.phase, np.full(len(a), None, dtype=object)), ops.phase_signal)
    _fill(phase, source, frame_phase, frame_signal)
    if ops is not None:
        _fill(phase, source, ops.phase, ops.phase_signal)
    _fill(phase, source, *_phases_of_recorded_categories(a))
    recorded_python = bool(has_python[timed].any())
    frameless = timed & ~has_python & recorded_python
    _fill(phase, source, *frameless_phases(frameless, phase, t_alloc, any(f.has_native for f in facts)))
    _fill(phase, source, *_between_neighbours(phase, t_alloc))

    step = number_steps(ann, t_alloc, phase)
    marked_role, marked_module = _marked_tensors(a, tensor_marks(ann))
    category, category_source = categorise(a, phase, step, ann)
    tensors_before = trace.blocks_before
    t_free = a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.inf)
    remade = recomputed_activations(source, t_alloc, t_free)
    category[remade], category_source[remade] = Category.ACTIVATION.value, "lifetime:recomputed-activation"
    if ops is not None:
        forward_categories(ops, phase, category, category_source, t_free)
    category_from = np.full(len(a), np.nan)
    infer_model_states(a, phase, category, category_source, category_from,
                       replicates=np.asarray([f.replicates for f in facts] + [False], dtype=bool)[stacks],
                       init_site=np.asarray([f.init_site for f in facts] + [None], dtype=object)[stacks],
                       blocks_before_recording=tensors_before)
    if not tensors_before and not trace.records_categories:   # torch's memory timeline names them itself
        frozen_base_before_trace(a, phase, step, category, category_source, share=frozen_lump_share)
    unknown_pass = label_workspaces(a, stacks, np.asarray([f.workspace for f in facts] + [False], dtype=bool)[stacks],
                                    phase, category, category_source,
                                    {d: i.workspace_before_bytes for d, i in trace.devices.items()})
    phase[unknown_pass], source[unknown_pass] = None, None   # not loaded: made by some matmul before the recording
    has_mark = ~pd.isna(marked_role)
    category[has_mark] = np.where(marked_role[has_mark] == Role.BUFFER, Role.BUFFER.category.value, marked_role[has_mark])
    category_source[has_mark] = "tag:tensor"
    module, module_source = assign_modules(a, ann, times, stacks, [f.call_path for f in facts], category,
                                           metadata_labels(metadata, "module"), step=step, phase=phase,
                                           compiled=np.asarray([f.compiled for f in facts] + [False], dtype=bool)[stacks],
                                           outside=np.asarray([f.outside_modules for f in facts] + [False], dtype=bool)[stacks],
                                           moved=np.asarray([f.moved_by for f in facts] + [None], dtype=object)[stacks],
                                           built=np.asarray([f.built_by for f in facts] + [None], dtype=object)[stacks],
                                           framed=has_python if tensors_before else None)
    if ops is not None:   # the trace's own nn.Module spans name the class and instance, whatever the source here says
        spoke = ~pd.isna(ops.module)
        module[spoke], module_source[spoke] = ops.module[spoke], ops.module_signal[spoke]
    module[has_mark], module_source[has_mark] = marked_module[has_mark], "tag:tensor"
    _recorded_categories(a, category, category_source, trace.records_categories)
    category_from[~np.isin(category_source, (REPLACES_PARAMETER, REPLACES_STATE))] = np.nan  # a later signal won
    label_source, confidence = _label_sources(source, category_source, module_source)
    return {"module": module, "phase": phase, "category": category, "step": step, "label_source": label_source,
            "confidence": confidence, "category_from_seq": category_from}


def _recorded_categories(a: pd.DataFrame, category: np.ndarray, source: np.ndarray, memory_timeline: bool) -> None:
    """The recording's own labels, kept over ours: torch's memory profiler categorised every tensor of an
    export_memory_timeline file (its reader keeps them, with TORCH_PROFILER_LABEL_SOURCE), its unknown ones included."""
    given = a["category"].astype(str).to_numpy()
    rows = (a["label_source"].astype(str).to_numpy() == TORCH_PROFILER_LABEL_SOURCE) & (given != UNATTRIBUTED)
    category[rows] = [AS_OUR_CATEGORY.get(c, c) for c in given[rows]]
    source[rows] = "recording:torch-memory-profiler"
    if memory_timeline:   # what torch could not tell, nor can we: no rule of ours knows more than its data flow
        category[~rows], source[~rows] = None, None


def _phases_of_recorded_categories(a: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """An export_memory_timeline file has no ops and no frames, but torch's category of a tensor says which pass
    made it (`_PHASE_OF_TORCH_CATEGORY`): enough to see the phase cycle, and so the steps, of the recording.
    Tensors alive before the recording (untimed) were made by a pass it did not see: they get no phase."""
    given = a["category"].astype(str).to_numpy()
    recorded = (a["label_source"].astype(str).to_numpy() == TORCH_PROFILER_LABEL_SOURCE) & a["t_alloc_us"].notna().to_numpy()
    phase = np.full(len(a), None, dtype=object)
    phase[recorded] = [_PHASE_OF_TORCH_CATEGORY.get(c) for c in given[recorded]]
    signal = np.full(len(a), None, dtype=object)
    signal[~pd.isna(phase)] = "structure:torch-category"
    return phase, signal


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


_NEIGHBOUR_RULES: dict[tuple[str | None, str], str] = {  # (phase before, phase after) -> phase between
    (Phase.FORWARD, Phase.FORWARD): Phase.FORWARD.value, (Phase.FORWARD, Phase.BACKWARD): Phase.FORWARD.value,
    (Phase.BACKWARD, Phase.BACKWARD): Phase.BACKWARD.value, (Phase.OPTIMIZER, Phase.OPTIMIZER): Phase.OPTIMIZER.value,
    (Phase.LOAD, Phase.LOAD): Phase.LOAD.value, (None, Phase.LOAD): Phase.LOAD.value,
    (Phase.LOAD, Phase.FORWARD): Phase.LOAD.value}


def _between_neighbours(phase: np.ndarray, t_alloc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unlabelled timed allocations take the phase their labelled neighbours in time agree on (a loss
    computed between the model's forward and backward is forward; a buffer made while loading is load)."""
    order = np.argsort(np.where(np.isnan(t_alloc), np.inf, t_alloc), kind="stable")
    timed = ~np.isnan(t_alloc[order])
    codes, names = pd.factorize(phase[order][timed])          # by code, not a string a row; unlabelled: -1
    labelled = codes >= 0
    place = np.arange(len(codes))
    before = np.maximum.accumulate(np.where(labelled, place, -1))                     # the last labelled so far
    after = np.minimum.accumulate(np.where(labelled, place, len(codes))[::-1])[::-1]  # the next labelled
    known = [*names, None]                                     # code -1 (none on that side): None
    rules = np.asarray([[_NEIGHBOUR_RULES.get((p, f)) for f in known] for p in known], dtype=object)
    previous = np.where(before >= 0, codes[np.maximum(before, 0)], -1)
    following = np.where(after < len(codes), codes[np.minimum(after, len(codes) - 1)], -1)
    decided = np.where(labelled, None, rules[previous, following]) if len(codes) else np.zeros(0, dtype=object)  # type: ignore[call-overload]  # numpy's ArrayLike omits None
    values = np.full(len(phase), None, dtype=object)
    values[order[timed]] = decided
    return values, np.where(pd.isna(values), None, "timing:neighbours")  # type: ignore[call-overload]  # numpy's ArrayLike omits None


def _fill(target: np.ndarray, source: np.ndarray, values: np.ndarray, signals: np.ndarray) -> None:
    """Set labels where none is set yet: earlier signals take precedence."""
    free = pd.isna(target) & ~pd.isna(values)
    target[free] = values[free]
    source[free] = signals[free]
