"""What the report shows of a job of ranks: each rank's view and pictures, made on the worker that analysed it
(`rank_shown`, the `show` that analyzer.job runs there: only what renders travels back, never a trace), and the
job's one report merged from them (`job_report`). Here, in the commands' layer, because the job orchestrates and
renders nothing."""
from __future__ import annotations

from dataclasses import dataclass, replace

from analyzer.job import JobAnalysis, RankResult, folded
from analyzer.report.interactive import allocator_pictures, module_icicle
from analyzer.report.job_report import DevicePictures, JobReport
from analyzer.report.view import (
    InputView,
    RecordingRow,
    ReportView,
    build_view,
    comparison_view,
    with_imbalance,
    worst_first as devices_worst_first,
)
from analyzer.result import Analysis

#: devices of a job shown in full, the worst first (and the median one beside them); the others are rows of the
#: overview, so the report of 512 ranks stays as small as that of nine
SECTIONS_IN_FULL = 8


@dataclass(frozen=True)
class RankShown:
    """What the report draws of one rank: its view and, by the rank's own device numbers, its pictures."""

    view: ReportView
    pictures: dict[int, DevicePictures]


def rank_shown(analysis: Analysis) -> RankShown:
    """One rank's view and pictures, made where its trace is."""
    return RankShown(build_view(analysis), {d.device: DevicePictures(allocator_pictures(d), module_icicle(d))
                                            for d in analysis.devices})


def job_report(job: JobAnalysis[RankShown]) -> JobReport:
    """One report for the job: every rank's devices, named by rank, the worst first (each keeps its verdict,
    breakdowns, findings, remedies and pictures), the comparison, and the warnings of the set and of each rank."""
    devices, said, rank_of, pictures_of = [], [], {}, {}
    for r in job.ranks:
        if r.shown is None:
            said.append((r.label, f"not analysed: {r.error}"))
            continue
        said += [(r.label, w) for w in r.shown.view.warnings]
        for d in r.shown.view.devices:
            devices.append(replace(d, name=f"{r.label} {d.name}"))
            rank_of[devices[-1].name] = r.label
            pictures_of[devices[-1].name] = r.shown.pictures.get(d.device, DevicePictures(None))
    # device numbers repeat across ranks (each counts its GPUs from 0): the job's report numbers them apart
    devices = [replace(d, device=i if d.device >= 0 else -1 - i) for i, d in enumerate(devices_worst_first(devices))]
    lead = next((d for d in devices if d.device >= 0), devices[0] if devices else None)
    analysed = sum(r.shown is not None for r in job.ranks)
    noun = "ranks" if job.separate is None else "files"
    warnings = list(job.warnings) + folded(said, len(job.ranks), noun)
    if lead is not None:
        verdict = with_imbalance(f"{rank_of[lead.name]}: {lead.verdict}", job.imbalance, lead.name)
    elif analysed:
        verdict = (f"None of the {analysed} {noun} analysed recorded any memory (see the warnings: a profiler trace "
                   "needs profile_memory=True).")
    else:
        verdict = f"No {noun[:-1]} could be analysed (see the warnings)."
    if job.separate is not None:
        verdict = (f"{len(job.ranks)} separate recordings, not the ranks of one job ({job.separate}): each is "
                   f"analysed on its own." + (f" The fullest, {verdict}" if lead is not None else f" {verdict}"))
    ranks = [r.rank for r in job.ranks if r.rank is not None]
    eras = sorted({r.shown.view.input.torch_era for r in job.ranks if r.shown is not None and r.shown.view.input.torch_era})
    kind = f"{len(job.ranks)} ranks" if job.separate is None else f"{len(job.ranks)} separate recordings"
    source = InputView(path=job.source_path, kind=kind, torch_era=", ".join(eras), has_history=any(
        r.shown is not None and r.shown.view.input.has_history for r in job.ranks), alloc_conf=None,
        expandable_segments=None, settings=[], devices=[], rank=None,
        world_size=(len(ranks) or None) if job.separate is None else None)
    gpus = [d for d in devices if d.device >= 0]
    sections = None
    if len(devices) > SECTIONS_IN_FULL + 1:
        median = sorted(gpus, key=lambda d: d.peak_allocated_bytes)[(len(gpus) - 1) // 2] if gpus else None
        sections = [d.device for d in devices[:SECTIONS_IN_FULL]] + ([median.device] if median else [])
    view = ReportView(verdict=verdict, devices=devices, input=source, warnings=warnings,
                      lead_device=lead.device if lead is not None else None, comparison=comparison_view(job.imbalance),
                      sections=sections, recordings=None if job.separate is None else [_row(r) for r in job.ranks])
    return JobReport(view=view, document=job.to_json(), pictures={d.device: pictures_of[d.name] for d in devices})


def _row(r: RankResult[RankShown]) -> RecordingRow:
    """One file's line in the table of separate recordings: its fullest GPU and its verdict."""
    if r.shown is None:
        return RecordingRow(r.label, "not analysed", None, None, r.error or "")
    gpus = [d for d in r.shown.view.devices if d.device >= 0]
    fullest = max(gpus, key=lambda d: d.peak_allocated_bytes, default=None)
    return RecordingRow(r.label, r.shown.view.input.kind, None if fullest is None else fullest.peak_allocated_bytes,
                        None if fullest is None else fullest.name, r.shown.view.verdict)
