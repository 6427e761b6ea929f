"""Imbalance across GPUs or ranks: one peaks far above the others, and the breakdowns say what makes the gap.

Large jobs run out of memory on one rank of many. The worst peak is compared with the median one (the device or
rank whose peak is the median of all): the category and the module that hold most of the difference say why
(an uneven scatter of the batch makes activations, an unevenly split model makes parameters, gradients and
optimizer state, DataParallel's replicas and gathered outputs sit on the first GPU), and the remedies follow from
that category and from the device that is heavy. Under nn.DataParallel (its replicas seen on some device) the
device without a replica is the one it scatters from and gathers to, which holds the model's own copy: only
when that device is the heavy one is DataParallel's first GPU the reason; a heavy replica device with more
activations in the same code got a larger share of the inputs (DataParallel splits a batch by count, not by
size). Pipeline stages are advised only without DataParallel (every GPU then holds the whole model) and where
the model shows PIPELINE_MIN_LAYERS repeated blocks to split. The comparison needs only each peak's breakdowns, so it runs on summaries that travel back from
the workers of a distributed analysis (`PeakSummary`), never on whole traces. Ranks are lined up by step: the
worst peak's step is compared with the same step on the median rank (steps from ProfilerStep#N and step labels).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from analyzer.core.module_tree import module_in_sentence
from analyzer.core.units import gib
from analyzer.core.vocabulary import UNATTRIBUTED, Category, category_plural
from analyzer.diagnose.remedies import PIPELINE_MIN_LAYERS, count_layers
from analyzer.result import DeviceMeasures, Evidence, ImbalanceDetails, ImbalanceFinding

#: the worst peak over the median peak from which the spread is a finding, and the least gap in bytes (two small
#: devices that differ by 2x are no story)
IMBALANCE_RATIO = 1.5
MIN_GAP_BYTES = 256 * 2**20
#: a device whose peak is under this share of the largest one only holds a context or a workspace: it is idle,
#: not a rank that got less work (a run on cuda:1 that leaves cuda:0 empty is not imbalanced)
IDLE_SHARE = 0.02

_MODEL_STATES = {Category.PARAMETER.value, Category.GRADIENT.value, Category.OPTIMIZER_STATE.value}
_BATCH = (Category.ACTIVATION.value, Category.INPUT.value, Category.TEMPORARY.value)   # what a batch's split moves
SCATTER = "uneven_scatter"   # the `cause` of an imbalance made by nn.DataParallel's split of a batch by count


@dataclass(frozen=True)
class PeakSummary:
    """One device's peak as the comparison needs it: what travels back from a worker for each device."""

    label: str                       # 'cuda:1' or 'rank 12 cuda:0'
    peak_bytes: int
    oom: bool
    by_category: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, int] = field(default_factory=dict)
    peak_step: int | None = None
    peak_phase: str | None = None
    data_parallel_replicas: bool = False   # DataParallel's replicate made parameters on this device
    layers: int | None = None              # repeated blocks seen in its module names (remedies.count_layers)
    step_peaks: dict[int, int] = field(default_factory=dict)   # step -> its peak allocated bytes


def summarise(label: str, d: DeviceMeasures) -> PeakSummary:
    """The PeakSummary of one measured device (before its diagnosis, which the imbalance informs)."""
    live = d.peak.live
    replicas = bool(len(live)) and "label_source" in live and bool(
        live["label_source"].astype(str).str.contains("frames:data-parallel-replica", regex=False).any())
    return PeakSummary(label=label, peak_bytes=int(d.peak.allocated_bytes), oom=d.oom is not None,
                       by_category={r["name"]: int(r["bytes"]) for r in d.by_category},
                       by_module={r["name"]: int(r["bytes"]) for r in d.by_module},
                       peak_step=d.peak_step, peak_phase=d.peak_phase, data_parallel_replicas=replicas,
                       layers=count_layers([r["name"] for r in d.by_module]),
                       step_peaks={int(s["step"]): int(s["peak_allocated_bytes"]) for s in d.steps
                                   if s.get("step") is not None})


def worst_first(peaks: Sequence[PeakSummary]) -> list[PeakSummary]:
    """Out-of-memory devices first, then by peak, largest first: the order a report shows them in."""
    return sorted(peaks, key=lambda p: (not p.oom, -p.peak_bytes))


def find_imbalance(peaks: Sequence[PeakSummary], *, ratio: float = IMBALANCE_RATIO, min_gap_bytes: int = MIN_GAP_BYTES,
                   idle_share: float = IDLE_SHARE) -> ImbalanceFinding | None:
    """The `imbalance` finding, or None when the peaks are even (or there is only one): the worst peak is at
    least `ratio` times the median one and `min_gap_bytes` above it, among the devices whose peak is at least
    `idle_share` of the largest."""
    largest = max((p.peak_bytes for p in peaks), default=0)
    peaks = [p for p in peaks if p.peak_bytes >= idle_share * largest]  # an idle GPU is not part of the job
    if len(peaks) < 2:
        return None
    median_bytes = statistics.median_low(p.peak_bytes for p in peaks)  # a device's own peak (lower of two)
    worst = max(peaks, key=lambda p: (p.oom, p.peak_bytes))
    gap = worst.peak_bytes - median_bytes
    if worst.peak_bytes < ratio * median_bytes or gap < min_gap_bytes:
        return None
    median = min((p for p in peaks if p.peak_bytes == median_bytes), key=lambda p: p.label)
    category, category_gap = _largest_gap(worst.by_category, median.by_category)
    data_parallel = any(p.data_parallel_replicas for p in peaks)
    scattered = bool(data_parallel and worst.data_parallel_replicas and category in _BATCH)
    module, module_gap = _largest_gap(worst.by_module, median.by_module)
    ratio = round(worst.peak_bytes / median_bytes, 3)   # the one value every sentence formats (never 2.1x, then 2.2x)
    why = f"{category_plural(category)} make {gib(category_gap)} of the difference" if category else ""
    if module:
        why += f"{', most in ' if why else ''}{module_in_sentence(module)} ({gib(module_gap)})"
    # ranks lined up by step: the worst one's peak step against the same step on the median one
    same_step = median.step_peaks.get(worst.peak_step) if worst.peak_step is not None else None
    if same_step is not None:
        why += f"{'; ' if why else ''}in step {worst.peak_step} {median.label} peaked at {gib(same_step)}"
    return ImbalanceFinding(
        severity="warning", bytes=int(gap),
        summary=(f"{worst.label} peaks at {gib(worst.peak_bytes)}, {ratio:.1f}x the median "
                 f"({median.label}, {gib(median.peak_bytes)}){': ' + why if why else ''}"),
        evidence=Evidence(details=ImbalanceDetails(
            worst=worst.label, median=median.label, ratio=ratio,
            worst_peak_bytes=worst.peak_bytes, median_peak_bytes=int(median.peak_bytes),
            category=category, category_gap_bytes=category_gap,
            module=module, module_gap_bytes=module_gap,
            step=worst.peak_step, median_at_that_step_bytes=same_step,
            cause=SCATTER if scattered else None,
            peaks=[{"label": p.label, "peak_bytes": p.peak_bytes, "oom": p.oom, "peak_step": p.peak_step,
                    "peak_phase": p.peak_phase} for p in worst_first(peaks)])),
        remedies=_remedies(category, category_gap, worst, median, module, data_parallel, scattered),
    )


def scatter_excess(finding: ImbalanceFinding | None, peaks: Sequence[PeakSummary]) -> dict[str, int]:
    """Each device's batch memory (activations, inputs, temporaries at its peak) above the mean of the devices in
    the job, where the imbalance is nn.DataParallel's scatter by count: what an even split would take off it."""
    if finding is None or finding.evidence.details.cause != SCATTER:
        return {}
    labels = {p["label"] for p in finding.evidence.details.peaks}
    batch = {p.label: sum(p.by_category.get(c, 0) for c in _BATCH) for p in peaks if p.label in labels}
    mean = sum(batch.values()) / len(batch)
    return {label: int(b - mean) for label, b in batch.items() if b > mean}


def _largest_gap(worst: dict[str, int], median: dict[str, int]) -> tuple[str | None, int]:
    """The attributed label that holds the most bytes more on the worst device than on the median one."""
    gaps = {name: b - median.get(name, 0) for name, b in worst.items() if name != UNATTRIBUTED}
    if not gaps:
        return None, 0
    name = max(gaps, key=lambda n: (gaps[n], n))
    return (name, int(gaps[name])) if gaps[name] > 0 else (None, 0)


def _remedies(category: str | None, gap: int, worst: PeakSummary, median: PeakSummary, module: str | None,
              data_parallel: bool, scattered: bool) -> list[str]:
    """What evens the load, for the category that makes the difference and the device that is heavy (`scattered`:
    nn.DataParallel's split by count made it heavy, the finding's SCATTER cause)."""
    first = []
    if data_parallel and not worst.data_parallel_replicas or (
            not data_parallel and category == Category.ACTIVATION and worst.label.startswith("cuda:0")):
        first = [f"Use DistributedDataParallel instead of nn.DataParallel: DataParallel gathers outputs and keeps "
                 f"the master copy of the model on the GPU it scatters from{' (' + worst.label + ')' if data_parallel else ''}"]
    pipelined = not data_parallel and (worst.layers or 0) >= PIPELINE_MIN_LAYERS
    if category in _MODEL_STATES:
        return first + ["Shard the model states evenly (FSDP / ZeRO) instead of placing whole layers per GPU"] + (
            ["Balance the pipeline stages: give the stage that holds the embedding or the LM head fewer layers"]
            if pipelined else [])
    if scattered:
        same_code = f" in the same code ({module_in_sentence(module)})" if module and module in median.by_module else ""
        return [f"Split each batch by size, not by count: {worst.label} holds {gib(gap)} more "
                f"{category_plural(str(category))} than {median.label}{same_code}, so nn.DataParallel's even split by count gave it inputs that need far "
                "more memory (graphs or sequences of very different sizes); bucket the samples so every GPU gets the "
                "same number of nodes or tokens",
                "Use DistributedDataParallel (one process a GPU, each with its own batch) with a sampler that "
                "balances the batches by size"]
    if category in (Category.ACTIVATION.value, Category.TEMPORARY.value):
        return first + ["Give every GPU the same share of the batch: an uneven scatter (samples, graphs or "
                        "sequences of very different sizes) makes one GPU's activations larger"] + (
            ["Balance the pipeline stages: the first stage keeps the most micro-batches in flight"] if pipelined else [])
    return first + ["Compare the worst rank's report with the median rank's to see what it holds more of"]
