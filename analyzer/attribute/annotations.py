"""What each annotation name means: a phase, a module, a step, or nothing we know."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.attribute.ranges import innermost

_FSDP = re.compile(r"^FSDP::(pre_forward|post_forward|pre_backward|post_backward|forward|backward)\s*\((.*)\)\s*$")
_MODULE_TAG = re.compile(r"^module::(forward|backward)::(.*)$")
ROOT_MODULE = "(root module)"  # the root module's FQN is the empty string
_PHASE_TAG = re.compile(r"^phase::(\w+)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_PHASE_WORDS = {"forward": "forward", "fwd": "forward", "backward": "backward", "bwd": "backward",
                "optimizer": "optimizer", "optimizer_step": "optimizer", "optim": "optimizer",
                "checkpoint": "checkpoint_save", "save": "checkpoint_save", "save_checkpoint": "checkpoint_save",
                "load": "load", "load_model": "load"}


def classify(name: str) -> tuple[str, str | None, str | None, str]:
    """(kind, phase, module, signal) for one annotation name. kind: tag | annotation | step | user."""
    if m := _PHASE_TAG.match(name):
        return "tag", m.group(1), None, "tag:phase"
    if m := _MODULE_TAG.match(name):
        return "tag", m.group(1), m.group(2) or ROOT_MODULE, "tag:module"
    if m := _FSDP.match(name):
        return "tag", "forward" if "forward" in m.group(1) else "backward", m.group(2) or None, "tag:FSDP"
    if name.startswith("tensor::"):
        return "tag", None, None, "tag:tensor"
    if name.startswith("Optimizer.step#") or name.startswith("Optimizer.zero_grad#"):
        return "annotation", "optimizer", None, "annotation:" + name.split("#")[0]
    if name.startswith("enumerate(DataLoader)#"):
        return "annotation", "other", None, "annotation:DataLoader"
    if "(dynamo_timed)" in name:
        return "annotation", "compile", None, "annotation:torch.compile"
    if _STEP.match(name):
        return "step", None, None, "annotation:ProfilerStep"
    if name.strip().lower() in _PHASE_WORDS:
        return "annotation", _PHASE_WORDS[name.strip().lower()], None, "annotation:user-range"
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
    signals = np.where(pd.isna(values), None, "tag:user_metadata").astype(object)
    return values, signals


_TENSOR_MARK = re.compile(r"^tensor::(parameter|buffer|gradient|optimizer_state)::(.*)::(0x[0-9a-fA-F]+)$")


def tensor_marks(annotations: pd.DataFrame) -> pd.DataFrame:
    """`tensor::<role>::<fqn>::<0xaddr>` marks (analyzer.tag_modules): columns addr, t_us, role, module."""
    rows = []
    for name, start in zip(annotations["name"], annotations["start_us"]):
        if name.startswith("tensor::") and (m := _TENSOR_MARK.match(name)) and not pd.isna(start):
            rows.append((int(m.group(3), 16), float(start), m.group(1), m.group(2) or ROOT_MODULE))
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
    steps = annotations[annotations["name"].str.startswith("Optimizer.step#")]
    return np.sort(steps["end_us"].dropna().to_numpy(dtype=np.float64))
