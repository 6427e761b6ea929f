"""Findings (one detector a module), the theory check, ranked remedies and the one-sentence verdict.

Detectors read a DeviceContext and return finding dicts: kind, severity, bytes, summary, evidence (time
window, event window, allocations with their stacks, details). Order matters only for presentation: the OOM
first, then growth across steps, then what explains the peak. The triage (outside PyTorch, leak, phase spike
or steady state) and the workload (training, fine-tuning, forward only, mixed precision, GPUs) are decided
before the remedies and the verdict, which follow from them. Host memory (device -1 of a profiler trace)
beside a GPU is measured, never treated: GPU remedies do not act on it. A trace of host memory alone (a run
on the CPU) gets the remedies that are not the CUDA allocator's.
"""
from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

from analyzer.core.units import gib, human_bytes, rate_bytes
from analyzer.core.vocabulary import RECORD_HISTORY, UNATTRIBUTED, Category, Phase
from analyzer.diagnose import (
    activation_peak,
    checkpoint_gather,
    conv_workspace,
    counterfactual,
    fragmentation,
    kv_cache,
    leak,
    oom,
    optimizer_spike,
    outside,
    plan,
    reserved_growth,
)
from analyzer.diagnose.attention import attention_seen, score_tensors
from analyzer.diagnose.before_recording import UNSEEN_SHARE, unseen
from analyzer.diagnose.context import DeviceContext
from analyzer.diagnose.evidence import oom_where
from analyzer.diagnose.kv_cache import kv_cache_at_peak
from analyzer.diagnose.remedies import (
    LAYOUT_ONLY,
    RELEVANT_SHARE,
    SMALLEST_GPU,
    Demand,
    blocks_alive,
    checkpointable_bytes,
    count_layers,
    describe,
    fits_any_gpu,
    fits_as_is,
    rank_remedies,
    scores_relevant,
)
from analyzer.diagnose.theory import explain_model_states
from analyzer.diagnose.thresholds import Thresholds
from analyzer.diagnose.triage import triage
from analyzer.diagnose.workload import Workload, recognise
from analyzer.result import (
    ConvWorkspaceFinding,
    Details,
    DeviceMeasures,
    Diagnosis,
    Finding,
    Fits,
    FragmentationPicture,
    KVCacheFinding,
    LeakFinding,
    ListedRemedy,
    OomFinding,
    OptimizerSpikeFinding,
    Plan,
    RegimeCheck,
    Theory,
    Triage,
    first_of,
)

DETECTORS = [outside, oom, leak, reserved_growth, activation_peak, kv_cache, optimizer_spike, checkpoint_gather,
             fragmentation, conv_workspace]


def _tuned(t: Thresholds) -> dict[ModuleType, dict[str, Any]]:
    """Each detector's keyword arguments from the thresholds (a detector without thresholds takes none)."""
    return {outside: {"share": t.outside_share, "significant_share": t.outside_significant_share},
            oom: {"outside_share": t.oom_outside_share, "recovery_share": t.recovery_share},
            leak: {"level_agreement": t.leak_level_agreement, "min_share_of_peak": t.leak_min_share_of_peak},
            reserved_growth: {"min_share": t.reserved_growth_min_share},
            fragmentation: {"near_oom_share": t.near_oom_share, "recovery_share": t.recovery_share},
            kv_cache: {"share": t.kv_cache_share}, conv_workspace: {"share": t.conv_workspace_share}}
# what the request that failed would have been, by the phase it failed in
_REQUEST_CATEGORY: dict[str, str] = {
    Phase.FORWARD: Category.ACTIVATION.value, Phase.BACKWARD: Category.TEMPORARY.value,
    Phase.OPTIMIZER: Category.OPTIMIZER_STATE.value, Phase.LOAD: Category.PARAMETER.value,
    Phase.CHECKPOINT_SAVE: Category.OTHER.value}


def diagnose(ctx: DeviceContext, thresholds: Thresholds = Thresholds()) -> Diagnosis:
    """Findings, theory, fragmentation, triage, remedies and verdict of one device, each detector at its
    thresholds."""
    host = ctx.device < 0 and beside_a_gpu(ctx)
    tuned = _tuned(thresholds)
    findings: list[Finding[Details]] = [
        f for detector in DETECTORS if not (ctx.device < 0 and detector is fragmentation)
        for f in detector.detect(ctx, **tuned.get(detector, {}))]
    picture = fragmentation_picture(ctx)
    theory = theory_check(ctx)
    triaged = triage(ctx, findings)
    workload = recognise(ctx, gradient_share=thresholds.gradient_share, graph_kept_share=thresholds.graph_kept_share,
                         frozen_below=thresholds.frozen_below)
    demand = _demand(ctx, findings, theory, triaged["verdict"], picture, workload, tuned, thresholds.attention_share)
    offered = [] if host else [r["id"] for r in rank_remedies(demand)]
    replayer = counterfactual.replayer_for(ctx, demand)
    demand.replayed = counterfactual.replayed(ctx, replayer, offered)   # only what is offered is replayed
    remedies = [] if host else [r for r in rank_remedies(demand) if ctx.device >= 0 or r["id"] not in LAYOUT_ONLY]
    fits = _fits(demand)
    found = None if host or ctx.device < 0 else plan.for_recording(demand, remedies, replayer.again())
    plan.agree(remedies, found)
    return Diagnosis(findings=findings, remedies=remedies, theory=theory, fragmentation=picture, triage=triaged, plan=found,
                     demand_bytes=demand.total,
                     verdict=verdict(ctx, findings, remedies, demand, triaged, fits, found, thresholds.unseen_share),
                     capacity_bytes=ctx.capacity_bytes, capacity_source=ctx.capacity_source,
                     workload=workload.published(first_of(findings, KVCacheFinding) is not None), fits=fits)


def fragmentation_picture(ctx: DeviceContext) -> FragmentationPicture | None:
    """The allocator's picture the report shows: at the OOM, else at the peak (none for host memory)."""
    oom_event = ctx.d.oom
    if oom_event is not None:
        return fragmentation.fragmentation_at(ctx, oom_event.event_index, oom_event.requested_bytes)
    return fragmentation.fragmentation_at(ctx, ctx.d.peak.event_index) if ctx.device >= 0 else None


def beside_a_gpu(ctx: DeviceContext) -> bool:
    """The recording holds memory of a GPU besides this host device."""
    return bool((ctx.trace.allocations["device"] >= 0).any())


def _fits(d: Demand) -> Fits | None:
    """{peak, capacity, headroom} bytes when the run fits as it is (remedies.fits_as_is), else None; on an
    unknown device, the smallest GPU it fits any of (`capacity_assumed`: remedies.fits_any_gpu)."""
    if fits_any_gpu(d):
        return {"peak_bytes": d.total, "capacity_bytes": SMALLEST_GPU, "headroom_bytes": SMALLEST_GPU - d.total,
                "capacity_assumed": True}
    if not fits_as_is(d):
        return None
    assert d.capacity is not None  # fits_as_is needs it
    return {"peak_bytes": d.total, "capacity_bytes": d.capacity, "headroom_bytes": d.capacity - d.total}


def theory_check(ctx: DeviceContext) -> Theory:
    """Measured model states against 16Ψ, under each precision assumption, at their largest over the run."""
    most = {c: int(ctx.timeline[f"{c}_bytes"].max()) if f"{c}_bytes" in ctx.timeline else 0
            for c in (Category.PARAMETER.value, Category.GRADIENT.value, Category.OPTIMIZER_STATE.value,
                      Category.ACTIVATION.value)}
    measured = Theory(parameter_bytes=most[Category.PARAMETER], gradient_bytes=most[Category.GRADIENT],
                      optimizer_state_bytes=most[Category.OPTIMIZER_STATE], activation_bytes=most[Category.ACTIVATION],
                      notes=[])
    if not most[Category.PARAMETER]:
        return replace(measured, notes=["no parameters were identified, so model states cannot be checked against 16Ψ"])
    regimes = explain_model_states(most[Category.PARAMETER], most[Category.GRADIENT], most[Category.OPTIMIZER_STATE])
    agreeing = [r for r in regimes if r.agrees]
    notes = []
    if not most[Category.OPTIMIZER_STATE]:
        notes.append("no optimizer state was seen (inference, SGD without momentum, or the recording ended "
                     "before the first optimizer step)")
    elif not agreeing:
        notes.append(
            f"model states ({gib(regimes[0].measured_states_bytes)}) match neither 16Ψ for fp32 Adam "
            f"({gib(regimes[0].expected_states_bytes)}) nor for mixed-precision Adam ({gib(regimes[1].expected_states_bytes)}) "
            "within 10%: another optimizer, frozen parameters, or states not alive at once")
    return replace(measured, notes=notes, regime=agreeing[0].name if agreeing else None,
                   regimes=[RegimeCheck(r.name, r.parameters, r.expected_states_bytes, r.measured_states_bytes, r.agrees)
                            for r in regimes])


def _demand(ctx: DeviceContext, findings: list[Finding[Details]], theory: Theory, triaged: str,
            fragmentation: FragmentationPicture | None, workload: Workload, tuned: dict[ModuleType, dict[str, Any]],
            attention_share: float = RELEVANT_SHARE) -> Demand:
    """What the run needed: at an OOM, what was allocated plus the failed request; else the peak. Eager
    attention's tensors are worth fusing from `attention_share` of it."""
    d = ctx.d
    oom_finding = first_of(findings, OomFinding)
    leak_finding = first_of(findings, LeakFinding)
    spike = first_of(findings, OptimizerSpikeFinding)
    oom_event = d.oom if oom_finding is not None else None
    worst = oom_event.event_index if oom_event is not None else d.peak.event_index
    live = ctx.live_at(oom_event.event_index) if oom_event is not None else d.peak.live
    if oom_finding is not None:
        assert oom_event is not None  # the oom detector makes its finding only from the device's OOM
        by_category = live.groupby("category", observed=True)["allocated_bytes"].sum().to_dict()
        extra = _REQUEST_CATEGORY.get(oom_finding.phase or "", Category.OTHER.value)
        by_category[extra] = by_category.get(extra, 0) + oom_event.requested_bytes
        total = int(live["allocated_bytes"].sum()) + oom_event.requested_bytes
    else:
        by_category = {r["name"]: r["bytes"] for r in d.by_category}
        total = d.peak.allocated_bytes
    regime = theory.regime
    allocations = ctx.allocations
    scores = score_tensors(allocations, ctx.trace.stacks, "allocated_bytes")
    at_worst = live[live["alloc_id"].isin(allocations.loc[scores, "alloc_id"])]
    cache = kv_cache_at_peak(ctx) if first_of(findings, KVCacheFinding) else None
    return Demand(
        total=total, by_category={k: int(v) for k, v in by_category.items()}, capacity=ctx.capacity_bytes,
        world_size=workload.gpus, oomed=d.oom is not None, reserved_peak=d.reserved_peak_bytes,
        oom_phase=oom_finding.phase if oom_finding else None,
        workload=workload.kind, frozen_share=workload.frozen_share, graph_kept=workload.graph_kept,
        graph_bytes=max(0, _graph_bytes(live) - (cache.bytes if cache else 0)) if workload.graph_kept else 0, autocast=workload.mixed_precision_on,
        layers=count_layers([r["name"] for r in d.by_module] +
                                                       [str(m) for m in ctx.allocations["module"].unique()]),
        split_blocks=blocks_alive([str(m) for m in live["module"].unique()]), scatter_excess=ctx.scatter_excess,
        findings={f.kind.value for f in findings}, oom_verdict=oom_finding.verdict if oom_finding else None,
        mixed_precision=None if regime is None else regime.startswith("mixed"), checkpointable=checkpointable_bytes(live),
        first_step_excess=spike.first_step_excess_bytes if spike else None,
        lazy_state_trouble=bool(spike and spike.lazy_state_bytes and (
            spike.oom_in_first_step or (spike.first_step_excess_bytes or 0) > 0)),
        expandable_segments=ctx.expandable_segments(),
        recoverable_fragmentation=(0 if fragmentation is None else fragmentation.inactive_bytes
                                   if oom_finding and oom_finding.verdict == "fragmentation"
                                   else fragmentation.external_bytes or 0),
        triage=triaged, leak_bytes=leak.leaked_bytes_at(ctx, worst, **tuned[leak]),
        leak_stacks=[] if leak_finding is None else
        [f"{leak.place(s)}: +{rate_bytes(s['bytes_per_step'])} per step" for s in leak_finding.stacks],
        attention_scores={str(c): int(b) for c, b in
                          at_worst.groupby("category", observed=True)["allocated_bytes"].sum().items() if b},
        attention=attention_seen(allocations, ctx.trace.stacks, scores), attention_share=attention_share,
        kv_cache_bytes=cache.bytes if cache else 0, kv_cache_quantized=bool(cache and cache.quantized),
    )


def _graph_bytes(live: Any) -> int:
    """What running the forward without autograd would free: the activations alive, but the latest one (the
    output, which the caller keeps)."""
    activations = live[live["category"] == Category.ACTIVATION]
    if activations.empty:
        return 0
    latest = activations.loc[activations["t_alloc_us"].astype("float64").fillna(-1).idxmax(), "allocated_bytes"]
    return int(activations["allocated_bytes"].sum() - latest)


def verdict(ctx: DeviceContext, findings: list[Finding[Details]], remedies: list[ListedRemedy], demand: Demand,
            triaged: Triage, fits: Fits | None = None, found: Plan | None = None,
            unseen_share: float = UNSEEN_SHARE) -> str:
    """One sentence: what ran out, where, why, what to try first (nothing to try when the run fits); when no
    single change fits, the plan's changes in order; memory made before the recording first from `unseen_share`
    of the peak (before_recording.unseen)."""
    d = ctx.d
    if ctx.device < 0 and beside_a_gpu(ctx):
        label = ctx.trace.device_label(d.device)
        named = label if "host memory" in label.lower() else f"Host memory ({label})"   # not "Host memory (CPU (host memory))"
        return f"{named}: peak {gib(d.peak.allocated_bytes)} allocated; GPU remedies do not act on it"
    return _sentence(ctx, findings, remedies, demand, triaged, fits, found, unseen_share) + _lower_bound(ctx)


def _lower_bound(ctx: DeviceContext) -> str:
    """What a recording without the memory alive before it cannot say (a 2021 profiler trace: no running total)."""
    info = ctx.trace.devices.get(ctx.device)
    if info is None or info.before_recorded:
        return ""
    return (" The recording does not say what was alive before it began (weights, gradients and optimizer state "
            "made earlier are not in it): every peak here is a lower bound.")


def _sentence(ctx: DeviceContext, findings: list[Finding[Details]], remedies: list[ListedRemedy], demand: Demand,
              triaged: Triage, fits: Fits | None, found: Plan | None, unseen_share: float) -> str:
    """The verdict's sentence for a GPU, from what the recording holds."""
    d = ctx.d
    first = next((r for r in remedies if r["try_first"]), None)
    advice = f" Try first: {describe(first, demand.capacity)}." if first else ""
    if found is not None and found["fits"] and not found["single"] and demand.capacity:
        advice = f" Try first, as the plan below: {_plan_clause(found, remedies, demand)}."
    if fits is not None and fits.get("capacity_assumed"):
        advice = (f" Fits any GPU of {gib(fits['capacity_bytes'])} or more (peak {gib(fits['peak_bytes'])}; pass "
                  "--gpu-memory for the headroom on yours)" + ("; the remedies listed are optional ways to grow the "
                                                              "batch or the model." if remedies else "."))
    elif fits is not None:
        advice = (f" Fits: peak {gib(fits['peak_bytes'])} of {gib(fits['capacity_bytes'])}, "
                  f"{gib(fits['headroom_bytes'])} headroom" + ("; the remedies listed are optional ways to grow the "
                                                             "batch or the model." if remedies else "."))
    elif first is not None and demand.capacity is None and d.oom is None:
        advice = (f" The device's memory is not known (pass --gpu-memory); to lower the peak, try first: "
                  f"{describe(first, None)}.")
    oom_finding = first_of(findings, OomFinding)
    where = "" if oom_finding is None else oom_where(oom_finding.phase, oom_finding.module, oom_finding.step)
    leak_finding = first_of(findings, LeakFinding)
    if leak_finding is not None and triaged["verdict"] == "leak":
        opening = f"Out of memory on {ctx.trace.device_label(d.device)}{' ' + where if where else ''}" if oom_finding else \
            f"Memory grows on {ctx.trace.device_label(d.device)}"
        return f"{opening}: a leak, not the size of the work: {_leak_clause(leak_finding)}.{advice}"
    if oom_finding is not None:
        reason = _oom_reason(oom_finding)
        composition = _composition(d, findings, demand)
        return (f"Out of memory on {ctx.trace.device_label(d.device)}{' ' + where if where else ''}: {reason}"
                f"{'; ' + composition if composition else ''}.{advice}")
    picture = fragmentation_picture(ctx)
    if not ctx.trace.has_history and picture and picture.segments_recorded:
        return _end_state_sentence(ctx, picture) + advice
    place = oom_where(d.peak_phase, d.peak_module, d.peak_step)
    before, record_earlier = unseen(ctx, unseen_share)
    composition = "; ".join(w for w in (before, _composition(d, findings, demand)) if w)
    return (f"Peak {gib(d.peak.allocated_bytes)} allocated on {ctx.trace.device_label(d.device)}{' ' + place if place else ''}"
            f"{': ' + composition if composition else ''}.{advice}{record_earlier}")


def _composition(d: DeviceMeasures, findings: list[Finding[Details]], demand: Demand | None = None) -> str:
    """What the peak is made of, in words: the largest known category, or the transient no tensor holds that
    the conv_workspace finding names; then what the kv_cache finding names, and eager attention's s x s tensors
    where fused attention is offered for them (remedies.scores_relevant: Thresholds.attention_share)."""
    workspace = first_of(findings, ConvWorkspaceFinding)
    if workspace is not None:
        return (f"{workspace.evidence.details.share:.0%} of it is a transient no tensor holds, most likely "
                "cuDNN's convolution workspace")
    words = [d.composition()]
    cache = first_of(findings, KVCacheFinding)
    top = next((r for r in d.by_category if r["name"] != UNATTRIBUTED), None)
    if cache is not None and top is not None and top["name"] == Category.ACTIVATION and cache.bytes >= 0.9 * top["bytes"]:
        words = []          # the activations are the cache: said once
    if cache is not None:
        words.append(f"a KV cache holds {gib(cache.bytes)} of it ({cache.evidence.details.share:.0%})")
    scores = sum(demand.attention_scores.values()) if demand is not None else 0
    if demand is not None and scores_relevant(demand):
        words.append(f"eager attention's s x s scores and probabilities hold {gib(scores)} of it "
                     f"({scores / demand.total:.0%}), which fused attention never keeps")
    return "; ".join(w for w in words if w)


def _end_state_sentence(ctx: DeviceContext, picture: FragmentationPicture) -> str:
    """What a snapshot without a history can tell (its end state): allocated and reserved, what is cached but
    free and the largest free block; what the free part means if the dump came from an OOM (at least
    fragmentation.RECOVERY_THRESHOLD of the reserve free: fragmentation, which expandable segments remove,
    unless they are on); and the line that records what made the peak."""
    reserved, free = picture.reserved_bytes, picture.inactive_bytes
    share = free / reserved if reserved else 0.0
    largest = picture.largest_free_block_bytes
    composition = ctx.d.composition()
    said = (f"{gib(picture.allocated_bytes)} allocated on {ctx.trace.device_label(ctx.device)} when the snapshot "
            f"was taken{': ' + composition if composition else ''}. No allocation history was recorded, so what made "
            f"it, and any higher peak before, are not known; {gib(free)} ({share:.0%}) of the {gib(reserved)} "
            "reserved is cached but free")
    if picture.external_bytes is not None and picture.cached_free_segments_bytes is not None:
        said += (f" ({gib(picture.external_bytes)} in pieces inside used segments, "
                 f"{gib(picture.cached_free_segments_bytes)} in whole free segments)")
    if largest is not None:
        said += f", the largest free block {human_bytes(largest)}"
    if share < fragmentation.RECOVERY_THRESHOLD:
        meaning = "If this dump came from an out-of-memory error, the work itself did not fit: little is free."
    elif picture.expandable_segments:
        meaning = ("If this dump came from an out-of-memory error, it is not fragmentation of fixed blocks "
                   "(expandable segments are on): look for memory outside PyTorch.")
    else:
        meaning = ("If this dump came from an out-of-memory error, that free memory is fragmentation (the "
                   "allocator releases whole free segments and retries before it gives up, so what failed was a "
                   "request larger than the largest free block): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    return (f"{said}. {meaning} To see what made the peak, call {RECORD_HISTORY} before the step and dump the "
            "snapshot again.")


def _plan_clause(found: Plan, remedies: list[ListedRemedy], demand: Demand) -> str:
    """'Halve the micro-batch, then ZeRO-1 … (peak 30 → 20 GiB, fits in 24 GiB); no single change fits', or
    '…; cheaper together than ZeRO-3 alone': the plan's changes in order, and why it is not one change."""
    assert demand.capacity is not None  # a plan needs the device
    steps = found["steps"]
    single = next((r for r in remedies if r["id"] == found.get("cheapest_single")), None)
    together = " together" if len(steps) > 1 else ""
    why = (f"cheaper{together} than {single['title']} alone" if single is not None
           else "no single change fits" if together else "no change as listed fits")
    return (f"{', then '.join(s['title'] for s in steps)} (peak {gib(demand.total)} → "
            f"{gib(steps[-1]['predicted_peak_allocated_bytes'])}, fits in {gib(demand.capacity)}); {why}")


def _oom_reason(finding: OomFinding) -> str:
    """Why the OOM happened, with the numbers that show it (story 4: plenty of free memory, still OOM)."""
    facts = finding.evidence.details
    if finding.verdict == "fragmentation":
        setting = facts.expandable_segments
        expandable = "on" if setting is True else "off" if setting is False else "not recorded"
        return (f"fragmentation, not capacity (reserved {gib(facts.reserved_bytes)}, allocated "
                f"{gib(facts.allocated_bytes)}, largest free block {gib(facts.largest_free_block_bytes)} < the "
                f"{gib(facts.requested_bytes)} request; expandable_segments {expandable})")
    if finding.verdict == "outside_pytorch":
        return f"memory outside PyTorch ({gib(facts.outside_pytorch_bytes)} neither free nor PyTorch's)"
    return "the work does not fit"


def _leak_clause(finding: LeakFinding) -> str:
    """'+500.0 MiB per step, allocated at train.py:88 (…) and 2 more places; out of memory in about 34 more
    steps at this rate (step 40); a smaller batch only delays it'."""
    return (f"+{rate_bytes(finding.bytes_per_step)} per step, {leak.origin(finding.stacks, finding.stack_count)}"
            f"{leak.runway(finding.steps_to_oom, finding.oom_step)}; a smaller batch only delays it")
