"""What each annotation name means: a phase, a module, a step, or nothing we know."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.attribute.ranges import innermost
from analyzer.core.vocabulary import (
    OPTIMIZER_STEP_PREFIX,
    OPTIMIZER_ZERO_GRAD_PREFIX,
    PROFILER_STEP_PREFIX,
    ROOT_MODULE,
    TENSOR_PREFIX,
    Phase,
    parse_module_label,
    parse_phase_label,
    parse_tensor_mark,
)

_FSDP = re.compile(r"^FSDP::(pre_forward|post_forward|pre_backward|post_backward|forward|backward)\s*\((.*)\)\s*$")
_STEP = re.compile(rf"^{re.escape(PROFILER_STEP_PREFIX)}(\d{{1,18}})$")  # a longer number is no step: int64 holds 18 digits
# how people name their own ranges -> the phase they mean
_USER_RANGE_PHASES: dict[str, str] = {
    "forward": Phase.FORWARD, "fwd": Phase.FORWARD, "backward": Phase.BACKWARD, "bwd": Phase.BACKWARD,
    "optimizer": Phase.OPTIMIZER, "optimizer_step": Phase.OPTIMIZER, "optim": Phase.OPTIMIZER,
    "checkpoint": Phase.CHECKPOINT_SAVE, "save": Phase.CHECKPOINT_SAVE, "save_checkpoint": Phase.CHECKPOINT_SAVE,
    "load": Phase.LOAD, "load_model": Phase.LOAD}


def classify(name: str) -> tuple[str, str | None, str | None, str]:
    """(kind, phase, module, signal) for one annotation name. kind: tag | annotation | step | user."""
    if (phase := parse_phase_label(name)) is not None:
        return "tag", phase, None, "tag:phase"
    if (module := parse_module_label(name)) is not None:
        return "tag", module[0], module[1] or ROOT_MODULE, "tag:module"
    if m := _FSDP.match(name):
        fsdp_phase = Phase.FORWARD if "forward" in m.group(1) else Phase.BACKWARD
        return "tag", fsdp_phase.value, m.group(2) or None, "tag:FSDP"
    if name.startswith(TENSOR_PREFIX):
        return "tag", None, None, "tag:tensor"
    if name.startswith(OPTIMIZER_STEP_PREFIX) or name.startswith(OPTIMIZER_ZERO_GRAD_PREFIX):
        return "annotation", Phase.OPTIMIZER.value, None, "annotation:" + name.split("#")[0]
    if name.startswith("enumerate(DataLoader)#"):
        return "annotation", Phase.OTHER.value, None, "annotation:DataLoader"
    if "(dynamo_timed)" in name:
        return "annotation", Phase.COMPILE.value, None, "annotation:torch.compile"
    if _STEP.match(name):
        return "step", None, None, "annotation:ProfilerStep"
    if name.strip().lower() in _USER_RANGE_PHASES:
        return "annotation", str(_USER_RANGE_PHASES[name.strip().lower()]), None, "annotation:user-range"
    return "user", None, None, ""


def annotation_labels(annotations: pd.DataFrame, times: np.ndarray, kind: str,
                      field: str) -> tuple[np.ndarray, np.ndarray]:
    """For each time: the `field` (phase or module) of the innermost annotation of `kind` around it, and
    that annotation's signal name (object arrays, None where none applies)."""
    rows = [(i, classify(n)) for i, n in enumerate(annotations["name"])]
    keep = [i for i, c in rows if c[0] == kind and (c[1] if field == "phase" else c[2])]
    values = np.full(len(times), None, dtype=object)
    signals = np.full(len(times), None, dtype=object)
    if not keep:
        return values, signals
    chosen = annotations.iloc[keep].reset_index(drop=True)
    facts = [rows[i][1] for i in keep]
    # module ranges of autograd's thread overlap without nesting: the deepest module is the one computing
    depth = np.asarray([0 if f[2] in (None, ROOT_MODULE) else f[2].count(".") + 1 for f in facts]) \
        if field == "module" else None
    hit = innermost(chosen, times, depth)
    inside = hit >= 0
    field_index = 1 if field == "phase" else 2
    lookup = np.asarray([f[field_index] for f in facts], dtype=object)
    sources = np.asarray([f[3] for f in facts], dtype=object)
    values[inside] = lookup[hit[inside]]
    signals[inside] = sources[hit[inside]]
    return values, signals


def metadata_labels(metadata: pd.Categorical, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Phase or module from the allocator's per-allocation user_metadata (torch >= 2.10; analyzer.tag_modules
    writes the same names there as in its annotations): the strongest signal, it cannot fall out of a ring
    buffer of annotations. Each distinct label is read once, then taken by the categorical's codes."""
    index = 1 if field == "phase" else 2
    meanings = [classify(m) if m else None for m in metadata.categories]
    by_label = np.asarray([m[index] if m is not None and m[0] == "tag" else None for m in meanings] + [None], dtype=object)
    values = by_label[np.where(metadata.codes < 0, len(meanings), metadata.codes)]
    # numpy's stubs leave None out of ArrayLike; np.where takes it as an object scalar
    signals = np.where(pd.isna(values), None, "tag:user_metadata").astype(object)  # type: ignore[call-overload]
    return values, signals


def tensor_marks(annotations: pd.DataFrame) -> pd.DataFrame:
    """`tensor::<role>::<fqn>::<0xaddr>` marks (analyzer.tag_modules): columns addr, t_us, role, module."""
    rows = []
    for name, start in zip(annotations["name"], annotations["start_us"], strict=True):
        if (mark := parse_tensor_mark(name)) is not None and not pd.isna(start):
            role, fqn, address = mark
            rows.append((address, float(start), role, fqn or ROOT_MODULE))
    return pd.DataFrame(rows, columns=["addr", "t_us", "role", "module"])


def profiler_steps(annotations: pd.DataFrame, times: np.ndarray) -> np.ndarray:
    """ProfilerStep#N around each time, or -1."""
    steps = annotations[annotations["name"].str.match(_STEP.pattern)]
    if steps.empty:
        return np.full(len(times), -1, dtype=np.int64)
    numbers = steps["name"].str.extract(_STEP.pattern)[0].astype(np.int64).to_numpy()
    hit = innermost(steps.reset_index(drop=True), times)
    return np.where(hit >= 0, numbers[np.maximum(hit, 0)], -1)


def optimizer_step_ends(annotations: pd.DataFrame) -> np.ndarray:
    """End times of Optimizer.step ranges, in order: each one closes a training step."""
    steps = annotations[annotations["name"].str.startswith(OPTIMIZER_STEP_PREFIX)]
    return np.sort(steps["end_us"].dropna().to_numpy(dtype=np.float64))
