"""What an allocation is, from the phase that made it and how long it lived.

- load, alive past loading                    -> parameter (parameters and buffers look alike here)
- forward, freed after its step's backward began -> activation (kept for backward); else -> temporary
- backward, alive past its step's backward     -> gradient; freed within backward -> temporary
- optimizer, alive past its optimizer step     -> optimizer_state; freed within it -> temporary
- made before a step's forward and used by it  -> input
- checkpoint_save / compile / other            -> other
- allocated before the recording started         -> the long-lived category of its phase (lower confidence)
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import OPTIMIZER_STEP_PREFIX, Category, Phase

_LONG_LIVED: dict[str, str] = {Phase.LOAD: Category.PARAMETER.value, Phase.FORWARD: Category.ACTIVATION.value,
                               Phase.BACKWARD: Category.GRADIENT.value, Phase.OPTIMIZER: Category.OPTIMIZER_STATE.value}


def _per_step(step: np.ndarray, mask: np.ndarray, values: np.ndarray, reducer) -> dict[int, float]:
    out: dict[int, float] = {}
    if mask.any():
        frame = pd.DataFrame({"step": step[mask], "v": values[mask]})
        out = frame.groupby("step")["v"].agg(reducer).to_dict()
    return out


def categorise(a: pd.DataFrame, phase: np.ndarray, step: np.ndarray,
               annotations: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    t_alloc = a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    t_free = a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.inf)  # alive at the end: forever
    timed = ~np.isnan(t_alloc)
    codes, phases = pd.factorize(phase)   # each phase compared once per distinct value, not once per row (None: -1)

    def made_in(*names: str | None) -> np.ndarray:
        return np.isin(codes, [k for k, p in enumerate(phases) if p in names] + ([-1] if None in names else []))

    forward, backward, optimizer = made_in(Phase.FORWARD), made_in(Phase.BACKWARD), made_in(Phase.OPTIMIZER)
    forward_end = _per_step(step, forward, t_alloc, "max")
    for s, start in _per_step(step, backward, t_alloc, "min").items():
        forward_end[s] = start  # the forward pass ends where backward begins (the loss belongs to forward)
    forward_start = _per_step(step, forward, t_alloc, "min")
    backward_end = _per_step(step, optimizer, t_alloc, "min")
    optimizer_end = _per_step(step, optimizer, t_alloc, "max")
    for s, end in _optimizer_ranges(annotations, step, t_alloc).items():
        optimizer_end[s] = max(optimizer_end.get(s, -np.inf), end)
    next_start = _per_step(step, timed, t_alloc, "min")

    def lookup(table: dict[int, float], default: float, shift: int = 0) -> np.ndarray:
        """table[step + shift] for every allocation, through an array indexed by step (steps are small)."""
        top = int(step.max(initial=0)) + shift + 2
        values = np.full(top + 1, default, dtype=np.float64)
        for key, value in table.items():
            if 0 <= key + 1 <= top:
                values[key + 1] = value
        return values[np.clip(step + shift + 1, 0, top)]

    f_end, f_start = lookup(forward_end, np.inf), lookup(forward_start, np.inf)
    b_end = np.minimum(lookup(backward_end, np.inf), lookup(next_start, np.inf, shift=1))
    o_end = lookup(optimizer_end, np.inf)
    next_forward = _next_forward(t_alloc, forward, t_free)
    long_lived = np.asarray([_LONG_LIVED.get(p) for p in phases] + [None], dtype=object)[codes]   # None: code -1
    temporary = Category.TEMPORARY.value
    rules = [
        # allocated before the recording: only the phase is known, and the allocation outlived it
        (~timed & made_in(*_LONG_LIVED), long_lived, "lifetime:allocated-before-recording"),
        (made_in(Phase.LOAD), np.where(t_free > next_forward, _LONG_LIVED[Phase.LOAD], temporary), "lifetime:load"),
        (forward, np.where(t_free > f_end, _LONG_LIVED[Phase.FORWARD], temporary), "lifetime:forward"),
        (backward, np.where(t_free > b_end, _LONG_LIVED[Phase.BACKWARD], temporary), "lifetime:backward"),
        (optimizer, np.where(t_free > o_end, _LONG_LIVED[Phase.OPTIMIZER], temporary),
         "lifetime:optimizer"),
        (made_in(None, Phase.OTHER) & timed & (t_alloc < f_start) & (t_free > f_start), Category.INPUT.value,
         "lifetime:input"),
        (made_in(Phase.CHECKPOINT_SAVE, Phase.COMPILE, Phase.OTHER), Category.OTHER.value, "phase"),
    ]
    category = np.full(len(a), None, dtype=object)
    source = np.full(len(a), None, dtype=object)
    labelled = np.zeros(len(a), dtype=bool)   # every rule's value is a category: a row it sets is labelled
    for mask, value, signal in rules:
        free = mask & ~labelled
        category[free] = value[free] if isinstance(value, np.ndarray) else value
        source[free] = signal
        labelled |= free
    return category, source


RECOMPUTE_SIGNAL = "frames:activation-checkpoint-recompute"


def recomputed_activations(phase_source: np.ndarray, t_alloc: np.ndarray, t_free: np.ndarray) -> np.ndarray:
    """Rows an activation-checkpointing recomputation made that outlive the recomputation (each run of
    recomputing allocations, in time): the checkpointed segment's activations, made again for its backward;
    what the recomputation frees before it ends is its temporaries."""
    recomputing = np.asarray(phase_source == RECOMPUTE_SIGNAL, dtype=bool)
    out = np.zeros(len(phase_source), dtype=bool)
    if not recomputing.any():
        return out
    order = np.argsort(np.where(np.isnan(t_alloc), np.inf, t_alloc), kind="stable")
    order = order[~np.isnan(t_alloc[order])]
    flags = recomputing[order]
    run = np.cumsum(np.r_[True, flags[1:] != flags[:-1]])
    ends = pd.Series(t_alloc[order]).groupby(run).transform("max").to_numpy()
    out[order] = flags & (t_free[order] > ends)
    return out


def _next_forward(t_alloc: np.ndarray, forward: np.ndarray, t_free: np.ndarray) -> np.ndarray:
    """For each allocation, the start of the first forward work (the `forward` rows) after it: a tensor loaded for
    the model outlives it; one made and dropped while loading (or reloading, between forwards) does not. With no
    forward after it, only a tensor alive at the end counts as loaded for the model."""
    starts = np.append(np.sort(t_alloc[forward & ~np.isnan(t_alloc)]), np.inf)
    following = starts[np.searchsorted(starts, np.nan_to_num(t_alloc, nan=-np.inf), side="right")]
    return np.where(np.isinf(following) & np.isinf(t_free), -np.inf, following)


def _optimizer_ranges(annotations: pd.DataFrame, step: np.ndarray, t_alloc: np.ndarray) -> dict[int, float]:
    """End of the Optimizer.step range of each step (the step whose allocations fall inside it)."""
    ranges = annotations[annotations["name"].str.startswith(OPTIMIZER_STEP_PREFIX)]
    out: dict[int, float] = {}
    for start, end in zip(ranges["start_us"], ranges["end_us"], strict=True):
        if pd.isna(start) or pd.isna(end):
            continue
        inside = (t_alloc >= float(start)) & (t_alloc <= float(end))
        if inside.any():
            out[int(np.max(step[inside]))] = float(end)
    return out
