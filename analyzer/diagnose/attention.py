"""What a recording shows of attention: the eager attention's s x s tensors, which fused attention never makes,
whether the model has attention at all, and a KV cache kept by a forward-only run.

- Eager attention: in a repeated block (`layers.N`, `forward[N]`, `DecoderLayer_N`: analyzer.diagnose.blocks), a softmax (torch's op,
  `aten::_softmax`, or a Python function named `softmax`, as hand-written ones are) of at least SCORES_MIN_BYTES
  whose element count a matrix product of the same block and step made too (`aten::bmm`/`matmul`/`baddbmm`, or
  `einsum`/`matmul` in the frames: the scores q·kᵀ), or called from a function that names attention (compiled
  code hides the matmul in a generated kernel), is a b·h·s² softmax over a matmul. Every forward or
  backward activation and temporary of that block and step of that element count (at 2 or 4 bytes an element:
  scores, their scaling and mask, the probabilities, dropout, and their gradients) is such a tensor, unless a
  torch.nn Linear made it. Fused attention (SDPA / FlashAttention) keeps a b·h·s log-sum-exp instead.
- Attention seen: such tensors, a fused attention op, or a frame or module that names attention (`attn`,
  `attention`, `scaled_dot_product`); none where nothing names attention and convolutions are seen (their ops,
  torch's conv.py, `Conv2d` modules: a CNN); None otherwise (the recording cannot say).
- KV cache: with autograd off (a profiler trace's grad mode), tensors made in a repeated block's attention that
  outlive that block's call (a run of its forward allocations): a decoder's cache of K and V per layer. A block
  that keeps them from several calls (decode steps) must keep more in its last call than in its first (a cache
  concatenates past and new K and V), else they are outputs (attention weights, hidden states). A Python frame
  of a cache's update (`cache_utils`, `Cache.update`, `past_key_value`) says it whatever the grad mode (with a
  quantizer in those frames: the cache is quantized already). With autograd on or not recorded, tensors kept
  past their block may be the autograd graph (which `no_grad` addresses): only those frames name a cache then.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import Category, Phase
from analyzer.diagnose.blocks import block_paths
from analyzer.diagnose.transforms import Stream

SCORES_MIN_BYTES = 1 << 20     # a softmax under 1 MiB is no attention matrix worth fusing
_SOFTMAX_OP = re.compile(r"aten::_?softmax(?!\w*log)")      # _softmax, softmax, _softmax_backward_data; not log_softmax
_SAFE_SOFTMAX_OP = re.compile(r"aten::_safe_softmax")
_MATMUL_OP = re.compile(r"aten::(bmm|matmul|baddbmm|einsum)(?![a-z])")
_MATMUL_FUNCTIONS = {"einsum", "matmul", "bmm", "baddbmm"}
_LINEAR = re.compile(r"aten::(addmm|linear)(?![a-z])")
_LINEAR_FILE = "torch/nn/modules/linear.py"
_CONV_OP = re.compile(r"aten::(conv\w*|_convolution\w*|convolution\w*|cudnn_convolution\w*|miopen_convolution\w*)")
_CONV_FILE = "torch/nn/modules/conv.py"
_CONV_MODULE = re.compile(r"(^|[ ._])Conv[123]d(_\d+)?($|[ .])")
_FUSED_OP = re.compile(r"aten::(_scaled_dot_product\w*|scaled_dot_product_attention|_flash_attention\w*|"
                       r"_efficient_attention\w*)")
_ATTENTION_NAME = re.compile(r"attention|attn|scaled_dot_product", re.IGNORECASE)
_ATTENTION_SCOPE = re.compile(r"^.*?(attention|attn|scaled_dot_product)[^.\[ ]*", re.IGNORECASE)  # to that level
_CACHE_FRAME = re.compile(r"cache_utils|kv_cache|past_key_value|Cache\.update", re.IGNORECASE)
CACHE_KINDS = ("cache", "quantized_cache")
_WORK = (Category.ACTIVATION.value, Category.TEMPORARY.value)
_PASSES = (Phase.FORWARD.value, Phase.BACKWARD.value)


def _stack_kinds(stacks: pd.DataFrame) -> dict[int, str]:
    """Per stack id: 'softmax', 'matmul', 'linear', 'fused', 'attention' (a frame names it), 'cache' or ''."""
    kinds: dict[int, str] = {}
    for sid, frames, op in zip(stacks["stack_id"], stacks["frames"], stacks["op"], strict=True):
        op = op if isinstance(op, str) else ""
        python = [f for f in frames if str(f[0]).endswith(".py")]
        functions = {str(f[2]) for f in python}
        files = " ".join(str(f[0]).replace("\\", "/") for f in python)
        if _FUSED_OP.match(op):
            kinds[int(sid)] = "fused"
        elif _SOFTMAX_OP.match(op) or _SAFE_SOFTMAX_OP.match(op) or "softmax" in functions:
            named = any(_ATTENTION_NAME.search(f"{f[0]} {f[2]}") for f in python)
            kinds[int(sid)] = "attention_softmax" if named else "softmax"
        elif _CONV_OP.match(op) or _CONV_FILE in files:
            kinds[int(sid)] = "conv"
        elif _LINEAR.match(op) or _LINEAR_FILE in files:
            kinds[int(sid)] = "linear"
        elif _MATMUL_OP.match(op) or (python and str(python[0][2]) in _MATMUL_FUNCTIONS):
            kinds[int(sid)] = "matmul"
        elif any(_CACHE_FRAME.search(f"{f[0]} {f[2]}") for f in python):
            kinds[int(sid)] = "quantized_cache" if any("quant" in f"{f[0]} {f[2]}".lower() for f in python) else "cache"
        elif any(_ATTENTION_NAME.search(f"{f[0]} {f[2]}") for f in python):
            kinds[int(sid)] = "attention"
        else:
            kinds[int(sid)] = ""
    return kinds


def _kinds_of(rows: pd.DataFrame, stacks: pd.DataFrame) -> pd.Series:
    """Each row's stack kind ('' without one), as categories: its callers compare it several times a call."""
    kinds = _stack_kinds(stacks)
    names = sorted({"", *kinds.values()})
    code_of = {name: i for i, name in enumerate(names)}
    ids = pd.to_numeric(rows["stack_id"], errors="coerce").astype("float64")
    codes = ids.map({float(k): code_of[v] for k, v in kinds.items()}).fillna(code_of[""]).to_numpy(dtype=np.int64)
    return pd.Series(pd.Categorical.from_codes(codes, categories=names), index=rows.index)


def _elements(rows: pd.DataFrame, size: str) -> pd.DataFrame:
    """(block, step, elements) of each row, at 2 and at 4 bytes an element (where the size divides)."""
    out = [pd.DataFrame({"block": rows["block"], "step": rows["step"], "elements": rows[size] // width})[
        rows[size] % width == 0] for width in (2, 4)]
    return pd.concat(out).drop_duplicates()


def score_tensors(rows: pd.DataFrame, stacks: pd.DataFrame, size: str) -> pd.Series:
    """The rows (allocations, or a replay stream's rows; `size` names their bytes column) that are eager
    attention's b·h·s² tensors, forward and backward (see the module's docstring)."""
    out = pd.Series(False, index=rows.index)
    if rows.empty or stacks.empty:
        return out
    kinds = _kinds_of(rows, stacks)
    if not kinds.isin(("softmax", "attention_softmax")).any():
        return out
    table = pd.DataFrame({"block": block_paths(rows["module"]), "step": pd.to_numeric(rows["step"], errors="coerce")
                          .fillna(-1).astype("float64"), size: rows[size].astype("int64")}, index=rows.index)
    phase, category = rows["phase"], rows["category"]   # categories: compared as they are, not a string a row
    forward = (phase == Phase.FORWARD.value) & table["block"].notna()
    softmax = forward & kinds.isin(("softmax", "attention_softmax")) & (table[size] >= SCORES_MIN_BYTES)
    if not softmax.any():
        return out
    products = _elements(table[forward & (kinds == "matmul")], size)
    over_a_matmul = _elements(table[softmax], size).merge(products, on=["block", "step", "elements"])
    named = _elements(table[softmax & (kinds == "attention_softmax")], size)
    found = pd.concat([over_a_matmul, named]).drop_duplicates()
    if found.empty:
        return out
    sizes = pd.concat([found.assign(**{size: found["elements"] * width}) for width in (2, 4)])[["block", "step", size]]
    work = table["block"].notna() & phase.isin(_PASSES) & category.isin(_WORK) & (kinds != "linear")
    candidates = table[work].reset_index()
    hit = candidates.merge(sizes.drop_duplicates(), on=["block", "step", size], how="inner")
    out.loc[hit.iloc[:, 0].to_numpy()] = True
    return out


def attention_seen(allocations: pd.DataFrame, stacks: pd.DataFrame, scores: pd.Series) -> bool | None:
    """Whether the model has attention: its s² tensors, a fused attention op, or a frame or module naming it;
    False for convolutions without any of these (a CNN); None where the recording cannot say."""
    if scores.any():
        return True
    kinds = _kinds_of(allocations, stacks) if not stacks.empty else pd.Series("", index=allocations.index)
    if kinds.isin(("fused", "attention", *CACHE_KINDS)).any():
        return True
    modules = [str(m) for m in pd.unique(allocations["module"])]   # the distinct modules, not a string a row
    if any(_ATTENTION_NAME.search(m) for m in modules):
        return True
    convolutions = (kinds == "conv").any() or any(_CONV_MODULE.search(m) for m in modules)
    return False if convolutions else None


def cache_call_ends(allocations: pd.DataFrame, stacks: pd.DataFrame, structural: bool = True) -> pd.Series:
    """Per allocation a forward-only run keeps in a KV cache, where the call that used it ended; NaN for the rest.

    In the cache: made by a cache's update (its frames say so), or, `structural` (autograd known off), made in a
    repeated block's attention (a module or frame naming attention) and alive past that block's call (after its
    last forward allocation). Where the call ended: its attention module's last forward allocation in its block's
    call where its module path names one (`self_attn`, `Qwen2Attention_3`), else the block call's last; its own
    position outside a block's call, -1 made before the recording. Without a cache the tensor is freed there."""
    out = pd.Series(np.nan, index=allocations.index)
    if allocations.empty:
        return out
    kinds = _kinds_of(allocations, stacks) if not stacks.empty else pd.Series("", index=allocations.index)
    codes, names = pd.factorize(allocations["module"], use_na_sentinel=False)   # each module read once, not a row
    paths = [str(m) for m in names]

    def per_module(rule: Callable[[str], object], dtype: type) -> pd.Series:
        return pd.Series(np.asarray([rule(m) for m in paths], dtype=dtype)[codes], index=allocations.index)

    block = block_paths(allocations["module"])
    forward = allocations["phase"] == Phase.FORWARD.value
    in_attention = per_module(lambda m: bool(_ATTENTION_NAME.search(m)), bool) | kinds.isin(("attention", "fused"))
    made = allocations["seq_alloc"].astype("float64")
    freed = allocations["seq_free"].astype("float64").fillna(np.inf)
    # a block's call: a run of forward allocations of that block, unbroken by another block's
    work = pd.DataFrame({"block": block, "made": made})[forward & block.notna() & made.notna()].sort_values("made")
    call = (work["block"] != work["block"].shift()).cumsum()
    end = work.groupby(call)["made"].transform("max")
    # ... and the last allocation of its attention module in that call
    scopes = per_module(_attention_scope, object)[work.index]
    used_until = work["made"].groupby([call, scopes]).transform("max").where(scopes != "", end)
    if structural:
        kept_rows = work.index[(in_attention[work.index] & (freed[work.index] > end)).to_numpy()]
        kept = _growing(kept_rows, work["block"], call, allocations["allocated_bytes"])
        out.loc[kept] = used_until[kept]
    updated = kinds.isin(CACHE_KINDS) & allocations["category"].isin(_WORK) & out.isna()
    out.loc[updated] = used_until.reindex(allocations.index[updated]).fillna(made[updated]).fillna(-1.0)
    return out


def _attention_scope(module: str) -> str:
    """The module path up to its level that names attention (`layers.0.self_attn`); '' where none does."""
    found = _ATTENTION_SCOPE.match(module)
    return "" if found is None else found.group(0)


def _growing(kept: pd.Index, blocks: pd.Series, call: pd.Series, size: pd.Series) -> pd.Index:
    """Of the tensors kept past their block's call, those of blocks whose cache grows: a block that keeps tensors
    from one call (a prefill, a static cache) is taken as it is; one that keeps them from several calls (decode
    steps) must keep more in its last call than in its first (torch.cat of the past and the new K and V), else
    what it keeps is outputs (attention weights, hidden states), not a cache."""
    if kept.empty:
        return kept
    table = pd.DataFrame({"block": blocks[kept], "call": call[kept], "size": size[kept]})
    per_call = table.groupby(["block", "call"])["size"].sum().reset_index().sort_values("call")
    first = per_call.groupby("block")["size"].first()
    last = per_call.groupby("block")["size"].last()
    calls = per_call.groupby("block").size()
    cached = calls.index[(calls == 1) | (last > first)]
    return kept[table["block"].isin(cached).to_numpy()]


def quantized_cache(allocations: pd.DataFrame, stacks: pd.DataFrame) -> bool:
    """Whether the frames show the cache quantized already (a quantizer called from the cache's update)."""
    return not stacks.empty and bool((_kinds_of(allocations, stacks) == "quantized_cache").any())


def fused(stream: Stream) -> Stream:
    """Fused attention's run: eager attention's s² tensors, forward and backward, are never made (0 bytes)."""
    rows = stream.rows
    scores = score_tensors(rows, stream.stacks, "bytes")
    if not scores.any():
        return stream
    out = rows.copy()
    out.loc[scores, "bytes"] = 0
    return stream.with_rows(out)
