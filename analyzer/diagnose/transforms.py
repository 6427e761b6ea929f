"""What each remedy changes in a recorded run, written as edits of its attributed allocation stream.

A stream is one row per allocation: when it was made and freed (`at`, `until`: positions in the recording's
event order; `until` is inf for memory alive at the end, `at` is -1 for memory made before the recording), its
requested bytes and the labels attribution gave it. A transform returns the stream the run would have made
with the remedy applied: rows resized, dropped (0 bytes), or added at fractional positions between recorded
events. `analyzer.diagnose.counterfactual` replays the result through the allocator model.

Each transform changes only what the remedy acts on, told by the labels: micro-batches scale what scales with
the batch (activations, temporaries and inputs of the forward and backward); accumulation also runs the
forward and backward once per micro-batch with the first one's gradients kept; checkpointing keeps a repeated
block's output and recomputes the rest in that block's backward; bf16 halves what the ops (or, with Python
frames only, torch's module files) say autocast runs in bf16 and adds the bf16 weight copies; ZeRO shards the
model states, and ZeRO-3 / FSDP gathers each unit's parameters around its forward and its backward; 8-bit,
Adafactor and offload shrink the optimizer state.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import UNATTRIBUTED, Category, Phase
from analyzer.diagnose.blocks import block_paths

#: positions of recorded events are integers; an added row sits this far (or a fraction of it) after one
NUDGE = 1e-3
BATCH_SCALED = (Category.ACTIVATION.value, Category.TEMPORARY.value, Category.INPUT.value)
STEP_WORK = (Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OTHER.value)
# the operators autocast runs in bf16 (matrix products) and those it keeps in fp32 (CUDA's fp32 list: norms,
# softmax, losses, embeddings, reductions), as the C++ frames of a stacks="all" recording name them
_BF16_OPS = re.compile(r"aten::(mm|addmm|bmm|baddbmm|matmul|linear|addbmm|conv\w*|cudnn_convolution\w*|"
                       r"_scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*|_scaled_mm)(_|$)")
_FP32_OPS = re.compile(r"aten::(native_layer_norm|layer_norm|group_norm|native_group_norm|native_batch_norm|"
                       r"batch_norm|rms_norm|_fused_rms_norm|_softmax|softmax|_log_softmax|log_softmax|_safe_softmax|"
                       r"nll_loss\w*|cross_entropy\w*|mse_loss|l1_loss|binary_cross_entropy\w*|embedding\w*|"
                       r"sum|mean|norm|cumsum|prod|exp|log|pow)(_|$)")
# with Python frames only: the torch file of the innermost torch frame says which module's forward made it
_BF16_FILES = re.compile(r"torch/nn/modules/(linear|conv)\.py$")
_FP32_FILES = re.compile(r"torch/nn/modules/(normalization|sparse|batchnorm|loss)\.py$")
_FP32_FUNCTIONS = {"layer_norm", "group_norm", "batch_norm", "rms_norm", "softmax", "log_softmax", "cross_entropy",
                   "nll_loss", "embedding", "mse_loss"}


@dataclass(frozen=True)
class Stream:
    """A run's allocations (columns: at, until, bytes, stream, category, phase, module, step, stack_id) and the
    positions where the allocator released its cache (empty_cache)."""

    rows: pd.DataFrame
    releases: np.ndarray
    stacks: pd.DataFrame          # the trace's stacks table (frames and op of each stack_id)
    grad_mode: str | None = None  # vocabulary.GradMode the recording shows (a KV cache is told from a graph by it)

    def with_rows(self, rows: pd.DataFrame) -> Stream:
        return replace(self, rows=rows.reset_index(drop=True))


def _scaled(rows: pd.DataFrame, mask: pd.Series | np.ndarray, factor: float) -> pd.DataFrame:
    out = rows.copy()
    out.loc[mask, "bytes"] = (out.loc[mask, "bytes"] * factor).round().astype(np.int64)
    return out


#: phases whose memory does not scale with the batch; an unknown phase (a memory timeline records none) does
NOT_BATCH_WORK = (Phase.OPTIMIZER.value, Phase.LOAD.value, Phase.CHECKPOINT_SAVE.value, Phase.COMPILE.value)


def batch_scaled(rows: pd.DataFrame) -> pd.Series:
    """Rows that scale with the batch: activations, temporaries and inputs made outside the optimizer step,
    model loading, checkpoint saving and compilation."""
    return rows["category"].isin(BATCH_SCALED) & ~rows["phase"].isin(NOT_BATCH_WORK)


def micro_batch(stream: Stream, k: int) -> Stream:
    """A micro-batch 1/k as large: what scales with the batch is 1/k of its size."""
    return stream.with_rows(_scaled(stream.rows, batch_scaled(stream.rows), 1 / k))


def _step_windows(rows: pd.DataFrame) -> list[tuple[float, float]]:
    """Per step: from its first forward-or-input allocation to its last forward or backward event (before
    its optimizer step), the part of a step gradient accumulation repeats."""
    work = rows[rows["phase"].isin(STEP_WORK) & (rows["step"] >= 1) & (rows["at"] >= 0)]
    optimizer = rows.loc[rows["phase"] == Phase.OPTIMIZER.value].groupby("step")["at"]
    first_optimizer, optimizer_rows = optimizer.min(), optimizer.size()
    windows = []
    for step, part in work.groupby("step"):
        end = float(first_optimizer[step]) - NUDGE / 2 if optimizer_rows.get(step, 0) else float(part["at"].max())
        if part["phase"].isin((Phase.FORWARD.value, Phase.BACKWARD.value)).any():
            windows.append((float(part["at"].min()) - NUDGE / 2, end))
    return windows


def accumulation(stream: Stream, k: int) -> Stream:
    """k micro-batches of 1/k the size per step: the step's forward and backward run k times in its window,
    each copy 1/k as large; the gradients the first copy makes are kept to their recorded free, later copies'
    gradients are summed into them (each a temporary freed at once); what a copy keeps past the window is
    freed at the end of that copy, except the last copy's, which keeps its recorded free. Frees inside the
    window of what was made before it happen in the first copy."""
    rows = _scaled(stream.rows, batch_scaled(stream.rows), 1 / k)
    at, recorded = rows["at"].to_numpy(), rows["until"].to_numpy()
    made_in, freed_in = _Ordered(at), _Ordered(recorded)   # a mask over every row per step was quadratic
    keep = np.ones(len(rows), dtype=bool)
    until = recorded.copy()
    windows = _step_windows(rows)
    parts = []
    for start, end in windows:
        inside = made_in.between(start, end)
        keep[inside] = False
        freed_inside = (ending := freed_in.between(start, end))[at[ending] <= start]
        until[freed_inside] = start + (recorded[freed_inside] - start) / k
        parts.append(inside)
    kept = rows.assign(until=until)[keep]
    if not windows:
        return stream.with_rows(kept)
    # each copy of every window at once (a frame per window and copy cost ~2 ms each), then in the order of a
    # window at a time, its copies in turn, each in row order (nothing to reorder where there is one window)
    lengths = [len(part) for part in parts]
    window = np.repeat(np.arange(len(windows)), lengths)
    begins, ends = (np.asarray(bound, dtype=np.float64)[window] for bound in zip(*windows, strict=True))
    made = rows.iloc[np.concatenate(parts)]
    made_at, made_until = made["at"].to_numpy(), made["until"].to_numpy()
    span = (ends - begins) / k
    within = made_until < ends
    gradient = (made["category"] == Category.GRADIENT.value).to_numpy()
    copies = []
    for j in range(k):
        offset = begins + j * span
        copy_at = offset + (made_at - begins) / k
        copy_until = np.where(within, offset + (made_until - begins) / k, made_until if j == k - 1 else offset + span)
        if j == 0:
            copy_until = np.where(gradient & ~within, made_until, copy_until)
        else:
            copy_until = np.where(gradient, copy_at + span * NUDGE, copy_until)
        copies.append(made.assign(at=copy_at, until=copy_until))
    copied = pd.concat(copies)
    if len(windows) > 1:
        first, total = np.cumsum([0, *lengths[:-1]]), len(made)
        copied = copied.iloc[np.concatenate([np.arange(j * total + f, j * total + f + n)
                                             for f, n in zip(first, lengths, strict=True) for j in range(k)])]
    return stream.with_rows(pd.concat([kept, copied]))


class _Ordered:
    """Positions sorted once, so that the rows whose position lies strictly between two others are found by two
    binary searches, in row order."""

    def __init__(self, values: np.ndarray) -> None:
        self.order = np.argsort(values, kind="stable")
        self.sorted = values[self.order]

    def between(self, low: float, high: float) -> np.ndarray:
        if not low < high:
            return np.array([], dtype=np.int64)
        span = self.order[np.searchsorted(self.sorted, low, "right"):np.searchsorted(self.sorted, high, "left")]
        return np.sort(span)


def checkpointing(stream: Stream) -> Stream:
    """Every repeated block checkpointed: in the forward, its activations other than its output (the latest it
    made, the next block's input) live only until the block's forward ends; just before the block's backward
    (its first backward allocation, or the first free of what it saved) its forward runs again, its activations
    and temporaries in their recorded order, and the recomputed activations live to their recorded frees."""
    rows = stream.rows
    blocks = block_paths(rows["module"])
    if blocks.nunique() < 2:
        return stream
    forward = (rows["phase"] == Phase.FORWARD.value) & blocks.notna() & (rows["at"] >= 0)
    made = rows[forward & rows["category"].isin((Category.ACTIVATION.value, Category.TEMPORARY.value))]
    if made.empty:
        return stream.with_rows(rows)
    backward = rows[(rows["phase"] == Phase.BACKWARD.value) & blocks.notna()]
    first_backward = backward.groupby([backward["step"], blocks[backward.index]])["at"].min()
    # one pass over every call at once (a call: a step's forward rows of one block, in row order)
    keys = pd.MultiIndex.from_arrays([made["step"], blocks[made.index]])
    width = len(keys.levels[1])
    codes, call = np.unique(keys.codes[0].astype(np.int64) * width + keys.codes[1], return_inverse=True)
    at, original = made["at"].to_numpy(), made["until"].to_numpy()
    index = made.index.to_numpy()
    activation = (made["category"] == Category.ACTIVATION.value).to_numpy()
    calls = len(codes)
    output = np.full(calls, -1, dtype=np.int64)           # the latest activation a call made (its output)
    np.maximum.at(output, call[activation], index[activation])
    is_output = index == output[call]
    dropped = activation & ~is_output
    lo, hi = np.full(calls, np.inf), np.full(calls, -np.inf)
    np.minimum.at(lo, call, at)
    np.maximum.at(hi, call, at)
    hi = hi + NUDGE / 2
    until = rows["until"].copy()
    until.loc[index[dropped]] = np.minimum(original[dropped], hi[call[dropped]])
    first_free = np.full(calls, np.inf)
    np.minimum.at(first_free, call[dropped], original[dropped])
    of_call = pd.MultiIndex.from_arrays([keys.levels[0][codes // width], keys.levels[1][codes % width]])
    backward_at = first_backward.reindex(of_call).fillna(np.inf).to_numpy(dtype=np.float64)
    recompute = np.minimum(first_free, backward_at) - NUDGE
    again = (output >= 0)[call] & np.isfinite(recompute)[call]
    squeeze = NUDGE * 0.9 / np.maximum(hi - lo, 1.0)       # the block's forward again, inside (recompute - NUDGE, recompute)
    c = call[again]
    base = recompute[c] - NUDGE * 0.95
    copy = made[again].assign(at=base + (at[again] - lo[c]) * squeeze[c],
                              until=np.where(dropped[again], original[again], np.where(
                                  is_output[again], recompute[c], base + (np.minimum(original[again], hi[c]) - lo[c])
                                  * squeeze[c])))
    copy = copy.iloc[np.argsort(c, kind="stable")]
    return stream.with_rows(pd.concat([rows.assign(until=until), copy]))


def _precision(stacks: pd.DataFrame) -> np.ndarray:
    """Per stack: +1 autocast runs it in bf16, -1 it stays fp32, 0 the stack does not say."""
    verdict = np.zeros(len(stacks), dtype=np.int8)
    for i, (frames, op) in enumerate(zip(stacks["frames"], stacks["op"], strict=True)):
        if isinstance(op, str):
            verdict[i] = 1 if _BF16_OPS.match(op) else -1 if _FP32_OPS.match(op) else 0
            continue
        torch_frame = next((f for f in frames if "torch/" in f[0].replace("\\", "/")), None)
        if torch_frame is None:
            continue
        filename = torch_frame[0].replace("\\", "/")
        if _BF16_FILES.search(filename):
            verdict[i] = 1
        elif _FP32_FILES.search(filename) or torch_frame[2] in _FP32_FUNCTIONS:
            verdict[i] = -1
    return verdict


def bf16(stream: Stream) -> Stream:
    """bf16 autocast: forward activations and temporaries the ops or frames say run in bf16 are halved (what
    they say stays fp32, or do not say, is kept); a backward allocation of the size of a halved forward
    activation (its gradient) is halved too; each parameter of a module that ran a bf16 op gets a bf16 copy
    from the module's first forward allocation of the step to the end of that step's backward."""
    rows = stream.rows
    verdict = _precision(stream.stacks)
    ids = rows["stack_id"].to_numpy(dtype=np.float64)
    known = ~np.isnan(ids)
    precision = np.zeros(len(rows), dtype=np.int8)
    precision[known] = verdict[ids[known].astype(np.int64)]
    work = rows["category"].isin((Category.ACTIVATION.value, Category.TEMPORARY.value)).to_numpy()
    forward = work & (rows["phase"] == Phase.FORWARD.value).to_numpy()
    halved = forward & (precision == 1)
    halved_sizes = set(rows.loc[halved, "bytes"]) - set(rows.loc[forward & (precision <= 0), "bytes"])
    backward = work & (rows["phase"] == Phase.BACKWARD.value).to_numpy()
    gradients = backward & ((precision == 1) | ((precision == 0) & rows["bytes"].isin(halved_sizes).to_numpy()))
    out = _scaled(rows, halved | gradients, 0.5)
    bf16_modules = set(rows.loc[halved, "module"].astype(str))
    params = rows[(rows["category"] == Category.PARAMETER.value) & rows["module"].astype(str).isin(bf16_modules)]
    # every step's copies at once, in step order (pandas work per step cost ~5 ms a step)
    stepped = rows[rows["step"] >= 1]
    forward_rows = stepped[stepped["phase"] == Phase.FORWARD.value]
    starts = forward_rows.groupby([forward_rows["step"], forward_rows["module"].astype(str)])["at"].min()
    ends = stepped.loc[stepped["phase"] == Phase.BACKWARD.value].groupby("step")["at"].max()
    each = np.tile(np.arange(len(params)), len(ends))
    step_of = np.repeat(ends.index.to_numpy(dtype=np.float64), len(params))
    at = starts.reindex(pd.MultiIndex.from_arrays([step_of, params["module"].astype(str).to_numpy()[each]])).to_numpy()
    copied = ~np.isnan(at)
    copy = params.iloc[each[copied]].copy()
    copy["at"] = at[copied] - NUDGE / 4
    copy["until"] = np.repeat(ends.to_numpy(dtype=np.float64), len(params))[copied] + NUDGE / 4
    copy["bytes"] //= 2
    copy["category"], copy["phase"], copy["step"] = Category.TEMPORARY.value, Phase.FORWARD.value, step_of[copied]
    return stream.with_rows(pd.concat([out, copy] if len(copy) else [out]))


def _optimizer_work(rows: pd.DataFrame) -> pd.Series:
    return (rows["category"] == Category.OPTIMIZER_STATE.value) | (
        (rows["phase"] == Phase.OPTIMIZER.value) & (rows["category"] == Category.TEMPORARY.value))


def zero(stream: Stream, stage: int, shards: int) -> Stream:
    """ZeRO stage 1-2 over `shards` GPUs: optimizer state and the optimizer step's temporaries are 1/N;
    from stage 2 each gradient is reduce-scattered as it is made: a full-size temporary, then its 1/N shard."""
    rows = stream.rows
    out = _scaled(rows, _optimizer_work(rows), 1 / shards)
    if stage < 2:
        return stream.with_rows(out)
    gradient = out["category"] == Category.GRADIENT.value
    full = out[gradient].copy()
    full["until"] = full["at"] + NUDGE / 2
    full["category"] = Category.TEMPORARY.value
    out = _scaled(out, gradient, 1 / shards)
    out.loc[gradient, "at"] += NUDGE / 4
    return stream.with_rows(pd.concat([out, full]))


def optimizer_state(stream: Stream, factor: float, step_temporaries: float = 1.0) -> Stream:
    """The optimizer state `factor` of its size (8-bit moments 1/4, Adafactor's factored moments ~1/10,
    offloaded 0), and the optimizer step's temporaries `step_temporaries` of theirs (0 when it runs on the CPU)."""
    rows = stream.rows
    out = _scaled(rows, rows["category"] == Category.OPTIMIZER_STATE.value, factor)
    step = (out["phase"] == Phase.OPTIMIZER.value) & (out["category"] == Category.TEMPORARY.value)
    return stream.with_rows(_scaled(out, step, step_temporaries))


def _calls(rows: pd.DataFrame, units: pd.Series) -> tuple[pd.DataFrame, pd.Series]:
    """Each repeated block's forward and backward calls: a run of a step's forward (or backward) rows of one block,
    unbroken by another block's (columns unit, phase, step, first, last: positions), and the call each gradient
    row was made in."""
    work = rows[rows["phase"].isin((Phase.FORWARD.value, Phase.BACKWARD.value)) & units.notna() & (rows["at"] >= 0)]
    work = work.assign(unit=units[work.index]).sort_values("at", kind="stable")
    key = work[["unit", "phase", "step"]]
    run = (key != key.shift()).any(axis=1).cumsum()
    calls = work.assign(run=run).groupby("run").agg(unit=("unit", "first"), phase=("phase", "first"),
                                                      step=("step", "first"), first=("at", "min"), last=("at", "max"))
    return calls, run[work["category"] == Category.GRADIENT.value]


def zero3(stream: Stream, shards: int) -> Stream:
    """ZeRO-3 / FSDP full sharding over `shards` GPUs, each repeated block one unit and the rest of the model the
    root unit (FSDP's usual wrapping of a transformer), no prefetching. Parameters, gradients, optimizer state and
    the optimizer step's temporaries are 1/N. A block's parameters are all-gathered into a buffer of the unit's
    size just before each of its forward calls and freed after it, and gathered again just before its backward;
    when its last gradient is made the unit's gradients are reduce-scattered (a buffer of their size, then the
    1/N shards that live on to the recorded frees) and the full gradients, the buffer and the gathered
    parameters are freed. The root unit is gathered from the step's first forward allocation to the end of its
    own reduce-scatter. A recording without repeated blocks, without forward and backward phases, or with
    parameters no module owns (made before the recording) shows no place to gather, or no unit to gather: it is
    returned as it is, for the formula to judge."""
    rows = stream.rows
    blocks = block_paths(rows["module"])
    calls, call_of_gradient = _calls(rows, blocks)
    parameter = rows["category"] == Category.PARAMETER.value
    owners = rows.loc[parameter, "module"].astype(str)
    if blocks.nunique() < 2 or not (calls["phase"] == Phase.BACKWARD.value).any() \
            or owners.isin((UNATTRIBUTED, "")).any() or not blocks[parameter].notna().any():
        return stream
    units = blocks.fillna("")                       # "": the root unit
    root_gradients = rows[(rows["category"] == Category.GRADIENT.value) & (rows["phase"] == Phase.BACKWARD.value)
                          & (units == "") & (rows["at"] >= 0)]
    gradients_of = {**{("call", c): g.index.to_numpy() for c, g in call_of_gradient.groupby(call_of_gradient)},
                    **{("root", step): g.index.to_numpy() for step, g in root_gradients.groupby("step")}}
    forward = rows[(rows["phase"] == Phase.FORWARD.value) & (rows["at"] >= 0)].groupby("step")["at"].min()
    sizes = rows["bytes"].to_numpy()
    until = rows["until"].to_numpy().copy()
    buffers: list[tuple[float, float, int, str, float, str]] = []   # at, until, bytes, phase, step, unit
    shard_rows: list[np.ndarray] = []
    shard_at: list[np.ndarray] = []

    def gathered(at: float, end: float, unit: str, size: int, phase: str, step: float, grads: np.ndarray) -> None:
        """The unit gathered from `at` to `end`; with gradients, reduce-scattered at `end` before it is freed."""
        buffers.append((at - NUDGE / 2, end + 3.5 * NUDGE / 8, size, phase, step, unit))
        if len(grads):
            buffers.append((end + NUDGE / 8, end + 2.5 * NUDGE / 8, int(sizes[grads].sum()), phase, step, unit))
            shard_rows.append(grads)
            shard_at.append(np.full(len(grads), end + 2 * NUDGE / 8))
            until[grads] = end + 3 * NUDGE / 8

    parameters, parameter_units = rows[parameter], units[parameter]   # the step loop reads only these
    for step, part in calls.groupby("step"):
        if step not in forward.index:
            continue
        first = float(forward[step])
        alive = (parameters["at"] < first) & (parameters["until"] > first)
        size = parameters.loc[alive, "bytes"].groupby(parameter_units[alive]).sum()
        for call in part.itertuples():
            if call.phase == Phase.FORWARD.value:
                gathered(call.first, call.last, call.unit, int(size.get(call.unit, 0)), call.phase, step, np.array([]))
                continue
            grads = gradients_of.get(("call", call.Index), np.array([], dtype=np.int64))
            end = float(rows["at"].to_numpy()[grads].max()) if len(grads) else call.last
            gathered(call.first, end, call.unit, int(size.get(call.unit, 0)), call.phase, step, grads)
        grads = gradients_of.get(("root", step), np.array([], dtype=np.int64))
        end = float(rows["at"].to_numpy()[grads].max()) if len(grads) else float(part["last"].max())
        gathered(first, end, "", int(size.get("", 0)), Phase.FORWARD.value, step, grads)
    out = _scaled(rows.assign(until=until), parameter | _optimizer_work(rows), 1 / shards)
    made = pd.DataFrame(buffers, columns=["at", "until", "bytes", "phase", "step", "module"]).assign(
        stream=0, category=Category.TEMPORARY.value, stack_id=np.nan)
    made["module"] = made["module"].replace("", "(root module)")
    picked = np.concatenate(shard_rows) if shard_rows else np.array([], dtype=np.int64)
    shard = rows.iloc[picked].assign(at=np.concatenate(shard_at) if shard_at else [],
                                     bytes=-(-rows["bytes"].to_numpy()[picked] // shards))
    return stream.with_rows(pd.concat([out, made[rows.columns], shard]))
