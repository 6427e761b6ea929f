"""A KV cache: a forward-only run keeps each layer's K and V across the forward (and the decode steps after it).

Named where the recording shows it (analyzer.diagnose.attention.cache_call_ends: attention's tensors outliving
their block's call with autograd off, or a cache's update in the frames), in a run that shows no training (no
backward, optimizer step, gradients or optimizer state), and where the cache holds at least KV_CACHE_SHARE of
the peak. With autograd on (or not recorded) the kept tensors may be the autograd graph, which `no_grad`
addresses: only a cache's own frames name them a cache then.

Its remedies are replayed (analyzer.diagnose.counterfactual) where the recording has an allocation history: the
same rule finds the cache's tensors in the recorded stream, and `use_cache=False` frees each at the end of the
block's call that made it (the layer's attention used its K and V and kept nothing), a cache of `factor` the size
(int8 from 16 bits: 1/2) keeps each at that share of its bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.core.units import gib
from analyzer.core.vocabulary import Category, GradMode, Phase
from analyzer.diagnose.attention import cache_call_ends, quantized_cache
from analyzer.diagnose.blocks import block_paths
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
from analyzer.diagnose.transforms import NUDGE, Stream
from analyzer.result import Evidence, KVCacheDetails, KVCacheFinding

KV_CACHE_SHARE = 0.05   # a cache under this share of the peak is not worth naming
_TRAINING_PHASES = (Phase.BACKWARD.value, Phase.OPTIMIZER.value)
_TRAINING_CATEGORIES = (Category.GRADIENT.value, Category.OPTIMIZER_STATE.value)


@dataclass(frozen=True)
class KVCache:
    """The KV cache alive at the peak."""

    bytes: int
    tensors: int
    layers: int          # repeated blocks its tensors were made in (0 where the module names show none)
    quantized: bool      # the frames show a quantizer writing it


NONE = KVCache(0, 0, 0, False)


def cache_ends(allocations: pd.DataFrame, stacks: pd.DataFrame, grad_mode: str | None) -> pd.Series:
    """Per allocation of a run that does not train, where the block's call that made it ended when it is in the
    KV cache (attention.cache_call_ends, told structurally only with autograd known off); NaN for the rest, and
    for every allocation of a run that trains."""
    if allocations["phase"].isin(_TRAINING_PHASES).any() or allocations["category"].isin(_TRAINING_CATEGORIES).any():
        return pd.Series(np.nan, index=allocations.index)
    autograd_off = grad_mode is not None and GradMode(grad_mode).autograd_off
    return cache_call_ends(allocations, stacks, structural=autograd_off)


def kv_cache_at_peak(ctx: DeviceContext) -> KVCache:
    """The KV cache alive at the peak; NONE where the run trains or shows none."""
    def measure() -> KVCache:
        a = ctx.allocations
        cached = a[cache_ends(a, ctx.trace.stacks, ctx.trace.grad_mode).notna()]
        if cached.empty:
            return NONE
        live = ctx.d.peak.live
        kept = live[live["alloc_id"].isin(cached["alloc_id"])]
        layers = block_paths(a["module"])[a["alloc_id"].isin(kept["alloc_id"])].dropna().nunique()
        return KVCache(int(kept["allocated_bytes"].sum()), len(kept), int(layers), quantized_cache(cached, ctx.trace.stacks))
    return ctx.memo("kv_cache", measure)


def _stream_cache_ends(stream: Stream) -> pd.Series:
    """cache_ends of a replay stream's rows (positions for sequence numbers, requested bytes for allocated)."""
    rows = stream.rows
    view = pd.DataFrame({"module": rows["module"], "phase": rows["phase"], "category": rows["category"],
                         "stack_id": rows["stack_id"], "seq_alloc": rows["at"].where(rows["at"] >= 0),
                         "seq_free": rows["until"], "allocated_bytes": rows["bytes"]}, index=rows.index)
    return cache_ends(view, stream.stacks, stream.grad_mode)


def uncached(stream: Stream) -> Stream:
    """use_cache=False: each of the cache's tensors is freed where the call that used it ended (its attention's,
    else its block's: attention.cache_call_ends)."""
    ends = _stream_cache_ends(stream)
    cached = ends.notna()
    if not cached.any():
        return stream
    rows = stream.rows.copy()
    rows.loc[cached, "until"] = np.minimum(rows.loc[cached, "until"], ends[cached] + NUDGE / 2)
    return stream.with_rows(rows)


def cache_scaled(stream: Stream, factor: float) -> Stream:
    """A cache of `factor` its size (int8 from 16 bits: 1/2): each of its tensors that share of its bytes."""
    cached = _stream_cache_ends(stream).notna()
    if not cached.any():
        return stream
    rows = stream.rows.copy()
    rows.loc[cached, "bytes"] = (rows.loc[cached, "bytes"] * factor).round().astype(np.int64)
    return stream.with_rows(rows)


def detect(ctx: DeviceContext, share: float = KV_CACHE_SHARE) -> list[KVCacheFinding]:
    if ctx.device < 0:
        return []           # host memory holds no KV cache a GPU remedy acts on
    found = kv_cache_at_peak(ctx)
    cache, peak = found.bytes, ctx.d.peak.allocated_bytes
    if not cache or cache < share * peak:
        return []
    live = ctx.d.peak.live
    what = f"K and V of {found.layers} layers" if found.layers >= 2 else f"{found.tensors} tensors"
    what += ", quantized already," if found.quantized else ""
    return [KVCacheFinding(
        severity="warning", bytes=cache,
        summary=(f"A KV cache holds {cache / peak:.0%} of the peak ({gib(cache)} of {gib(peak)}: {what} kept "
                    "across the forward, growing with the batch and the context)"),
        evidence=Evidence(time_us=[ctx.d.peak.time_us, ctx.d.peak.time_us], event_index=[ctx.d.peak.event_index] * 2,
                          allocations=top_allocations(ctx.trace, live[live["category"] == Category.ACTIVATION]),
                          details=KVCacheDetails(share=cache / peak, tensors=found.tensors, layers=found.layers,
                                                 quantized=found.quantized)),
    )]
