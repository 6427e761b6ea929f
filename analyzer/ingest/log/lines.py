"""A log as clean logical lines: read in bounded pieces, decoded, and stripped of what launchers add.

What a line may carry before the text we read: ANSI colour (`ESC[31m`), HTML escapes from a page the log was
copied from (`&gt;`, `&#39;`), torchrun's `[rank3]:` and `[default0]:` (the rank is kept), srun's `0: `,
mpirun's `[1,0]<stderr>:`, Ray's and vLLM's `(RayWorkerWrapper pid=12, ip=10.0.0.1)` and
`(VllmWorkerProcess pid=521)`, SGLang's `[2024-01-01 12:00:00 TP3]` (the rank is kept), and a GitHub quote's
`> `. Lines wrapped by a terminal or a mail are rejoined by the readers that need it (the OOM message), since
only they know where their text ends.

The file is never read whole: it is read in blocks, searched in C for what any reader looks for, and only the
lines around a match are decoded and cleaned (`Scan`); a reader's own plain lines (`Quick`: Megatron's memory
lines) are matched on their bytes and never decoded; a longer line than MAX_LINE arrives in pieces (none of the
texts we read is longer than a few hundred characters).
"""
from __future__ import annotations

import html
import re
from collections.abc import Callable, Generator, Iterator
from typing import IO, NamedTuple

#: bytes of one line handed to the readers at most; a longer line is handed over in pieces of this size
MAX_LINE = 1 << 16
#: launcher prefixes stripped from one line at most (srun's, then torchrun's, then a worker's...)
MAX_PREFIXES = 8
#: bytes read from the file at a time
BLOCK = 1 << 20

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_PREFIXES = [
    re.compile(r"^\[(?:rank|default)(?P<rank>\d+)\]:?\s?"),          # torchrun --tee / log prefixes
    re.compile(r"^\[(?P<rank>\d+),\d+\]<std(?:out|err)>:\s?"),      # mpirun --tag-output
    re.compile(r"^\((?:[A-Za-z_][\w]*)\s+pid=\d+(?:,\s*ip=[\w.:\-]+)?\)\s?"),  # Ray / vLLM workers
    re.compile(r"^(?P<rank>\d{1,5}):\s(?=\S)"),                      # srun -l / torchrun numbered output
    re.compile(r"^>\s?"),                                            # a quoted block from an issue
]
#: the characters that every prefix above starts with
_PREFIX_FIRST = frozenset("[(>0123456789")
_SGLANG_TP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? (?:DP\d+ )?TP(?P<rank>\d+)(?: EP\d+)?\]\s?")
_ALL_PREFIXES = (*_PREFIXES, _SGLANG_TP)


class Quick(NamedTuple):
    """Lines read straight from their bytes: `pattern` matches such a line whole (its newline aside), and `take`
    gets its number and the match and says whether later ones are still wanted (once it says no, they are only
    counted, in Scan.passed, and no number is worked out for them)."""

    pattern: re.Pattern[bytes]
    take: Callable[[int, re.Match[bytes]], bool]


_NOTHING = re.compile(b"(?!)")


def _skip(number: int, match: re.Match[bytes]) -> bool:
    """Never called: no line matches _NOTHING."""
    return False


class Line(NamedTuple):
    """One cleaned line: where it is in the file (1-based), its text, and the rank a prefix named (a tuple: one
    is made for every line read, and a frozen dataclass costs ten times as much to make)."""

    number: int
    text: str
    rank: int | None


def clean(raw: str) -> tuple[str, int | None]:
    """The text of one decoded line without colour, HTML escapes and launcher prefixes, and the rank they named."""
    text = raw.rstrip("\r\n")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "&" in text and ";" in text:
        text = html.unescape(text)
    rank: int | None = None
    stripped, rounds = text[:1] in _PREFIX_FIRST, 0   # a line no prefix can start is not matched against them
    while stripped and rounds < MAX_PREFIXES:  # bounded: a line of ten thousand "[rank0]: " is not read ten thousand times
        stripped, rounds = False, rounds + 1
        for prefix in _ALL_PREFIXES:
            m = prefix.match(text)
            if m and m.end() > 0:
                named = m.groupdict().get("rank")
                if named is not None and rank is None:
                    rank = int(named)
                text = text[m.end():]
                stripped = prefix is not _SGLANG_TP  # SGLang's stamp is last: what follows is the message
                break
    return text, rank


#: bytes before a line that a reader may look back over (a traceback's frames before an OOM, a GPU's row before
#: its memory row): 256 frames of a traceback at about 250 bytes each
LOOKBACK = 1 << 16


def holds_any(text: str, words: tuple[str, ...]) -> bool:
    """`text` holds one of `words`: the test every matched line goes through before a reader's patterns, twice as
    fast as any(map(text.__contains__, words)) (0.3 against 0.66 µs for three words)."""
    for word in words:
        if word in text:
            return True
    return False


def decode(raw: bytes | bytearray) -> tuple[str, int | None]:
    """One raw line, decoded and cleaned."""
    return clean(raw.decode("utf-8", errors="replace"))


def _ends_one_by_one(region: bytes | bytearray, anchors: tuple[bytes, ...], limit: int) -> list[int]:
    """Where the lines of `region[:limit]` (whole lines) that hold an anchor end (past their newline), in order:
    each anchor found with bytes.find, which runs at memchr speed (a regular expression of alternatives tries
    each at every byte, ten times slower); the search where Hyperscan is not installed (it has no wheel for
    Linux on ARM)."""
    ends: set[int] = set()
    for anchor in anchors:
        i = region.find(anchor, 0, limit)
        while i >= 0:
            end = region.index(b"\n", i) + 1
            ends.add(end)
            i = region.find(anchor, end, limit)
    return sorted(ends)


def _newlines(piece: bytes | bytearray) -> int:
    """How many lines `piece` ends: twice as fast as bytes.count, whose one-byte count is a plain loop where
    replace finds each newline with memchr (0.04 s against 0.08 s on 200 MiB of 93-byte lines)."""
    return len(piece) - len(piece.replace(b"\n", b""))


def line_finder(anchors: tuple[bytes, ...]) -> Callable[[bytes | bytearray, int], list[int]]:
    """(region, limit) -> where the lines of `region[:limit]` (whole lines) that hold one of `anchors` end, in
    order.

    Hyperscan finds every anchor in one pass of SIMD literal matching, 3 GB/s here where the seven bytes.find
    passes together ran at 0.27 GB/s (and pyahocorasick's automaton at 0.12 GB/s, Python's `re` of the
    alternatives at 0.15 GB/s): on a large log this search was half of the whole read. Its one expression runs
    from an anchor to the line's newline, and Hyperscan reports an expression once per end: one report per
    line, however many anchors it holds (a Megatron memory line holds three)."""
    try:
        import hyperscan
    except ImportError:
        return lambda region, limit: _ends_one_by_one(region, anchors, limit)
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    any_anchor = b"|".join(re.escape(a.decode()).encode() for a in anchors)
    database.compile(expressions=[b"(?:" + any_anchor + b")[^\n]*\n"], ids=[0], elements=1, flags=[0])
    scratch = hyperscan.Scratch(database)

    def ends(region: bytes | bytearray, limit: int) -> list[int]:
        found: list[int] = []
        # the binding scans any buffer (here a view of the block: no copy); its stub names only str and bytes
        database.scan(memoryview(region)[:limit], scratch=scratch,  # type: ignore[type-var]
                      match_event_handler=lambda _id, _from, end, _flags, _context: found.append(end))
        found.sort()   # in order already (a block scan reports by end); sorting a sorted list is one pass
        return found
    return ends


def _reader_into(stream: IO[bytes]) -> Callable[[memoryview], int]:
    """`stream`'s readinto (every stream opened here has one: a file, gzip, standard input, BytesIO), or one made
    of read for a stream without it; 0 at the end."""
    into = getattr(stream, "readinto", None)
    if into is not None:
        return lambda view: into(view) or 0

    def by_read(view: memoryview) -> int:
        data = stream.read(len(view))
        view[:len(data)] = data
        return len(data)
    return by_read


class Scan:
    """The cleaned lines of a stream that hold one of `anchors`, and every line after one for as long as
    `wants_next()` says a reader is inside something (a wrapped message, a table), across block ends too; and,
    while on a line, the raw lines before it (`preceding`), for the readers that look back rather than read
    every line.

    The file is read in BLOCK pieces into one buffer (no copy of a block but the kernel's) and searched block
    by block in C: only the lines a reader can use reach Python. A line that `quick`'s pattern matches whole
    while no reader is inside something is not decoded, cleaned or handed over: `quick`'s function takes its
    number and the match (a reader's own lines, read from their bytes; see FrameworkLinesReader.QUICK). A line
    longer than MAX_LINE is handed over in MAX_LINE pieces, all with its number; of a line longer than BLOCK only
    its last MAX_LINE bytes are read (an exception's message ends its line)."""

    def __init__(self, stream: IO[bytes], anchors: tuple[bytes, ...], wants_next: Callable[[], bool],
                 quick: Quick | None = None) -> None:
        self._stream, self._ends, self._wants_next, self._quick = stream, line_finder(anchors), wants_next, quick
        self.lines = 0            # lines gone through: all of them once the iteration ends
        self.passed = 0           # quick lines only counted, once `quick.take` said no more are taken
        self._region = bytearray()  # the buffer whose first `_size` bytes are the whole lines being read
        self._size = 0
        self._behind = b""        # up to LOOKBACK bytes of whole lines before the region
        self._at = 0              # offset in the region of the line being handed over
        self._base = 0            # offset of the region in the regions read (`preceding`'s offsets)

    @property
    def after_current(self) -> int:
        """Where the line being handed over ends (its newline included), as an offset for `preceding`."""
        return self._base + self._region.index(b"\n", self._at) + 1

    def preceding(self, limit: int = LOOKBACK, since: int = 0,
                  holding: tuple[bytes, ...] = ()) -> list[tuple[int, bytes]]:
        """(number, raw text) of the whole lines within `limit` bytes before the current line and from offset
        `since` (an `after_current` of before) on, oldest first; none when `holding` is given and the bytes
        hold none of its words (searched in C before any line is split)."""
        at, base, behind = self._at, self._base, self._behind
        lo = max(base + at - limit, since, base - len(behind)) - base   # from the region's start; < 0: behind
        if lo >= 0:
            head, whole = bytes(self._region[lo:at]), lo == 0 or self._region[lo - 1] == 0x0A or base + lo == since
        else:
            lo += len(behind)
            head = behind[lo:] + self._region[:at]
            whole = lo == 0 or behind[lo - 1] == 0x0A or base - len(behind) + lo == since
        if holding and not any(map(head.__contains__, holding)):
            return []
        found = head.split(b"\n")[:-1]
        if not whole:
            found = found[1:]
        first = self.lines - len(found)   # self.lines is the current line's number while it is handed over
        return [(first + i, raw) for i, raw in enumerate(found)]

    def _keep_behind(self) -> None:
        """Keep the whole lines within LOOKBACK bytes of the end of the region (and what was behind it)."""
        region, size = self._region, self._size
        if size >= LOOKBACK:
            cut = size - LOOKBACK
            if cut and region[cut - 1] != 0x0A:
                cut = region.index(b"\n", cut) + 1
            self._behind = bytes(region[cut:size])
            return
        tail = self._behind + region[:size]
        if len(tail) > LOOKBACK:
            cut = len(tail) - LOOKBACK
            tail = tail[cut if tail[cut - 1] == 0x0A else tail.index(b"\n", cut) + 1:]
        self._behind = tail

    def _handed(self, number: int, start: int, end: int) -> Iterator[Line]:
        """Line `number`, from `start` to its newline at `end`, decoded and cleaned (in pieces if it is long)."""
        region = self._region
        self.lines, self._at = number, start
        for piece in range(start, end, MAX_LINE) if end > start else (start,):
            text, rank = decode(region[piece: min(end, piece + MAX_LINE)])
            yield Line(number, text, rank)

    def _follow(self, number: int, pos: int, limit: int) -> Generator[Line, None, tuple[int, int, bool]]:
        """The lines from `pos` on for as long as a reader wants the next one, to the region's `limit` at most;
        then the lines gone through, where they end and whether a reader still wants the next one."""
        busy = self._wants_next()
        while busy and pos < limit:
            end = self._region.index(b"\n", pos)
            number += 1
            yield from self._handed(number, pos, end)
            pos = end + 1
            busy = self._wants_next()
        return number, pos, busy

    def __iter__(self) -> Iterator[Line]:
        block = BLOCK
        # a partial line carried (under a block, or MAX_LINE of a longer one), a block, and a newline at the end
        region = self._region = bytearray(max(block, MAX_LINE) + block + 1)
        view = memoryview(region)
        readinto = _reader_into(self._stream)
        match, take = (self._quick.pattern.fullmatch, self._quick.take) if self._quick else (_NOTHING.fullmatch, _skip)
        keep = True   # quick lines are still taken (past that, only counted: self.passed)
        passed = 0
        rfind = region.rfind
        number = 0    # lines before `pos`
        kept = 0      # bytes of a partial line at the buffer's start
        busy = False  # a reader wants the next line, wherever it is
        while True:
            got = readinto(view[kept: kept + block])
            size = kept + got
            if not got:
                if not size:
                    break
                region[size] = 0x0A   # the last line, without its newline
                limit = size = size + 1
            else:
                limit = region.rfind(b"\n", 0, size) + 1
                if not limit:  # inside one long line: only its last MAX_LINE bytes are kept for when it ends
                    kept = min(size, MAX_LINE) if size >= block else size
                    region[:kept] = region[size - kept:size]
                    continue
            self._base += self._size
            self._size = limit
            pos = 0  # offset of the first line of the region not yet counted (quick lines passed are not)
            if busy:  # a reader is inside something that went on past the last block
                number, pos, busy = yield from self._follow(number, 0, limit)
            for end in self._ends(region, limit):
                if end <= pos:
                    continue
                start = rfind(b"\n", pos, end - 1) + 1 or pos
                if end - start <= MAX_LINE and (m := match(region, start, end - 1)):  # no reader is inside anything
                    if not keep:
                        passed += 1   # pos stays: the line is counted with the ones before the next handed over
                        continue
                    gap = region[pos:start]
                    number += len(gap) - len(gap.replace(b"\n", b"")) + 1  # _newlines, inlined: once a line
                    pos = end
                    keep = take(number, m)
                    continue
                number += _newlines(region[pos:start]) + 1
                pos = end
                yield from self._handed(number, start, end - 1)
                number, pos, busy = yield from self._follow(number, pos, limit)
            number += _newlines(region[pos:limit])
            self.passed = passed
            self._keep_behind()
            if not got:
                break
            kept = size - limit
            region[:kept] = region[limit:size]
        self.lines = number
