"""Find the per-rank files of one job in a directory, without reading them: which file is which rank's.

Jobs write one file per rank, and often several per rank over a run:
- torchtitan: `memory_snapshot/iteration_N/rankR_memory_snapshot.pickle`, and `iteration_N_exit/` on OOM;
- `analyzer.capture`: `rank{R}_step{N}.pickle`, `rank{R}_step{N}_exit.pickle`, `rank{R}_step{N}_oom{K}.pickle`;
- the profiler's trace handler: `*.pt.trace.json[.gz]`, the rank inside the trace (`distributedInfo`).

Each rank is analysed once, from its most telling file: an out-of-memory dump first, then an exit dump, then
the latest iteration or step; the other files of that rank are listed as skipped. Files of one rank are dumps
of one run only when their names differ in nothing else (`_series`); otherwise each is kept, and the job
(analyzer.job) finds that they are not the ranks of one job. Files whose name holds no
rank (profiler traces) are all kept: their rank is read from the file. The walk never follows a symbolic link,
reads only regular files that are not empty (opened without blocking, so a FIFO put in a file's place is
skipped), and stops at MAX_DEPTH levels and MAX_FILES entries, so a hostile tree cannot hang it; past
SKIPPED_NAMED skipped files, the others are counted, not named.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from analyzer.core.trace import MemoryTrace, MultiRankTrace
from analyzer.errors import AnalyzerError, UnsupportedFormat
from analyzer.ingest import sniff
from analyzer.ingest.limits import named_skips

#: directory levels walked below the folder given, and entries looked at in all
MAX_DEPTH = 16
MAX_FILES = 100_000
#: the kinds of file that hold one rank's recording
RANK_KINDS = (sniff.SNAPSHOT, sniff.KINETO, sniff.MEMORY_TIMELINE, sniff.MEMORY_TIMELINE_RAW)

_RANK = re.compile(r"(?:^|[^a-z0-9])rank[_-]?(\d{1,6})(?!\d)", re.IGNORECASE)
_ITERATION = re.compile(r"(?:iteration|iter|step)[_-]?(\d{1,12})(?!\d)", re.IGNORECASE)
_OOM = re.compile(r"(?:^|[^a-z])oom(?:[_-]?\d+)?(?:[^a-z]|$)", re.IGNORECASE)
_EXIT = re.compile(r"(?:^|[^a-z])exit(?:[^a-z]|$)", re.IGNORECASE)


@dataclass(frozen=True)
class RankFile:
    """One file to analyse: its path, the rank its name gives (None: read it from the file), and the
    iteration or step its name gives, for ordering."""

    path: Path
    rank: int | None
    iteration: int | None
    kind: str

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else self.path.name


@dataclass
class RankFiles:
    root: Path
    files: list[RankFile]
    warnings: list[str] = field(default_factory=list)


def _priority(path: Path) -> tuple[int, int]:
    """Which of one rank's files tells most: an OOM dump, then an exit dump, then the latest iteration."""
    text = str(path)
    iteration = _last_number(_ITERATION, text)
    return (2 if _OOM.search(path.name) else 1 if _EXIT.search(text) else 0, iteration if iteration is not None else -1)


def _last_number(pattern: re.Pattern[str], text: str) -> int | None:
    found = pattern.findall(text)
    return int(found[-1]) if found else None


def rank_of(path: Path, root: Path) -> int | None:
    """The rank the file's name (or a folder below `root`) gives: `rank3_…`, `rank_3`, `rank-3`."""
    for part in reversed(path.relative_to(root).parts):
        match = _RANK.search(part)
        if match:
            return int(match.group(1))
    return None


def _walk(root: Path, warnings: list[str]) -> list[Path]:
    """Regular files under `root`, breadth first, bounded; symbolic links and special files are skipped."""
    found: list[Path] = []
    level, seen = [root], 0
    for depth in range(MAX_DEPTH + 1):
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError as error:
                warnings.append(f"skipped {_shown(folder, root)}: cannot be listed ({error.strerror})")
                continue
            for entry in entries:
                seen += 1
                if seen > MAX_FILES:
                    warnings.append(f"stopped after {MAX_FILES} entries; the rest of the folder was not looked at")
                    return found
                path = Path(entry.path)
                try:
                    status = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                mode = status.st_mode
                if stat.S_ISLNK(mode):
                    warnings.append(f"skipped {_shown(path, root)}: a symbolic link (not followed)")
                elif stat.S_ISDIR(mode):
                    below.append(path)
                elif stat.S_ISREG(mode) and status.st_size == 0:
                    warnings.append(f"skipped {_shown(path, root)}: empty")
                elif stat.S_ISREG(mode):
                    found.append(path)
                else:
                    warnings.append(f"skipped {_shown(path, root)}: not a regular file")
        if not below:
            return found
        if depth == MAX_DEPTH:
            warnings.append(f"folders deeper than {MAX_DEPTH} levels were not looked at")
        level = below
    return found


def _pickle_or_gzip(path: Path) -> bool:
    """A snapshot starts with a pickle protocol >= 2 header (torch never wrote protocol 0 or 1) or is gzipped:
    beside them in a job's folder, a text file that happens to start with a protocol-0 opcode is no rank."""
    with sniff.open_regular(path) as f:
        head = f.read(2)
    return head[:1] == b"\x80" or head == b"\x1f\x8b"


def _series(path: Path, root: Path) -> str:
    """The name of a rank's files with the rank, iteration or step, OOM and exit marks taken out: files of one
    rank are dumps of one run (one kept) only when this is the same (`rank0.json.gz` and `sampled_rank-0.json.gz`
    are not)."""
    text = str(path.relative_to(root))
    for pattern in (_RANK, _ITERATION, _OOM, _EXIT):
        text = pattern.sub("#", text)
    return text


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path != root else str(root)


def find_rank_files(root: Path) -> RankFiles:
    """The files to analyse under `root`, one per rank where names give ranks, in rank order."""
    warnings: list[str] = []
    candidates: list[RankFile] = []
    logs = 0   # text logs skipped: what the error says when nothing else is here
    for path in _walk(root, warnings):
        try:
            kind = sniff.sniff(path)
            rank_kind = kind in RANK_KINDS and (kind != sniff.SNAPSHOT or _pickle_or_gzip(path))
        except AnalyzerError as error:
            warnings.append(f"skipped {_shown(path, root)}: {error.problem}")
            continue
        except OSError as error:   # gone, or made unreadable, since the folder was listed
            warnings.append(f"skipped {_shown(path, root)}: cannot be read ({error.strerror})")
            continue
        if not rank_kind:
            logs += 1 if kind == sniff.LOG else 0
            warnings.append(f"skipped {_shown(path, root)}: not a recording of one rank ({kind})")
            continue
        candidates.append(RankFile(path, rank_of(path, root), _last_number(_ITERATION, str(path.relative_to(root))),
                                   kind))
    warnings[:] = named_skips(warnings)
    if not candidates:
        if logs:   # torchrun --log-dir writes one text log a rank: each is read alone, or all as one text
            raise UnsupportedFormat(root, f"holds no memory snapshot or profiler trace, but {logs} text log"
                                    f"{'s' if logs != 1 else ''}", "Pass one log (analyze FILE), or several as one text "
                                    "(cat rank*.log | analyze -).")
        raise UnsupportedFormat(root, "holds no memory snapshot or profiler trace",
                                "Point at the folder the job wrote its per-rank files to.")
    chosen: dict[tuple[int, str], RankFile] = {}
    skipped: dict[tuple[int, str], int] = {}
    for file in candidates:
        if file.rank is None:
            continue
        key = (file.rank, _series(file.path, root))
        best = chosen.get(key)
        if best is None or _priority(file.path) > _priority(best.path):
            if best is not None:
                skipped[key] = skipped.get(key, 0) + 1
            chosen[key] = file
        else:
            skipped[key] = skipped.get(key, 0) + 1
    for key, count in sorted(skipped.items()):
        warnings.append(f"rank {key[0]}: analysed {_shown(chosen[key].path, root)}; {count} other file(s) of "
                        f"this rank skipped (an out-of-memory dump first, then an exit dump, then the latest)")
    files = sorted(chosen.values(), key=lambda f: (f.rank or 0, str(f.path))) + \
        [f for f in candidates if f.rank is None]
    return RankFiles(root, files, warnings)


def read_rank_directory(path: Path) -> MultiRankTrace:
    """Every rank's recording under a folder, read here (the Python API's `load(dir)`; the command line reads
    each rank on a Dask worker instead, analyzer.job). A rank whose file is bad is skipped with a warning."""
    from analyzer.ingest import reader_for  # the table of readers, which lists this one

    found = find_rank_files(path)
    traces: list[MemoryTrace] = []
    for file in found.files:
        try:
            trace = reader_for(file.kind, file.path)(file.path)
        except AnalyzerError as error:
            found.warnings.append(f"{file.label}: not read: {error}")
            continue
        if not isinstance(trace, MemoryTrace):
            found.warnings.append(f"{file.label}: skipped: holds several ranks itself")
            continue
        traces.append(trace if file.rank is None or trace.rank is not None else replace(trace, rank=file.rank))
    if not traces:
        raise UnsupportedFormat(path, "holds no rank that could be read", "; ".join(found.warnings[-3:]))
    traces.sort(key=lambda t: (t.rank is None, t.rank or 0, t.source_path))
    return MultiRankTrace(source_path=str(path), traces=traces, warnings=found.warnings)
