"""A job recorded as one file per rank, analysed rank by rank on Dask, and compared.

Each rank's analysis is independent, so the ranks run as tasks of a `dask.distributed` cluster: a
`LocalCluster` with one single-threaded worker per core by default, or the cluster at `scheduler` (or
`ANALYZER_DASK_SCHEDULER`) that the user already runs. A worker reads its rank's file itself and sends back only
what the report needs: the rank's JSON document, its report view (charts already reduced to a few thousand
points) and the summary of each device's peak for the comparison. No trace ever travels, so the driver's memory
does not grow with the job, and a worker holds one rank's file at a time. A rank whose file is bad is reported
as such and the others are still analysed.

Dask's workers run whatever task a client submits, and its clients unpickle what the scheduler sends: the local
cluster listens on loopback only (its HTTP endpoints too) and speaks TLS with credentials made for it alone
(`Security.temporary()`), so another user of the machine can neither submit to it nor read it; a `scheduler`
given is trusted as Dask trusts it, and is reached with the TLS settings of Dask's configuration for `tls://`.
"""
from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from analyzer.core.printable import printable, shorten
from analyzer.diagnose.imbalance import PeakSummary, find_imbalance, summarise
from analyzer.diagnose.thresholds import Thresholds
from analyzer.errors import AnalyzerError
from analyzer.ingest.ranks import RankFile, find_rank_files
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
from analyzer.result import Analysis, Claim, Finding, RankSetAnalysis, not_one_job, ranks_document

SCHEDULER_VARIABLE = "ANALYZER_DASK_SCHEDULER"
#: seconds to reach a scheduler given (a silent or wrong endpoint is told this soon)
CONNECT_SECONDS = 5
_SCHEDULER_ADDRESS = re.compile(r"(?:(tcp|tls)://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})")
#: devices of a job shown in full, the worst first (and the median one beside them); the others are rows of the
#: overview, so the report of 512 ranks stays as small as that of nine
SECTIONS_IN_FULL = 8


@dataclass(frozen=True)
class RankOptions:
    """What every rank is analysed with (sent to each worker)."""

    gpu_memory: int | None = None
    world_size: int | None = None
    source_roots: tuple[str, ...] = ()
    thresholds: Thresholds = Thresholds()


@dataclass(frozen=True)
class RankResult:
    """What comes back from one rank: never its trace."""

    label: str
    path: str
    rank: int | None
    document: dict[str, Any] | None = None      # the rank's analyzer/1 JSON
    view: ReportView | None = None
    pictures: dict[int, DevicePictures] = field(default_factory=dict)   # by the rank's own device numbers
    peaks: list[PeakSummary] = field(default_factory=list)
    error: str | None = None                    # the one-line reason the rank could not be analysed


@dataclass(frozen=True)
class JobAnalysis:
    """Every rank of a job, the worst first, and what sets the worst apart."""

    source_path: str
    ranks: list[RankResult]                     # in rank order
    imbalance: Finding | None
    warnings: list[str] = field(default_factory=list)
    separate: str | None = None                 # why the files are not the ranks of one job (None: they are)

    def to_json(self) -> dict[str, Any]:
        """One analyzer/1 document for the job: every device carries its rank; the comparison is `job`."""
        failed = [r for r in self.ranks if r.document is None]
        document = ranks_document(self.source_path, [r.rank for r in self.ranks],
                                  [(r.rank, r.label, r.document) for r in self.ranks if r.document is not None],
                                  [*self.warnings, *(f"{r.label}: not analysed: {r.error}" for r in failed)])
        document["job"] = {"imbalance": self.imbalance, "separate": self.separate,
                           "failed_ranks": [{"label": r.label, "path": r.path, "error": r.error} for r in failed]}
        return document


def _claim(r: RankResult) -> Claim:
    return Claim(Path(r.path).name if r.rank is None else r.label, r.rank,
                 r.view.input.world_size if r.view is not None else None)


def _as_job(source_path: str, results: list[RankResult], warnings: list[str],
            thresholds: Thresholds = Thresholds()) -> JobAnalysis:
    """The job of these results, or, when they are not one job's ranks, the files side by side: each named by
    its file, none compared with the others."""
    separate = not_one_job([_claim(r) for r in results])
    if separate is None:
        return JobAnalysis(source_path=source_path, ranks=results, warnings=warnings,
                           imbalance=find_imbalance([p for r in results for p in r.peaks], **thresholds.imbalance()))
    results = [replace(r, label=_file_label(r.path, source_path)) for r in results]
    return JobAnalysis(source_path=source_path, ranks=results, imbalance=None, warnings=warnings, separate=separate)


def _file_label(path: str, source_path: str) -> str:
    """A file's name in its folder (a member's, in an archive)."""
    if "!" in path and path.startswith(source_path):
        return path.rsplit("!", 1)[1]
    try:
        return str(Path(path).relative_to(source_path))
    except ValueError:
        return Path(path).name


def folded(said: Sequence[tuple[str, str]], total: int, noun: str) -> list[str]:
    """`label: warning` lines, a warning said alike by several ranks or files once, with who said it: the eight
    ranks of a trace without memory events give one line, not eight."""
    by_warning: dict[str, list[str]] = {}
    for label, warning in said:
        by_warning.setdefault(warning, []).append(label)
    lines = []
    for warning, labels in by_warning.items():
        if len(labels) == 1:
            who = labels[0]
        elif len(labels) == total:
            who = f"all {total} {noun}"
        else:
            who = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        lines.append(f"{who}: {warning}")
    return lines


def analyze_rank(file: RankFile, options: RankOptions) -> RankResult:
    """One rank, on a worker: read, analyse, keep what the report needs."""
    from analyzer.core.trace import MemoryTrace
    from analyzer.ingest import load
    from analyzer.pipeline import analyze_trace

    try:
        loaded = load(file.path)
        if not isinstance(loaded, MemoryTrace):
            raise AnalyzerError(file.path, "holds several ranks itself", "Point at one rank's file.")
        return rank_result(analyze_trace(loaded, options.gpu_memory, options.world_size,
                                         source_roots=options.source_roots, thresholds=options.thresholds),
                           file.rank, file.label)
    except AnalyzerError as error:
        return RankResult(file.label, str(file.path), file.rank, error=str(error))
    except Exception as error:  # a bug of ours on one rank must not cost the user the other ranks
        return RankResult(file.label, str(file.path), file.rank,
                          error=f"internal error ({type(error).__name__}: {error}); please report it")


def rank_result(analysis: Analysis, rank: int | None = None, label: str | None = None) -> RankResult:
    """What one rank's analysis contributes to the job's report (its rank: the file name's, else the trace's)."""
    rank = rank if rank is not None else analysis.trace.rank
    label = f"rank {rank}" if rank is not None else label or Path(analysis.trace.source_path).name
    peaks = [summarise(f"{label} {analysis.trace.device_label(d.device)}", d) for d in analysis.devices
             if d.device >= 0]
    pictures = {d.device: DevicePictures(allocator_pictures(d), module_icicle(d)) for d in analysis.devices}
    return RankResult(label, analysis.trace.source_path, rank, document=analysis.to_json(), view=build_view(analysis),
                      pictures=pictures, peaks=peaks)


def job_of(ranks: RankSetAnalysis) -> JobAnalysis:
    """The job of ranks already analysed in this process (a .tar.gz of traces, the Python API's result)."""
    return _as_job(ranks.source_path, [rank_result(a) for a in ranks.ranks], list(ranks.warnings))


def analyze_job(root: str | Path, options: RankOptions = RankOptions(), *, scheduler: str | None = None,
                workers: int | None = None, on_done: Callable[[RankResult, int], None] | None = None) -> JobAnalysis:
    """Every rank under `root`, analysed on Dask (see the module docstring); `on_done(result, ranks)` is called
    as each rank finishes (a progress bar counts them)."""
    address = scheduler or os.environ.get(SCHEDULER_VARIABLE) or None
    if address is not None:
        address = check_scheduler(address)
    found = find_rank_files(Path(root))
    total = len(found.files)
    done = None if on_done is None else (lambda result: on_done(result, total))
    results = _run(found.files, options, address, workers, done)
    results.sort(key=lambda r: (r.rank is None, r.rank or 0, r.path))
    return _as_job(str(root), results, found.warnings, options.thresholds)


def check_scheduler(address: str) -> str:
    """`address` if it is a Dask scheduler address the analyzer connects to (`tcp://` or `tls://` host:port, the
    scheme optional), else one error."""
    match = _SCHEDULER_ADDRESS.fullmatch(address.strip())
    if match is None or not 0 < int(match.group(3)) < 65536:
        raise AnalyzerError(None, f"--scheduler {printable(shorten(address, 200))!r} is not a Dask scheduler address",
                            "Pass tcp://HOST:PORT or tls://HOST:PORT (the address the scheduler prints), or "
                            f"unset {SCHEDULER_VARIABLE}.")
    return address.strip()


def local_cluster(workers: int) -> tuple[Any, Any]:
    """A LocalCluster of `workers` single-threaded processes on loopback alone (scheduler, workers and their HTTP
    endpoints), speaking TLS with credentials made for it, and the Security a client needs to reach it."""
    from dask.distributed import LocalCluster
    from distributed.security import Security

    security = Security.temporary()
    # no dashboard; the scheduler's own HTTP endpoints on a free port (its default, 8787, may be taken, and
    # distributed then warns on stderr), on loopback like everything else
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                           protocol="tls://", security=security, dashboard_address=None,
                           scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, silence_logs=50)
    return cluster, security


def _connect(address: str) -> Any:
    """A client of the scheduler at `address`, or one error when it does not answer as one within
    CONNECT_SECONDS. Dask bounds the connection but not the wait for the scheduler's handshake (an endpoint that
    accepts and stays silent would hang the client), so a first connection is made under a deadline."""
    from dask.distributed import Client
    from distributed.comm import connect
    from distributed.security import Security

    async def probe() -> None:
        comm = await connect(address, timeout=CONNECT_SECONDS, **Security().get_connection_args("client"))
        await comm.close()

    try:
        with ThreadPoolExecutor(1) as thread:   # its own event loop: the caller may be running one (a notebook)
            thread.submit(asyncio.run, asyncio.wait_for(probe(), CONNECT_SECONDS)).result()
        return Client(address, timeout=CONNECT_SECONDS)
    except (OSError, asyncio.TimeoutError, ValueError, TypeError) as error:
        raise AnalyzerError(None, f"the Dask scheduler at {printable(address)} did not answer as one within "
                            f"{CONNECT_SECONDS} s ({type(error).__name__})",
                            "Check the address, and that it is a cluster you run (tls:// needs Dask's TLS "
                            "settings).") from None


def _run(files: Sequence[RankFile], options: RankOptions, scheduler: str | None, workers: int | None,
         on_done: Callable[[RankResult], None] | None) -> list[RankResult]:
    from dask.distributed import Client, as_completed

    done: list[RankResult] = []
    if scheduler:
        client = _connect(scheduler)
        cluster = None
    else:
        cluster, security = local_cluster(max(1, min(workers or os.cpu_count() or 1, len(files))))
        client = Client(cluster, security=security)
    try:
        futures = {client.submit(analyze_rank, f, options, pure=False): f for f in files}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as error:  # the worker died (its memory limit, a signal): that rank alone is lost
                file = futures[future]
                result = RankResult(file.label, str(file.path), file.rank,
                                    error=f"the worker analysing it stopped ({type(error).__name__})")
            done.append(result)
            if on_done is not None:
                on_done(result)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return done


def job_report(job: JobAnalysis) -> JobReport:
    """One report for the job: every rank's devices, named by rank, the worst first (each keeps its verdict,
    breakdowns, findings, remedies and pictures), the comparison, and the warnings of the set and of each rank."""
    devices, said, rank_of, pictures_of = [], [], {}, {}
    for r in job.ranks:
        if r.view is None:
            said.append((r.label, f"not analysed: {r.error}"))
            continue
        said += [(r.label, w) for w in r.view.warnings]
        for d in r.view.devices:
            devices.append(replace(d, name=f"{r.label} {d.name}"))
            rank_of[devices[-1].name] = r.label
            pictures_of[devices[-1].name] = r.pictures.get(d.device, DevicePictures(None))
    # device numbers repeat across ranks (each counts its GPUs from 0): the job's report numbers them apart
    devices = [replace(d, device=i if d.device >= 0 else -1 - i) for i, d in enumerate(devices_worst_first(devices))]
    lead = next((d for d in devices if d.device >= 0), devices[0] if devices else None)
    analysed = sum(r.view is not None for r in job.ranks)
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
    eras = sorted({r.view.input.torch_era for r in job.ranks if r.view is not None and r.view.input.torch_era})
    kind = f"{len(job.ranks)} ranks" if job.separate is None else f"{len(job.ranks)} separate recordings"
    source = InputView(path=job.source_path, kind=kind, torch_era=", ".join(eras), has_history=any(
        r.view is not None and r.view.input.has_history for r in job.ranks), alloc_conf=None,
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


def _row(r: RankResult) -> RecordingRow:
    """One file's line in the table of separate recordings: its fullest GPU and its verdict."""
    if r.view is None:
        return RecordingRow(r.label, "not analysed", None, None, r.error or "")
    gpus = [d for d in r.view.devices if d.device >= 0]
    fullest = max(gpus, key=lambda d: d.peak_allocated_bytes, default=None)
    return RecordingRow(r.label, r.view.input.kind, None if fullest is None else fullest.peak_allocated_bytes,
                        None if fullest is None else fullest.name, r.view.verdict)
