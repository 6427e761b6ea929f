"""Which module an allocation belongs to. Strongest first (`label_source` names the signal that decided):

1. tags: the allocator's `user_metadata`, then `module::` ranges (`tag:module`); the caller adds `tensor::` marks;
2. frames: the module call path of the allocation's stack (analyzer.attribute.module_paths), outermost first,
   `GPT › Block › MLP › Linear` (`frames:call-path`). Where one parent's call runs several calls of one
   child from the same line (a loop over 24 decoder layers, whose stacks are identical), each call is numbered
   by its order within the parent's call, `GPT › Block[3] › MLP` (`frames:call-path+order`, a lower
   confidence: the order, not the recording, tells them apart). A new call of a level begins where its
   frame's line goes back (or its parent's moves on); allocations with no recorded time are not numbered;
3. parameters: a gradient or optimizer state takes the module of the parameters of its size where they all
   have one (`size-match:parameter`), or, where no parameter has its size, of the inputs kept to the end that
   have it (an optimised input, `Adam([x_prime])`: its moments and gradient are as much outside every module as
   it is); else that of the parameter whose place in the order of the parameters it
   has (`size-match:parameter-order`): an optimizer creates its state parameter by parameter in the order of
   `model.parameters()`, the order they were made in (as many tensors per parameter as the state has over
   the parameters, `ORDER_STATES` at most, each parameter's together or one pass over the parameters per
   tensor), and the parameters a step makes to replace them (`p.data = new`) in that order too; a backward
   makes the gradients in about the reverse order. Only where the sizes follow that order (`ORDER_SHARE` of the
   state or of a step's gradients find their parameter within `ORDER_WINDOW` of the last one matched); else
   the call path the parameters of its size share but for the order numbers (`size-match:parameter-class`:
   some decoder layer's MLP);
   A parameter that a `Module.to` (`.cuda()`, `.half()` ...) made is the model's that line moved
   (`frames:module.to`, `client.py:176 reset_model (Module.to)`): which of its modules, the copy does not say;
   one made by a constructor whose class no level names (a file of another version, FlexGen's hand-written
   layers) is the model's that line built (`frames:model-construction`, `flex_opt.py:1231 run_flexgen (__init__)`);
   A compiled graph's allocation that no frame outside it names (Dynamo runs the graph in place of the
   compiled module's `forward` frame, so no level is left) takes the recording's root module where every call
   path starts with the same class: `torch.compile(model)` compiles that model (`structure:compiled-root`);
   a snapshot's parameter with no Python frames (made before the recording began, or by a thread that records
   none) takes the recording's one model where every call path of its device starts with the same root and no
   parameter was moved or built by a line the frames name (`structure:sole-model`): the model the recording
   ran, by its class where it is read (`BasicsTransformerLM`), else by its file (`…/cs336_basics/model.py
   (model)`); which of its modules, nothing says. Two roots (a teacher beside a student, a layer called outside
   the model) and the parameter stays unattributed;
4. no module: an activation, temporary, input or other tensor (never a model state, whose module is its
   parameter's, not the code's that made it) whose Python frames reach the program's top level without
   running any module (`analyzer.attribute.frames.ran_no_module`: a loss or a batch made by the training loop,
   an optimizer's temporaries, a script's own tensors) is made outside every module: `(no module)`
   (`frames:no-module`), said apart from `unattributed`, which is not knowing. Not in a backward pass, which
   runs the modules' backward whatever the frames show (only the mirror below gives a backward tensor of a
   loss computed outside the modules that label);
5. mirror: an allocation of the backward pass (not a parameter's gradient) that no frame labels (autograd's
   thread records no Python frames) is taken for the gradient of a forward tensor when one of its size is among
   the next `MIRROR_RELEASES` forward tensors released after it (autograd releases the tensors a node saved
   once the node has made its gradients): it takes that tensor's module (`size-match:forward-release`).
Anything else stays unattributed: allocations with no Python frames take nothing from frames.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import annotation_labels
from analyzer.attribute.module_paths import SEPARATOR, CallPath, Level, path_label
from analyzer.core.vocabulary import NO_MODULE, Category, Phase

CALL_PATH, ORDERED = "frames:call-path", "frames:call-path+order"
COMPILED_ROOT, SOLE_MODEL = "structure:compiled-root", "structure:sole-model"
OUTSIDE = "frames:no-module"
MOVED, BUILT = "frames:module.to", "frames:model-construction"
#: the categories a stack outside every module says the module of (a model state's is its parameter's)
MADE_BY_CODE = (Category.INPUT, Category.ACTIVATION, Category.TEMPORARY, Category.OTHER)
MIRROR_RELEASES = 8    # forward tensors released after a backward allocation that may be the one it mirrors
ORDER_WINDOW = 16      # parameters searched on from the last one matched
ORDER_STATES = 4       # optimizer states per parameter at most (Adam keeps two, some optimizers more)
ORDER_SHARE = 0.9      # of the tensors that must find their parameter for the order to be taken


def assign_modules(a: pd.DataFrame, annotations: pd.DataFrame, times: np.ndarray, stacks: np.ndarray,
                   paths: Sequence[CallPath], category: np.ndarray, from_metadata: tuple[np.ndarray, np.ndarray],
                   step: np.ndarray | None = None, phase: np.ndarray | None = None,
                   compiled: np.ndarray | None = None, outside: np.ndarray | None = None,
                   moved: np.ndarray | None = None, built: np.ndarray | None = None,
                   framed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(module, label source) of every row of `a`; `stacks` is each row's stack id (-1: none) into `paths`;
    `compiled` marks the rows whose stack runs a compiled graph, `outside` those whose stack ran no module,
    `moved` and `built` name the model a `Module.to` of the row's stack moved, a constructor built (None: none),
    `framed` marks the rows whose stack has Python frames (None where the rows from before the recording are not
    tensors but amounts a reader reconstructed, a profiler trace's: no one model is given to them)."""
    module, source = from_metadata
    module, source = module.copy(), source.copy()
    tagged, tag_source = annotation_labels(annotations, times, "tag", "module")
    unset = pd.isna(module)
    module[unset], source[unset] = tagged[unset], tag_source[unset]
    steps = step if step is not None else np.zeros(len(a), dtype=np.int64)
    labels, numbered = call_path_labels(times, stacks, paths, steps)
    from_frames = pd.isna(module) & ~pd.isna(labels)
    module[from_frames] = labels[from_frames]
    source[from_frames] = np.where(numbered[from_frames], ORDERED, CALL_PATH)
    root = _root_level(paths, stacks)
    if compiled is not None and root is not None and root.resolved:
        graph = compiled & pd.isna(module)
        module[graph], source[graph] = root.label, COMPILED_ROOT
    is_param = category == Category.PARAMETER
    for site, signal in ((moved, MOVED), (built, BUILT)):
        if site is not None:
            named = ~pd.isna(site) & pd.isna(module) & is_param
            module[named], source[named] = site[named], signal
    if framed is not None and root is not None and not np.isin(source[is_param], (MOVED, BUILT)).any():
        unnamed = is_param & pd.isna(module) & ~framed
        module[unnamed] = root.label if root.resolved else f"{root.identity} (model)"
        source[unnamed] = SOLE_MODEL
    if outside is not None:   # a backward is some module's even where the frames (a hand-made file's) miss it
        by_code = outside & pd.isna(module) & np.isin(category, MADE_BY_CODE)
        if phase is not None:
            by_code &= phase != Phase.BACKWARD
        module[by_code], source[by_code] = NO_MODULE, OUTSIDE
    _match_parameters(a, module, source, category, exact=True)
    _match_parameter_order(a, times, steps, module, source, category, phase)
    _match_parameters(a, module, source, category, exact=False)
    if phase is not None:
        _mirror_forward(a, times, steps, phase, module, source, category)
    return module, source


def _root_level(paths: Sequence[CallPath], stacks: np.ndarray) -> Level | None:
    """The outermost level every call path of the rows' stacks starts with (its line aside), if there is one:
    the recording ran one model. A class not read here is known by its file only (Level.identity)."""
    used = [paths[s] for s in np.unique(stacks[stacks >= 0]).tolist() if paths[s]]
    roots = {(p[0].identity, p[0].resolved) for p in used}
    return used[0][0] if len(roots) == 1 else None


@dataclass
class _Call:
    """One call of a level, open while the allocations in time order stay inside it."""

    identity: str
    entered_at: int | None           # the parent's line that called it
    line: int                        # its frame's line at the latest allocation
    index: int                       # its order among the parent call's calls of the same child
    position: tuple                  # (identity, entered_at) of every level down to this one
    children: dict[tuple, int] = field(default_factory=dict)


def call_path_labels(times: np.ndarray, stacks: np.ndarray, paths: Sequence[CallPath],
                     steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(call-path label or None, numbered?) of every row: see the module docstring, signal 2. Rows in time order
    that repeat the stack before them (in one step) are the same calls: one group, labelled once."""
    n = len(stacks)
    labels = np.full(n, None, dtype=object)
    numbered = np.zeros(n, dtype=bool)
    has_path = np.asarray([bool(p) for p in paths] + [False], dtype=bool)[stacks] if n else np.zeros(0, dtype=bool)
    if not has_path.any():
        return labels, numbered
    timed = has_path & np.isfinite(times)
    order = np.flatnonzero(timed)
    order = order[np.argsort(times[order], kind="stable")]
    ordered_stacks, ordered_steps = stacks[order], steps[order]
    # a row that repeats the stack before it in the same step makes the same calls (lines unchanged): one group
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (ordered_stacks[1:] != ordered_stacks[:-1]) | (ordered_steps[1:] != ordered_steps[:-1])
    group_stacks, group_steps = ordered_stacks[starts], ordered_steps[starts]
    # the calls begin afresh each step, and below a new call of the outermost level (its class changes, or its line
    # goes back: _calls_of_part), whose own order no label shows: a part of the run between two such places that
    # runs the stacks an earlier part ran makes the calls that one made (a run without steps repeats its forward)
    identities = pd.factorize(np.asarray([p[0].identity if p else "" for p in paths] + [""], dtype=object))[0]
    lines = np.asarray([p[0].line if p else 0 for p in paths] + [0], dtype=np.int64)
    root, line = identities[group_stacks], lines[group_stacks]
    fresh = (group_steps[1:] != group_steps[:-1]) | (root[1:] != root[:-1]) | (line[1:] < line[:-1])
    most: dict[tuple, int] = defaultdict(int)                       # position -> most calls within one parent call
    distinct: dict[bytes, int] = {}                                 # a part's stacks -> its index in `runs`
    runs: list[tuple[list[int], list[tuple[tuple[tuple, int], ...]]]] = []   # (stacks, calls of each group)
    run_of_part: list[int] = []
    for sids in np.split(group_stacks, np.flatnonzero(fresh) + 1):
        key = sids.tobytes()
        if key not in distinct:
            distinct[key] = len(runs)
            runs.append((sids.tolist(), _calls_of_part(sids.tolist(), paths, most)))
        run_of_part.append(distinct[key])
    cache: dict[tuple, str] = {}

    def label(sid: int, calls: tuple[tuple[tuple, int], ...]) -> tuple[str, bool]:
        shown: tuple[int | None, ...] = tuple(index if depth and most.get(position, 0) > 1 else None
                                              for depth, (position, index) in enumerate(calls))
        cached = (sid, shown)
        if cached not in cache:
            cache[cached] = path_label(paths[sid], shown or None)
        return cache[cached], any(i is not None for i in shown)

    untimed = np.flatnonzero(has_path & ~timed)
    for sid in np.unique(stacks[untimed]).tolist():   # no calls seen: each stack's plain path
        rows = untimed[stacks[untimed] == sid]
        labels[rows], numbered[rows] = label(sid, ())
    if len(order):
        run_labels = []
        for run_stacks, calls in runs:
            texts, marks = zip(*(label(sid, c) for sid, c in zip(run_stacks, calls, strict=True)), strict=True)
            run_labels.append((np.asarray(texts, dtype=object), np.asarray(marks, dtype=bool)))
        which = np.cumsum(starts) - 1   # the group of each row in `order`
        labels[order] = np.concatenate([run_labels[r][0] for r in run_of_part])[which]
        numbered[order] = np.concatenate([run_labels[r][1] for r in run_of_part])[which]
    return labels, numbered


def _calls_of_part(sids: list[int], paths: Sequence[CallPath], most: dict[tuple, int]) -> list[tuple[tuple[tuple, int], ...]]:
    """The (position, index) of each level of each group of one part of the run (a step, or a call of the outermost
    level within one), whose groups' stacks are `sids` in time order; `most` (position -> most calls within one
    parent call) takes what this part shows."""
    groups: list[tuple[tuple[tuple, int], ...]] = []
    chain: list[_Call] = []
    roots: dict[tuple, int] = {}
    for sid in sids:
        levels = paths[sid]
        keep = 0
        while keep < min(len(chain), len(levels)):
            call, level = chain[keep], levels[keep]
            if call.identity != level.identity or level.line < call.line:
                break
            if keep and levels[keep - 1].line != call.entered_at:
                break
            keep += 1
        del chain[keep:]
        for call, level in zip(chain, levels, strict=False):
            call.line = level.line
        for depth in range(keep, len(levels)):
            level = levels[depth]
            entered_at = levels[depth - 1].line if depth else None
            key = (level.identity, entered_at)
            siblings = chain[depth - 1].children if depth else roots
            index = siblings.get(key, 0)
            siblings[key] = index + 1
            position = (chain[depth - 1].position if depth else ()) + (key,)
            if depth:
                most[position] = max(most[position], index + 1)
            chain.append(_Call(level.identity, entered_at, level.line, index, position))
        groups.append(tuple((c.position, c.index) for c in chain))
    return groups


def without_order(label: str) -> str:
    """The call path without its order numbers: `GPT › Block › MLP` for `GPT › Block[3] › MLP`."""
    return SEPARATOR.join(part[: part.rindex("[")] if part.endswith("]") and "[" in part else part
                          for part in label.split(SEPARATOR))


def _match_parameters(a: pd.DataFrame, module: np.ndarray, source: np.ndarray, category: np.ndarray,
                      exact: bool) -> None:
    """Gradients and optimizer states have their parameter's size: borrow its module when unambiguous (`exact`),
    else the call path the parameters of that size share but for the order numbers."""
    sizes = a["requested_bytes"].to_numpy()
    parameter = category == Category.PARAMETER
    is_param = parameter & ~pd.isna(module)
    if exact:   # an optimised tensor that is no parameter (`Adam([x])` on an input): where no parameter has its size
        kept = np.flatnonzero((category == Category.INPUT) & ~pd.isna(module) & a["t_free_us"].isna().to_numpy())
        is_param[kept] |= ~np.isin(sizes[kept], sizes[parameter])
    if not is_param.any():
        return
    params = pd.DataFrame({"size": sizes[is_param], "module": module[is_param].astype(str)})
    owners: dict[int, tuple[str, str]] = {}
    for size, names in params.groupby("size")["module"]:
        distinct = names.unique()
        if len(distinct) == 1:
            if exact:
                owners[int(size)] = (distinct[0], "size-match:parameter")
        elif not exact and all(SEPARATOR in n or n.endswith("]") for n in distinct):
            common = {without_order(n) for n in distinct}
            if len(common) == 1:
                owners[int(size)] = (common.pop(), "size-match:parameter-class")
    if not owners:
        return
    wanted = np.isin(category, [Category.GRADIENT, Category.OPTIMIZER_STATE]) & pd.isna(module)
    owned = np.fromiter(owners, dtype=np.int64, count=len(owners))
    found = pd.Index(owned).get_indexer(sizes[wanted])
    rows = np.flatnonzero(wanted)[found >= 0]
    names, signals = (np.asarray(column, dtype=object) for column in zip(*owners.values(), strict=True))
    module[rows], source[rows] = names[found[found >= 0]], signals[found[found >= 0]]


def _align(reference: np.ndarray, targets: np.ndarray, capacity: int, slack: int) -> list[tuple[int, int]] | None:
    """(target, reference) index pairs of equal sizes, walking both in order: each target takes the
    reference of its size nearest the last one matched (up to ORDER_WINDOW on, or `slack` back: a weight
    and its bias may come either way round), each reference at most `capacity` times. None unless ORDER_SHARE
    of the targets are matched."""
    uses = np.zeros(len(reference), dtype=np.int64)
    pairs: list[tuple[int, int]] = []
    pointer = 0
    for t, size in enumerate(targets):
        low, high = max(0, pointer - slack), min(len(reference), pointer + ORDER_WINDOW)
        found = [q for q in range(low, high) if reference[q] == size and uses[q] < capacity]
        if found:  # the nearest, forward on a tie
            hit = min(found, key=lambda q: (abs(q - pointer), q < pointer))
            uses[hit] += 1
            pairs.append((t, hit))
            pointer = max(pointer, hit)
    return pairs if len(targets) and len(pairs) >= ORDER_SHARE * len(targets) else None


def _match_parameter_order(a: pd.DataFrame, times: np.ndarray, steps: np.ndarray, module: np.ndarray,
                           source: np.ndarray, category: np.ndarray, phase: np.ndarray | None) -> None:
    """Signal 3's order rule: optimizer state in the parameters' order (each parameter's tensors together, or
    one pass over the parameters per tensor), each step's gradients in reverse, and the parameters an
    optimizer step makes to replace the old ones (`p.data = new`) in order."""
    sizes = a["requested_bytes"].to_numpy(dtype=np.int64)
    timed = np.isfinite(times)
    made_by_optimizer = (phase == Phase.OPTIMIZER) if phase is not None else np.zeros(len(a), dtype=bool)
    is_param = category == Category.PARAMETER
    params = np.flatnonzero(is_param & ~pd.isna(module) & timed & ~made_by_optimizer)
    if len(params) < 2:
        return
    params = params[np.argsort(times[params], kind="stable")]
    unset = pd.isna(module)

    def borrow(rows: np.ndarray, reference: np.ndarray, capacity: int, slack: int) -> None:
        """Walk all of `rows` (labelled ones keep the walk in step) and fill the unlabelled ones."""
        rows = rows[np.argsort(times[rows], kind="stable")]
        pairs = _align(sizes[reference], sizes[rows], capacity, slack)
        if capacity > 1 and len(rows) % capacity == 0:   # or one pass over the parameters per state tensor
            passes: list[tuple[int, int]] | None = []
            chunk = len(rows) // capacity
            for k in range(capacity):
                got = _align(sizes[reference], sizes[rows[k * chunk:(k + 1) * chunk]], 1, slack)
                passes = None if got is None or passes is None else passes + [(k * chunk + t, q) for t, q in got]
            if passes is not None and len(passes) > len(pairs or ()):
                pairs = passes
        for t, q in pairs or ():
            if unset[rows[t]]:
                module[rows[t]], source[rows[t]] = module[reference[q]], "size-match:parameter-order"

    states = np.flatnonzero(timed & (category == Category.OPTIMIZER_STATE))
    # states per parameter: as many as the state's tensors over the parameters (every one has a state)
    per_parameter = round(len(states) / max(1, int((is_param & ~made_by_optimizer).sum())))
    if unset[states].any() and 1 <= per_parameter <= ORDER_STATES:
        borrow(states, params, per_parameter, 0)
    gradients = timed & (category == Category.GRADIENT)
    for s in np.unique(steps[gradients & unset]):
        borrow(np.flatnonzero(gradients & (steps == s)), params[::-1], 1, 4)
    replacing = timed & is_param & made_by_optimizer
    for s in np.unique(steps[replacing & unset]):
        borrow(np.flatnonzero(replacing & (steps == s)), params, 1, 0)


def _mirror_forward(a: pd.DataFrame, times: np.ndarray, steps: np.ndarray, phase: np.ndarray, module: np.ndarray,
                    source: np.ndarray, category: np.ndarray) -> None:
    """Signal 4 of the module docstring, step by step."""
    sizes = a["requested_bytes"].to_numpy(dtype=np.int64)
    t_free = a["t_free_us"].to_numpy(dtype=np.float64, na_value=np.inf)
    timed = np.isfinite(times)
    forward = timed & (phase == Phase.FORWARD) & np.isin(source, [CALL_PATH, ORDERED, COMPILED_ROOT, OUTSIDE]) & np.isfinite(t_free)
    # a parameter's gradient has its parameter's size, not an activation's: signal 3's, never mirrored
    backward = timed & (phase == Phase.BACKWARD) & pd.isna(module) & (category != Category.GRADIENT)
    for s in np.intersect1d(steps[forward], steps[backward]):
        b_rows = np.flatnonzero(backward & (steps == s))
        f_rows = np.flatnonzero(forward & (steps == s))
        f_rows = f_rows[t_free[f_rows] >= times[b_rows].min()]          # released during this backward
        f_rows = f_rows[np.argsort(t_free[f_rows], kind="stable")]
        first = np.searchsorted(t_free[f_rows], times[b_rows], side="left")
        for row, k in zip(b_rows, first, strict=True):
            released = f_rows[k:k + MIRROR_RELEASES]
            twin = released[sizes[released] == sizes[row]]
            if len(twin):
                module[row], source[row] = module[twin[0]], "size-match:forward-release"
