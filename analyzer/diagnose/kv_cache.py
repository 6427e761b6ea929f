"""A KV cache: a forward-only run keeps each layer's K and V across the forward (and the decode steps after it).

Named where the recording shows it (analyzer.diagnose.attention.cache_tensors: attention's tensors outliving
their block's call with autograd off, or a cache's update in the frames), in a run that shows no training (no
backward, optimizer step, gradients or optimizer state), and where the cache holds at least KV_CACHE_SHARE of
the peak. With autograd on (or not recorded) the kept tensors may be the autograd graph, which `no_grad`
addresses: only a cache's own frames name them a cache then.
"""
from __future__ import annotations

from dataclasses import dataclass

from analyzer.core.units import gib
from analyzer.core.vocabulary import Category, GradMode, Phase
from analyzer.diagnose.attention import block_of, cache_tensors, quantized_cache
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import top_allocations
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


def kv_cache_at_peak(ctx: DeviceContext) -> KVCache:
    """The KV cache alive at the peak; NONE where the run trains or shows none."""
    def measure() -> KVCache:
        a = ctx.allocations
        if a["phase"].astype(str).isin(_TRAINING_PHASES).any() or a["category"].astype(str).isin(_TRAINING_CATEGORIES).any():
            return NONE
        grad_mode = ctx.trace.grad_mode
        autograd_off = grad_mode is not None and GradMode(grad_mode).autograd_off
        cached = a[cache_tensors(a, ctx.trace.stacks, structural=autograd_off)]
        live = ctx.d.peak.live
        kept = live[live["alloc_id"].isin(cached["alloc_id"])]
        layers = kept["module"].astype(str).map(block_of).dropna().nunique()
        return KVCache(int(kept["allocated_bytes"].sum()), len(kept), int(layers), quantized_cache(cached, ctx.trace.stacks))
    return ctx.memo("kv_cache", measure)


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
