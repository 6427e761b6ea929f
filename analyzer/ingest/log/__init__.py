"""Read a text log (a training run's output, a pasted error, an issue's text) into a LogReading, streamed.

One pass over cleaned lines (analyzer.ingest.log.lines) feeds every reader: the OOM messages with the
traceback read back from the lines before each (oom_message, traceback), memory_summary() tables and
memory_stats() dicts (memory_summary), nvidia-smi output (nvidia_smi) and framework memory lines
(framework_lines). Megatron's memory lines, most of what a long run's log holds, go from their bytes straight to
their reader (framework_lines.QUICK) while no reader is inside something. Only what was read is kept, bounded: a
log of any size is read in constant memory but for its OOMs and readings, and past MAX_READINGS a reading is
only counted (a Megatron line then only matched: its numbers are not read).
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO

from analyzer.core.log_records import AllocatorSetting, LogReading, OomText, Reading
from analyzer.errors import CorruptInput
from analyzer.ingest.log import oom_message
from analyzer.ingest.log.framework_lines import QUICK, FrameworkLinesReader
from analyzer.ingest.log.lines import Quick, Scan, decode, holds_any
from analyzer.ingest.log.memory_summary import MemorySummaryReader
from analyzer.ingest.log.nvidia_smi import NvidiaSmiReader
from analyzer.ingest.log.traceback import TRACEBACK_WORDS, Frame, frames_before

#: OOMs and readings kept; past these a log is still read to its end and the warnings say what was left out
MAX_OOMS = 1000
MAX_READINGS = 50_000
#: the same OOM printed again within this many lines (a chained exception, a logger and the traceback) is one
SAME_OOM_LINES = 200

#: a piece of every line any reader starts from (a line without one is never decoded): "emory" (out of memory,
#: memory summary, memory (MB), see_memory_usage (DeepSpeed's logger names the function on its MA line too),
#: memory.used, gpu_memory_utilization, list_gpu_processes()' "GPU memory", Not enough memory...), "lloc"
#: (Tried to allocate, calloc, allocated_bytes, mem-allocated-gigabytes, KV Cache is allocated), "_ALLOC_"
#: (PYTORCH_CUDA_ALLOC_CONF, CUBLAS_STATUS_ALLOC_FAILED), nvidia-smi's "MiB" rows, SGLang's "Load weight end",
#: and "vllm", "sglang" (a memory_stats() dict opens with "active.all.allocated"). Hyperscan finds them all in
#: one pass (lines.line_finder); without it each costs one pass of bytes.find over the file, 1.5-4 GB/s here (a
#: longer anchor is skipped over faster). The lines readers need only around one (a traceback before an OOM, a
#: GPU's row before its memory row, list_gpu_processes()' "GPU:n") are read back from there instead
#: (Scan.preceding), and a DeepSpeed MA line without its logger's prefix or a bare mem_fraction_static is not
#: looked for
ANCHORS = (b"emory", b"lloc", b"_ALLOC_", b"MiB", b"Load weight end", b"vllm", b"sglang")
_SETTING = re.compile(r"PYTORCH_(?:CUDA_)?ALLOC_CONF\s*[=:]\s*['\"]?([\w:.,=\-]+)")
_HINT = re.compile(r"try setting|If reserved|See documentation")
#: a framework's name, the words one of its lines must hold (tested first: `in` is fifty times cheaper than the
#: search) and the pattern that marks it
_MARKERS = {"vllm": (("vllm", "VllmWorker", "gpu_memory_utilization"),
                     re.compile(r"\bvllm\b|VllmWorker|gpu_memory_utilization")),
            "sglang": (("sglang", "fraction", "KV Cache is allocated"),
                       re.compile(r"\bsglang\b|mem[_-]fraction[_-]static|KV Cache is allocated"))}


class _OomCollector:
    """Joins a wrapped message, parses it, attaches its traceback and folds repeats of the same OOM."""

    def __init__(self) -> None:
        self.ooms: list[OomText] = []
        self.left_out = 0
        self._buffer: tuple[int, int | None, str, tuple[Frame, ...], int] | None = None

    def feed(self, number: int, text: str, rank: int | None,
             frames_of: Callable[[int, str], tuple[Frame, ...]]) -> bool:
        """Take `text` if it is (part of) an OOM message; True when it was."""
        if self._buffer is not None:
            start, r, joined, frames, extra = self._buffer
            if extra < oom_message.MAX_WRAPPED_LINES and oom_message.continues(joined, text):
                self._buffer = (start, r, f"{joined} {text.lstrip('# ').strip()}", frames, extra + 1)
                return True
            self.finish()
        calloc = oom_message.nccl_calloc_bytes(text)
        if calloc is not None and self.ooms and self.ooms[-1].source == "nccl" and number - self.ooms[-1].line < 8:
            self.ooms[-1] = replace(self.ooms[-1], requested_bytes=calloc)
            return True
        if oom_message.starts(text):
            self._buffer = (number, rank, text, frames_of(number, text), 0)
            return True
        return False

    @property
    def busy(self) -> bool:
        """A message is being joined: the next line may be its wrapped rest."""
        return self._buffer is not None

    def finish(self) -> None:
        if self._buffer is None:
            return
        start, rank, joined, frames, _ = self._buffer
        self._buffer = None
        parsed = oom_message.parse(joined, start, rank)
        if parsed is None:
            return
        parsed = replace(parsed, frames=frames)
        last = self.ooms[-1] if self.ooms else None
        if last is not None and last.same_event(parsed) and start - last.line <= SAME_OOM_LINES:
            self.ooms[-1] = replace(last, repeats=last.repeats + 1, frames=last.frames or parsed.frames, line=start)
        elif len(self.ooms) < MAX_OOMS:
            self.ooms.append(parsed)
        else:
            self.left_out += 1


def read_log(stream: IO[bytes], path: str) -> LogReading:
    """Everything the readers find in `stream`, in one pass."""
    ooms = _OomCollector()
    summaries, smi, frameworks = MemorySummaryReader(), NvidiaSmiReader(), FrameworkLinesReader()
    readings: list[Reading] = []
    settings: list[AllocatorSetting] = []
    seen: set[str] = set()
    dropped = 0

    def wants_next() -> bool:
        return ooms.busy or summaries.busy or smi.busy

    def take_quick(number: int, match: re.Match[bytes]) -> bool:
        """A line read from its bytes; past MAX_READINGS only counted, as every reading is (and the scan is told
        that no later one is wanted: it counts them, scan.passed)."""
        nonlocal dropped
        found = frameworks.quick(number, match, keep=len(readings) < MAX_READINGS)
        if found is None:
            dropped += 1
            return False
        readings.append(found)
        return len(readings) < MAX_READINGS

    scan = Scan(stream, ANCHORS, wants_next, Quick(QUICK, take_quick))

    def text_of(raw: bytes) -> str:
        return decode(raw)[0]

    last_oom = 0   # where the last OOM's first line ended: the lines before it are no later OOM's traceback

    def frames(number: int, text: str) -> tuple[Frame, ...]:
        nonlocal last_oom
        lines = scan.preceding(since=last_oom, holding=TRACEBACK_WORDS)
        last_oom = scan.after_current
        return frames_before(lines, text_of, number, text)

    unseen = list(_MARKERS.items())   # a framework once seen is not looked for again
    for number, text, rank in scan:
        if ooms.feed(number, text, rank, frames):
            continue
        if "ALLOC_CONF" in text and not _HINT.search(text) and (m := _SETTING.search(text)):
            settings.append(AllocatorSetting(number, m.group(1)))
        for name, (words, marker) in unseen:
            if holds_any(text, words) and marker.search(text):
                seen.add(name)
                unseen = [u for u in unseen if u[0] != name]
        found = summaries.feed(number, text, rank) + smi.feed(number, text, rank, scan.preceding) + \
            frameworks.feed(number, text, rank)
        if found:
            room = MAX_READINGS - len(readings)
            readings += found[:room]
            dropped += max(len(found) - room, 0)
    ooms.finish()
    dropped += scan.passed
    readings += summaries.finish()
    warnings = []
    if ooms.left_out:
        warnings.append(f"{ooms.left_out} more OOM messages after the first {MAX_OOMS} were not kept")
    if dropped:
        warnings.append(f"{dropped} memory readings after the first {MAX_READINGS} were not kept")
    return LogReading(path=path, lines=scan.lines, ooms=ooms.ooms, readings=readings, settings=settings,
                      frameworks=sorted(seen | {s for s in frameworks.seen if s in ("vllm", "sglang", "deepspeed", "megatron")}),
                      warnings=warnings)


def read_log_file(path: Path | str) -> LogReading:
    """`path` read as a log ("-" is standard input); gzip is opened as the other readers open it."""
    if str(path) == "-":
        return read_log(sys.stdin.buffer, "-")
    from analyzer.ingest.sniff import open_input

    p = Path(path)
    try:
        with open_input(p) as stream:
            return read_log(stream, str(p))
    except UnicodeError as error:  # decoding replaces, so only a codec bug lands here
        raise CorruptInput(p, f"the text cannot be decoded ({error})") from None
