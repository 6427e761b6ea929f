"""Score module call paths against a truth that names modules by FQN: the share of the peak's bytes whose
module *class* is right (the innermost level of a call path, `GPT › Block[3] › MLP` → `MLP`, against the class
of the truth's `layers.3.mlp`). Without tags the analysis reads classes from stacks, not FQNs, so an FQN
comparison would score a right answer as wrong.

    module_class_agreement(snapshot, class_of)   # class_of: FQN -> class name ('' is the root module)
    simulator_classes()                          # that map for the simulator's GPT (needs torch)

And, for recordings with no truth, how much of the peak has no module at all:

    unattributed_module_share(trace)             # of the bytes at every active device's peak, summed
    module_share(trace, label)                   # the same for any module label (`(no module)`)
    whole_model_share(trace)                     # the same for the bytes only the recording's one model names
    has_python_frames(trace)                     # whether its stacks hold any Python frame
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analyzer.attribute.modules import BUILT, MOVED, SOLE_MODEL
from analyzer.core.timeline import find_peak
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, ROOT_MODULE, UNATTRIBUTED, names_module
from analyzer.errors import UnsupportedFormat
from analyzer.evaluate.accuracy import without_tags
from analyzer.ingest import load

_LEVEL = re.compile(r"^([A-Za-z_]\w*)(\[\d+\])?$")
_FQN = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


def label_class(label: str, class_of: Callable[[str], str | None]) -> str | None:
    """The module class a label names: a call path's innermost level (None when that level's class was not
    read), an FQN's class, the root module's; None for unattributed."""
    if not names_module(label):
        return None
    if label == ROOT_MODULE:
        return class_of("")
    if MODULE_PATH_SEPARATOR in label or "[" in label:
        innermost = _LEVEL.match(label.split(MODULE_PATH_SEPARATOR)[-1])
        return innermost.group(1) if innermost else None
    if _FQN.match(label):
        return class_of(label) or label   # a lone class name (a one-level call path) is its own class
    return None


def module_class_agreement(snapshot: Path, class_of: Callable[[str], str | None], tags: bool = False,
                           source_roots: Sequence[str] = ()) -> dict[str, float]:
    """Share of the peak's bytes (of those the truth gives a module) whose module class is the truth's; the
    truth's root-or-no-module ('') also agrees with unattributed; and the share labelled at all."""
    from analyzer.attribute import attribute

    truth = json.loads(snapshot.with_name(snapshot.stem + ".truth.json").read_text())
    trace = load(snapshot)
    if not isinstance(trace, MemoryTrace):
        raise UnsupportedFormat(snapshot, "a set of ranks: agreement is scored for one recording", "pass one rank's file")
    trace = attribute(trace if tags else without_tags(trace), source_roots=source_roots)
    live = find_peak(trace, truth["device"]).live
    labels = truth["allocations"]
    right = total = attributed = 0.0
    for seq, label, size in zip(live["seq_alloc"].astype("float64"), live["module"].astype(str),
                                live["allocated_bytes"].to_numpy(dtype=np.float64), strict=True):
        fqn = None if np.isnan(seq) else labels.get(str(int(seq)), {}).get("module")
        if fqn is None:
            continue
        total += size
        ours = label_class(label, class_of)
        attributed += size if label != UNATTRIBUTED else 0.0
        if ours == class_of(fqn) or (fqn == "" and ours is None):
            right += size
    return {"module_class": float(right / total) if total else 1.0,
            "attributed": float(attributed / total) if total else 1.0}


def simulator_classes() -> Callable[[str], str | None]:
    """FQN -> class name of the simulator's GPT (any number of layers up to 64; torch needed, on the meta device)."""
    import torch

    from analyzer.simulate.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=8, d_model=8, layers=64, heads=1, max_seq=8))
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    return classes.get


def has_python_frames(trace: MemoryTrace) -> bool:
    from analyzer.core.stacks import is_python_frame

    return any(is_python_frame(f) for frames in trace.stacks["frames"] for f in frames)


def unattributed_module_share(trace: MemoryTrace) -> float | None:
    """Bytes whose module is unattributed over all bytes, at each active device's peak (summed over devices) of
    an attributed trace; None when no device holds memory at its peak."""
    return module_share(trace, UNATTRIBUTED)


def module_share(trace: MemoryTrace, label: str) -> float | None:
    """Bytes whose module is `label` over all bytes, as unattributed_module_share counts them."""
    return _peak_share(trace, lambda live: live["module"].astype(str) == label)


#: the module signals that name a whole model, no module in it: the model a line moved or built, the recording's one
#: model; and the prefix of those a gradient or optimizer state takes from its parameter
_WHOLE_MODEL = tuple(f"module={signal}" for signal in (MOVED, BUILT, SOLE_MODEL))
_BORROWED = "module=size-match:"


def whole_model_share(trace: MemoryTrace) -> float | None:
    """Bytes labelled by a whole model and no module in it (parameters a line moved or built, or no frame names
    in a recording of one model, and the gradients and optimizer states that took their label by size) over all
    bytes, as unattributed_module_share counts them: a module, but the coarsest."""
    def coarse(live: pd.DataFrame) -> pd.Series:
        signal = live["label_source"].astype(str)
        whole = signal.str.endswith(_WHOLE_MODEL)
        models = set(live.loc[whole, "module"].astype(str))
        return live["module"].astype(str).isin(models) & (whole | signal.str.contains(_BORROWED))
    return _peak_share(trace, coarse)


def _peak_share(trace: MemoryTrace, selects: Callable[[pd.DataFrame], pd.Series]) -> float | None:
    """Bytes of the rows `selects` picks over all bytes, at each active device's peak (summed over devices)."""
    from analyzer.pipeline import active_devices

    matched = total = 0
    for device in active_devices(trace):
        live = find_peak(trace, device).live
        total += int(live["allocated_bytes"].sum())
        matched += int(live.loc[selects(live), "allocated_bytes"].sum())
    return matched / total if total else None
