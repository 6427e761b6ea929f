"""A job recorded as one file per rank, analysed rank by rank on Dask, and compared.

Each rank's analysis is independent, so the ranks run as tasks of a `dask.distributed` cluster: a
`LocalCluster` with one single-threaded worker per core by default, or the cluster at `scheduler` (or
`ANALYZER_DASK_SCHEDULER`) that the user already runs. A worker reads its rank's file itself and sends back only
what the report needs: the rank's JSON document, what the command's `show` makes of it (its report view, charts
already reduced to a few thousand points: analyzer.commands.job_view) and the summary of each device's peak for
the comparison. No trace ever travels, so the driver's memory
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
from typing import Any, Generic, TypeVar

from analyzer.core.printable import printable, shorten
from analyzer.diagnose.imbalance import PeakSummary, find_imbalance, summarise
from analyzer.diagnose.thresholds import Thresholds
from analyzer.errors import AnalyzerError
from analyzer.ingest.ranks import RankFile, find_rank_files
from analyzer.result import Analysis, Claim, ImbalanceFinding, RankSetAnalysis, not_one_job, ranks_document

SCHEDULER_VARIABLE = "ANALYZER_DASK_SCHEDULER"
#: seconds to reach a scheduler given (a silent or wrong endpoint is told this soon)
CONNECT_SECONDS = 5
_SCHEDULER_ADDRESS = re.compile(r"(?:(tcp|tls)://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})")
#: what a worker makes of its rank for the report (the command's `show`: the job itself renders nothing)
S = TypeVar("S")


@dataclass(frozen=True)
class RankOptions:
    """What every rank is analysed with (sent to each worker)."""

    gpu_memory: int | None = None
    world_size: int | None = None
    source_roots: tuple[str, ...] = ()
    thresholds: Thresholds = Thresholds()


@dataclass(frozen=True)
class RankResult(Generic[S]):
    """What comes back from one rank: never its trace."""

    label: str
    path: str
    rank: int | None
    document: dict[str, Any] | None = None      # the rank's analyzer/1 JSON
    shown: S | None = None                      # what `show` made of the rank's analysis, on its worker
    world_size: int | None = None               # what the rank's trace says of the job
    peaks: list[PeakSummary] = field(default_factory=list)
    error: str | None = None                    # the one-line reason the rank could not be analysed


@dataclass(frozen=True)
class JobAnalysis(Generic[S]):
    """Every rank of a job, the worst first, and what sets the worst apart."""

    source_path: str
    ranks: list[RankResult[S]]                  # in rank order
    imbalance: ImbalanceFinding | None
    warnings: list[str] = field(default_factory=list)
    separate: str | None = None                 # why the files are not the ranks of one job (None: they are)

    def to_json(self) -> dict[str, Any]:
        """One analyzer/1 document for the job: every device carries its rank; the comparison is `job`."""
        failed = [r for r in self.ranks if r.document is None]
        document = ranks_document(self.source_path, [r.rank for r in self.ranks],
                                  [(r.rank, r.label, r.document) for r in self.ranks if r.document is not None],
                                  [*self.warnings, *(f"{r.label}: not analysed: {r.error}" for r in failed)])
        document["job"] = {"imbalance": None if self.imbalance is None else self.imbalance.to_json(), "separate": self.separate,
                           "failed_ranks": [{"label": r.label, "path": r.path, "error": r.error} for r in failed]}
        return document


def _claim(r: RankResult[S]) -> Claim:
    return Claim(Path(r.path).name if r.rank is None else r.label, r.rank, r.world_size)


def _as_job(source_path: str, results: list[RankResult[S]], warnings: list[str],
            thresholds: Thresholds = Thresholds()) -> JobAnalysis[S]:
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


def analyze_rank(file: RankFile, options: RankOptions, show: Callable[[Analysis], S]) -> RankResult[S]:
    """One rank, on a worker: read, analyse, keep what the report needs (`show`)."""
    from analyzer.core.trace import MemoryTrace
    from analyzer.ingest import load
    from analyzer.pipeline import analyze_trace

    try:
        loaded = load(file.path)
        if not isinstance(loaded, MemoryTrace):
            raise AnalyzerError(file.path, "holds several ranks itself", "Point at one rank's file.")
        return rank_result(analyze_trace(loaded, options.gpu_memory, options.world_size,
                                         source_roots=options.source_roots, thresholds=options.thresholds),
                           show, file.rank, file.label)
    except AnalyzerError as error:
        return RankResult(file.label, str(file.path), file.rank, error=str(error))
    except Exception as error:  # a bug of ours on one rank must not cost the user the other ranks
        return RankResult(file.label, str(file.path), file.rank,
                          error=f"internal error ({type(error).__name__}: {error}); please report it")


def rank_result(analysis: Analysis, show: Callable[[Analysis], S], rank: int | None = None,
                label: str | None = None) -> RankResult[S]:
    """What one rank's analysis contributes to the job's report (its rank: the file name's, else the trace's)."""
    rank = rank if rank is not None else analysis.trace.rank
    label = f"rank {rank}" if rank is not None else label or Path(analysis.trace.source_path).name
    peaks = [summarise(f"{label} {analysis.trace.device_label(d.device)}", d) for d in analysis.devices
             if d.device >= 0]
    return RankResult(label, analysis.trace.source_path, rank, document=analysis.to_json(), shown=show(analysis),
                      world_size=analysis.trace.world_size, peaks=peaks)


def job_of(ranks: RankSetAnalysis, show: Callable[[Analysis], S]) -> JobAnalysis[S]:
    """The job of ranks already analysed in this process (a .tar.gz of traces, the Python API's result)."""
    return _as_job(ranks.source_path, [rank_result(a, show) for a in ranks.ranks], list(ranks.warnings))


def analyze_job(root: str | Path, show: Callable[[Analysis], S], options: RankOptions = RankOptions(), *,
                scheduler: str | None = None, workers: int | None = None,
                on_done: Callable[[RankResult[S], int], None] | None = None) -> JobAnalysis[S]:
    """Every rank under `root`, analysed on Dask (see the module docstring), `show` making on each worker what the
    report needs of its rank (a module-level function: it travels by name); `on_done(result, ranks)` is called
    as each rank finishes (a progress bar counts them)."""
    address = scheduler or os.environ.get(SCHEDULER_VARIABLE) or None
    if address is not None:
        address = check_scheduler(address)
    found = find_rank_files(Path(root))
    total = len(found.files)
    done = None if on_done is None else (lambda result: on_done(result, total))
    results = _run(found.files, options, show, address, workers, done)
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


def _run(files: Sequence[RankFile], options: RankOptions, show: Callable[[Analysis], S], scheduler: str | None,
         workers: int | None, on_done: Callable[[RankResult[S]], None] | None) -> list[RankResult[S]]:
    from dask.distributed import Client, as_completed

    done: list[RankResult[S]] = []
    if scheduler:
        client = _connect(scheduler)
        cluster = None
    else:
        cluster, security = local_cluster(max(1, min(workers or os.cpu_count() or 1, len(files))))
        client = Client(cluster, security=security)
    try:
        futures = {client.submit(analyze_rank, f, options, show, pure=False): f for f in files}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as error:  # the worker died (its memory limit, a signal): that rank alone is lost
                file = futures[future]
                result = RankResult[S](file.label, str(file.path), file.rank,
                                       error=f"the worker analysing it stopped ({type(error).__name__})")
            done.append(result)
            if on_done is not None:
                on_done(result)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return done
