"""Parameters, gradients and optimizer state from the structure of a recording, where no stack or tag tells.

Stacks and phases label what the recording saw being made. Model states are often made where it could not see:
before `_record_memory_history` was called, in an optimizer written by hand, by code that swaps `p.data` in
`step()`. What still shows is structure: the parameter set is a fixed multiset of sizes; gradients and an
optimizer's moments repeat it; a state that replaces a parameter inside an optimizer step is the parameter.
Each rule here labels only what the lifetime rules left open (or, for a replacement, what they could not
know), and says so in its label source (`structure:…`, confidence below the stack-based labels).

1. Tensors alive from before the recording to its end (a snapshot's blocks, in a recording that has a history
   to compare them with), that nothing else labels, are model state:
   - when gradients are known otherwise (the recording's backward made them, it stopped inside one, or
     frames show the old ones were made by autograd), the rest are parameters;
   - when it ran a backward (at least BACKWARD_SHARE as many allocations as its forward) that made none,
     that backward accumulated into gradients that already existed: each size's tensors pair up into as many
     parameters as gradients;
   - with no backward but an optimizer state, the run trained before the recording: if the tensors of the
     optimizer state's sizes are as many as the state (Adam-like optimizers keep two moments a parameter), they
     are parameters and their gradients;
   - otherwise (inference, a forward-only recording) they are parameters.
2. A set of long-lived tensors made while loading whose sizes repeat tensors loaded before it, by a user
   object's `__init__` rather than a torch.nn module's, is an optimizer's state made at construction
   (`zeros_like` per parameter).
3. A long-lived tensor made in an optimizer step that replaces a parameter freed in the same step (same
   size) is the parameter (`p.data = new`), not optimizer state, from the old one's free on (the step's
   temporary until then, `category_from_seq`, as in rule 4). The parameter freed may itself be the step
   before's new value, paired first: steps are walked in time order.
4. The dual of 3: a tensor the lifetime rules call a parameter (made while loading and kept) that is made
   within REPLACE_EVENTS allocator events before an optimizer state of its size is freed, and outlives it, is
   that state's new value (`state = f(state)` out of place: DeComFL's estimator updates its K this way between
   two model loads), optimizer state from the old one's free on; until then both are live and the new one is
   the update's temporary (`category_from_seq`), so the state is never counted twice. Likewise a state an
   optimizer step makes and keeps, of a freed state's size, made after it and before its free: its new value
   (`m = beta1 * m + ...` out of place; a compiled step makes every new value before freeing the old ones),
   optimizer state from the old one's free on, the update's temporary until then.
5. What `nn.DataParallel` copies to each GPU for every forward (`replicate`) is the module's parameters
   there, not activations, though it lives only for the step (a frames signal, not a structural one).
6. A profiler trace's memory alive through it (one `end_state` amount its running total implies, no tensors),
   in a trace that trains: the parameters made before it, where what the trainable part adds is under
   FROZEN_LUMP_SHARE of it: the gradients one step makes (the trainable parameters' size) and Adam's two
   moments of them. That is a frozen base (LoRA: no gradients, no optimizer state); a full fine-tune's amount
   holds its optimizer state too, and stays open, as does one where the backward made no gradient (they were
   alive before, accumulated in place: the amount holds them). Adam's moments of the trainable part are inside
   it and counted as parameters (a LoRA's are a few percent of its base). (A trace without a backward names it parameters from its ops:
   `ops:alive-through-inference`.)
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import Category, Phase

PARAMETER, GRADIENT, OPTIMIZER_STATE = Category.PARAMETER.value, Category.GRADIENT.value, Category.OPTIMIZER_STATE.value
BACKWARD_SHARE = 0.1  # a backward makes about as many allocations as its forward: a tenth of them is one
REPLACE_EVENTS = 8  # allocator events from a state's new value to the old one's free, at most (`x = f(x)`)
#: the signals of a state's new value, which holds its category only from the old value's free on
REPLACES_PARAMETER, REPLACES_STATE = "structure:replaces-parameter-in-step", "structure:replaces-optimizer-state"
PAIRED_STATE_SHARE = 0.75  # tensors / optimizer-state tensors of the state's sizes: 1 for params + grads, 0.5 params
FROZEN_LUMP_SHARE = 0.5  # rule 6: the trainable part's gradients and moments under this share of the amount: frozen
ADAM_MOMENTS = 2         # rule 6: what the trainable part keeps beside its gradients, in gradients' sizes
FROZEN_BASE = "structure:frozen-base-before-trace"


def infer_model_states(a: pd.DataFrame, phase: np.ndarray, category: np.ndarray, source: np.ndarray,
                       category_from: np.ndarray, replicates: np.ndarray, init_site: np.ndarray,
                       blocks_before_recording: bool) -> None:
    """Fill or correct `category` and its `source` (arrays over the rows of `a`) in place, and `category_from`
    (the event from which a row's category holds; NaN: its whole life); `phase` is read, and
    what each row's stack says (`analyzer.attribute.frames.StackFacts`): made by DataParallel's replicate, made
    by the user `__init__` at `init_site`. `blocks_before_recording`: the rows not made in the recording are the
    tensors themselves (a snapshot's blocks), not amounts a reader reconstructed from running totals (a
    profiler trace)."""
    sizes = a["requested_bytes"].to_numpy(dtype=np.int64)
    t_alloc = a["t_alloc_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    t_free = a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.inf)
    category[replicates], source[replicates] = PARAMETER, "frames:data-parallel-replica"
    _construction_state(sizes, t_alloc, phase, category, source, init_site)
    _replaced_parameters(a, sizes, t_alloc, t_free, phase, category, source, category_from)
    _replaced_states(a, sizes, category, source, category_from)
    _states_replacing_states(a, sizes, phase, category, source, category_from)
    if blocks_before_recording:
        _persistent_before_recording(a, sizes, phase, category, source)


def frozen_base_before_trace(a: pd.DataFrame, phase: np.ndarray, step: np.ndarray, category: np.ndarray,
                             source: np.ndarray, share: float = FROZEN_LUMP_SHARE) -> None:
    """Rule 6: a training profiler trace's memory alive through it is the parameters of a frozen base when the
    gradients one step makes, with Adam's moments of them, are under `share` of it."""
    origin = a["origin"].astype(str).to_numpy()
    lump = (origin == "end_state") & pd.isna(category)
    made = origin == "trace"
    if not lump.any() or not ((phase == Phase.BACKWARD) & made).any():
        return
    sizes = a["allocated_bytes"].to_numpy(dtype=np.int64)
    gradients = (category == GRADIENT) & made
    per_step = pd.Series(sizes[gradients]).groupby(step[gradients]).sum()
    trainable = int(per_step.max()) if len(per_step) else 0   # none made: they were there before (in place)
    if 0 < (1 + ADAM_MOMENTS) * trainable < share * int(sizes[lump].sum()):
        _label(np.flatnonzero(lump), PARAMETER, FROZEN_BASE, category, source)
        phase[lump] = Phase.LOAD.value


def _persistent_before_recording(a: pd.DataFrame, sizes: np.ndarray, phase: np.ndarray, category: np.ndarray,
                                 source: np.ndarray) -> None:
    origin = a["origin"].astype(str).to_numpy()
    alive_at_end = a["seq_free"].isna().to_numpy() & a["t_free_us"].isna().to_numpy()
    open_ = (origin != "trace") & alive_at_end & pd.isna(category)
    if not open_.any() or not (origin == "trace").any():  # no history: nothing to tell them apart by
        return
    in_the_making = (phase == Phase.BACKWARD) & alive_at_end & (origin == "trace")  # stopped inside a backward
    made_gradients = bool(((category == GRADIENT) | in_the_making).any())
    made = origin == "trace"
    ran_backward = bool(((phase == Phase.BACKWARD) & made).sum() >= BACKWARD_SHARE * ((phase == Phase.FORWARD) & made).sum()
                        and ((phase == Phase.BACKWARD) & made).any())
    optimizer_sizes = sizes[category == OPTIMIZER_STATE]
    if made_gradients:
        paired, why = False, "structure:persistent-before-recording+gradients-known"
    elif ran_backward:
        paired, why = True, "structure:size-pairs+backward-made-no-gradient"
    elif len(optimizer_sizes):
        state = pd.Series(optimizer_sizes).value_counts()
        candidates = pd.Series(sizes[open_]).value_counts().reindex(state.index, fill_value=0)
        paired = bool(candidates.sum() >= PAIRED_STATE_SHARE * state.sum())
        why = "structure:size-pairs+as-many-as-optimizer-state" if paired else \
            "structure:persistent-before-recording+half-the-optimizer-state"
    else:
        paired, why = False, "structure:persistent-before-recording"
    rows = np.flatnonzero(open_)
    if not paired:
        _label(rows, PARAMETER, why, category, source)
        return
    addresses = a["addr"].to_numpy(dtype=np.int64)
    for size in np.unique(sizes[rows]):
        group = rows[sizes[rows] == size]
        group = group[np.argsort(addresses[group], kind="stable")]
        half = len(group) // 2  # an odd one out is not a pair: it stays unattributed
        _label(group[:half], PARAMETER, why, category, source)
        _label(group[half:2 * half], GRADIENT, why, category, source)


def _construction_state(sizes: np.ndarray, t_alloc: np.ndarray, phase: np.ndarray, category: np.ndarray,
                        source: np.ndarray, init_site: np.ndarray) -> None:
    loading = np.flatnonzero((phase == Phase.LOAD) & ~np.isnan(t_alloc))
    loaded = loading[category[loading] == PARAMETER]
    if len(loaded) < 2:
        return
    by_site: dict[str, list[int]] = defaultdict(list)
    for row in loaded:
        if init_site[row] is not None:
            by_site[init_site[row]].append(row)
    for rows in by_site.values():
        group = np.asarray(rows)
        before = loading[(t_alloc[loading] < t_alloc[group].min()) & ~np.isin(loading, group)]
        if len(group) >= 2 and _repeats(sizes[group], sizes[before]):
            category[group] = OPTIMIZER_STATE
            source[group] = "structure:state-per-parameter-at-construction"


def _repeats(sizes: np.ndarray, earlier: np.ndarray) -> bool:
    """Every size of `sizes` occurs among `earlier` at least as often: a copy of (part of) that set."""
    have = pd.Series(earlier).value_counts()
    want = pd.Series(sizes).value_counts()
    return bool((want <= have.reindex(want.index, fill_value=0)).all())


def _replaced_parameters(a: pd.DataFrame, sizes: np.ndarray, t_alloc: np.ndarray, t_free: np.ndarray,
                         phase: np.ndarray, category: np.ndarray, source: np.ndarray, category_from: np.ndarray) -> None:
    """Walk each optimizer step in time order: a parameter freed in it is replaced by the latest tensor of its
    size the step made and kept (`p.data = new` makes the new tensor, then drops the old one): the parameter
    from that free on, the step's temporary before it."""
    made = np.flatnonzero((phase == Phase.OPTIMIZER) & (category == OPTIMIZER_STATE) & ~np.isnan(t_alloc))
    if not len(made):
        return
    seq_free = a["seq_free"].to_numpy(dtype=np.float64, na_value=np.nan)
    made = made[np.argsort(t_alloc[made], kind="stable")]
    step = _optimizer_steps(t_alloc[made])
    window = pd.DataFrame({"step": step, "t": t_alloc[made]}).groupby("step")["t"].agg(["min", "max"])
    gap = _step_gap(t_alloc[made])
    # a parameter freed inside (or just after) an optimizer step; a tensor an earlier step made and kept may be
    # one too (the replacement of the step before: paired below before its own free comes up in time order)
    may_be_parameter = category == PARAMETER
    may_be_parameter[made] = True
    freed = np.flatnonzero(may_be_parameter & np.isfinite(t_free))
    events = [(t_alloc[r], 1, int(r), int(s)) for r, s in zip(made, step, strict=True)]
    for r in freed:
        inside = np.flatnonzero((window["min"].to_numpy() <= t_free[r]) & (t_free[r] <= window["max"].to_numpy() + gap))
        if len(inside):
            events.append((t_free[r], 0, int(r), int(window.index[inside[0]])))
    unpaired: dict[tuple[int, int], list[int]] = defaultdict(list)  # (step, size) -> kept tensors made, in order
    for _, is_new, row, s in sorted(events):
        if is_new:
            unpaired[(s, int(sizes[row]))].append(row)
        elif category[row] == PARAMETER and unpaired[(s, int(sizes[row]))]:
            new = unpaired[(s, int(sizes[row]))].pop()
            category[new] = PARAMETER
            source[new] = REPLACES_PARAMETER
            category_from[new] = seq_free[row]


def _replaced_states(a: pd.DataFrame, sizes: np.ndarray, category: np.ndarray, source: np.ndarray,
                     category_from: np.ndarray) -> None:
    """Rule 4: each optimizer state freed in the recording is replaced by the latest kept tensor of its size made
    just before its free (after the state itself) that the lifetime rules took for a parameter: state from that
    free on."""
    seq_alloc = a["seq_alloc"].to_numpy(dtype=np.float64, na_value=np.nan)
    seq_free = a["seq_free"].to_numpy(dtype=np.float64, na_value=np.inf)
    new = np.flatnonzero((category == PARAMETER) & np.isfinite(seq_alloc))
    new = new[[str(source[i]).startswith("lifetime:") for i in new]]
    old = np.flatnonzero((category == OPTIMIZER_STATE) & np.isfinite(seq_free))
    if not len(new) or not len(old):
        return
    candidates = _made_in_order(new, sizes, seq_alloc)
    for r in old[np.argsort(seq_free[old], kind="stable")]:
        rows = candidates.get(int(sizes[r]))
        if rows is None:
            continue
        latest = int(np.searchsorted(seq_alloc[rows], seq_free[r], side="left")) - 1   # made before the free
        if latest < 0:
            continue
        n = rows[latest]
        if (seq_alloc[n] > seq_alloc[r] and seq_free[r] - seq_alloc[n] <= REPLACE_EVENTS and seq_free[n] > seq_free[r]
                and category[n] == PARAMETER):
            _label(np.asarray([n]), OPTIMIZER_STATE, REPLACES_STATE, category, source)
            category_from[n] = seq_free[r]


def _states_replacing_states(a: pd.DataFrame, sizes: np.ndarray, phase: np.ndarray, category: np.ndarray,
                             source: np.ndarray, category_from: np.ndarray) -> None:
    """Rule 4, state for state: each optimizer state freed in the recording is replaced by the earliest unpaired
    state of its size made in the same optimizer step (no allocation of another phase between them) before its
    free, and kept past it (values made in order, freed in order): optimizer state from that free on.

    The freed states are taken in the order freed, so a candidate that is freed first, or made before another
    phase's allocation that comes before the free, fails every later one too: it is dropped when seen, and each
    candidate is looked at once (`_Unpaired`), not once per freed state of its size."""
    seq_alloc = a["seq_alloc"].to_numpy(dtype=np.float64, na_value=np.nan)
    seq_free = a["seq_free"].to_numpy(dtype=np.float64, na_value=np.inf)
    state = (category == OPTIMIZER_STATE) & pd.isna(category_from)
    new = np.flatnonzero(state & np.isfinite(seq_alloc) & (phase == Phase.OPTIMIZER))
    old = np.flatnonzero(state & np.isfinite(seq_free))
    if not len(new) or not len(old):
        return
    others = np.sort(seq_alloc[np.isfinite(seq_alloc) & (phase != Phase.OPTIMIZER)])
    made_in_step = np.searchsorted(others, seq_alloc)    # the other phases' allocations made before each row
    unpaired = {size: _Unpaired(rows, seq_alloc) for size, rows in _made_in_order(new, sizes, seq_alloc).items()}
    for r in old[np.argsort(seq_free[old], kind="stable")]:
        candidates = unpaired.get(int(sizes[r]))
        if candidates is None:
            continue
        step_of_free = np.searchsorted(others, seq_free[r])
        for at, n in candidates.made_between(seq_alloc[r], seq_free[r]):
            candidates.drop(at)     # paired now; or freed first, or another step's: no later free pairs it either
            if seq_free[n] > seq_free[r] and made_in_step[n] == step_of_free:
                source[n], category_from[n] = REPLACES_STATE, seq_free[r]
                break


def _made_in_order(rows: np.ndarray, sizes: np.ndarray, seq_alloc: np.ndarray) -> dict[int, np.ndarray]:
    """The rows of each size, in the order they were made: where a freed tensor's new value is looked for."""
    return {int(size): group[np.argsort(seq_alloc[group], kind="stable")]
            for size, group in pd.Series(rows).groupby(sizes[rows]).agg(np.asarray).items()}


class _Unpaired:
    """Rows in the order they were made, each paired at most once: `made_between` yields (position, row) of those
    not dropped made strictly between two positions, earliest first; dropped ones are skipped by a pointer to the
    next row not dropped (path-halved), so that each row is looked at about once however many look."""

    def __init__(self, rows: np.ndarray, seq_alloc: np.ndarray) -> None:
        self.rows = rows
        self.made = seq_alloc[rows]
        self.next = np.arange(len(rows) + 1)     # next[i]: i, or a later position; len(rows): none left

    def _kept_from(self, i: int) -> int:
        while self.next[i] != i:
            self.next[i] = self.next[self.next[i]]
            i = int(self.next[i])
        return i

    def made_between(self, low: float, high: float) -> Iterator[tuple[int, int]]:
        i = self._kept_from(int(np.searchsorted(self.made, low, side="right")))
        while i < len(self.rows) and self.made[i] < high:
            yield i, int(self.rows[i])
            i = self._kept_from(i + 1)

    def drop(self, position: int) -> None:
        self.next[position] = position + 1


def _step_gap(times: np.ndarray) -> float:
    """Ten times the median gap between optimizer allocations: a longer gap starts a new optimizer step."""
    gaps = np.diff(times)
    return 10 * float(np.median(gaps)) if len(gaps) else float("inf")


def _optimizer_steps(times: np.ndarray) -> np.ndarray:
    """The optimizer step (0, 1, ...) of each time-sorted optimizer allocation."""
    return np.concatenate([[0], np.cumsum(np.diff(times) > _step_gap(times))]).astype(np.int64)


def _label(rows: np.ndarray, value: str, why: str, category: np.ndarray, source: np.ndarray) -> None:
    category[rows] = value
    source[rows] = why
