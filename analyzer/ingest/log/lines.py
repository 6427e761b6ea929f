"""A log as clean logical lines: read in bounded pieces, decoded, and stripped of what launchers add.

What a line may carry before the text we read: ANSI colour (`ESC[31m`), HTML escapes from a page the log was
copied from (`&gt;`, `&#39;`), torchrun's `[rank3]:` and `[default0]:` (the rank is kept), srun's `0: `,
mpirun's `[1,0]<stderr>:`, Ray's and vLLM's `(RayWorkerWrapper pid=12, ip=10.0.0.1)` and
`(VllmWorkerProcess pid=521)`, SGLang's `[2024-01-01 12:00:00 TP3]` (the rank is kept), and a GitHub quote's
`> `. Lines wrapped by a terminal or a mail are rejoined by the readers that need it (the OOM message), since
only they know where their text ends.

The file is never read whole: it is read in blocks, searched in C for what any reader looks for, and only the
lines around a match are decoded and cleaned (`scan`); a longer line than MAX_LINE arrives in pieces (none of
the texts we read is longer than a few hundred characters).
"""
from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
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


def decode(raw: bytes) -> tuple[str, int | None]:
    """One raw line, decoded and cleaned."""
    return clean(raw.decode("utf-8", errors="replace"))


def _starts_one_by_one(region: bytes, anchors: tuple[bytes, ...]) -> list[int]:
    """Offsets of the lines of `region` that hold an anchor, in order: each anchor found with bytes.find, which
    runs at memchr speed (a regular expression of alternatives tries each at every byte, ten times slower); the
    search where Hyperscan is not installed (it has no wheel for Linux on ARM)."""
    starts: set[int] = set()
    for anchor in anchors:
        i = region.find(anchor)
        while i >= 0:
            starts.add(region.rfind(b"\n", 0, i) + 1)
            i = region.find(anchor, region.index(b"\n", i))
    return sorted(starts)


def _newlines(piece: bytes) -> int:
    """How many lines `piece` ends: twice as fast as bytes.count, whose one-byte count is a plain loop where
    replace finds each newline with memchr (0.04 s against 0.08 s on 200 MiB of 93-byte lines)."""
    return len(piece) - len(piece.replace(b"\n", b""))


def line_finder(anchors: tuple[bytes, ...]) -> Callable[[bytes], list[int]]:
    """region -> the offsets of its lines that hold one of `anchors`, in order.

    Hyperscan finds every anchor in one pass of SIMD literal matching, 3 GB/s here where the seven bytes.find
    passes together ran at 0.27 GB/s (and pyahocorasick's automaton at 0.12 GB/s, Python's `re` of the
    alternatives at 0.15 GB/s): on a large log this search was half of the whole read."""
    try:
        import hyperscan
    except ImportError:
        return lambda region: _starts_one_by_one(region, anchors)
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(expressions=[re.escape(a.decode()).encode() for a in anchors], ids=list(range(len(anchors))),
                     elements=len(anchors), flags=[0] * len(anchors))
    scratch = hyperscan.Scratch(database)

    def starts(region: bytes) -> list[int]:
        ends: list[int] = []
        database.scan(region, match_event_handler=lambda _id, _from, end, _flags, _context: ends.append(end),
                      scratch=scratch)
        found: list[int] = []
        line_end = -1
        for end in sorted(ends):
            if end > line_end:   # the first anchor of its line (an anchor holds no newline)
                found.append(region.rfind(b"\n", 0, end) + 1)
                line_end = region.index(b"\n", end - 1)
        return found
    return starts


class Scan:
    """The cleaned lines of a stream that hold one of `anchors`, and every line after one for as long as
    `wants_next()` says a reader is inside something (a wrapped message, a table); and, while on a line, the
    raw lines before it (`preceding`), for the readers that look back rather than read every line.

    The file is read in BLOCK pieces and searched block by block in C: only the lines a reader can use reach
    Python. A line longer than MAX_LINE is handed over in MAX_LINE pieces, all with its number; of a line longer
    than BLOCK only its last MAX_LINE bytes are read (an exception's message ends its line)."""

    def __init__(self, stream: IO[bytes], anchors: tuple[bytes, ...], wants_next: Callable[[], bool]) -> None:
        self._stream, self._starts, self._wants_next = stream, line_finder(anchors), wants_next
        self.lines = 0            # lines gone through: all of them once the iteration ends
        self._region = b""        # whole lines being read
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
            head, whole = self._region[lo:at], lo == 0 or self._region[lo - 1] == 0x0A or base + lo == since
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

    def _keep_behind(self, region: bytes) -> None:
        """Keep the whole lines within LOOKBACK bytes of the end of `region` (and what was behind it)."""
        tail = region if len(region) >= LOOKBACK else self._behind + region
        if len(tail) > LOOKBACK:
            cut = len(tail) - LOOKBACK
            tail = tail[cut if tail[cut - 1] == 0x0A else tail.index(b"\n", cut) + 1:]
        self._behind = tail

    def __iter__(self) -> Iterator[Line]:
        number = 0  # lines before the current region
        carry = b""
        while True:
            data = self._stream.read(BLOCK)
            block = carry + data
            if not data:
                if not block:
                    break
                region, carry = block if block.endswith(b"\n") else block + b"\n", b""
            else:
                cut = block.rfind(b"\n")
                if cut < 0:  # inside one long line: only its last MAX_LINE bytes are kept for when it ends
                    carry = block if len(block) < BLOCK else block[-MAX_LINE:]
                    continue
                region, carry = block[: cut + 1], block[cut + 1:]
            self._base += len(self._region)
            self._region = region
            pos = 0  # offset of the first line of `region` not yet taken or counted past
            for start in self._starts(region):
                if start < pos:
                    continue
                number += _newlines(region[pos:start])
                pos = start
                while True:
                    end = region.index(b"\n", pos)
                    number += 1
                    self.lines, self._at = number, pos
                    for piece in range(pos, end, MAX_LINE) if end > pos else (pos,):
                        text, rank = decode(region[piece: min(end, piece + MAX_LINE)])
                        yield Line(number, text, rank)
                    pos = end + 1
                    if pos >= len(region) or not self._wants_next():
                        break
            number += _newlines(region[pos:])
            self._keep_behind(region)
            if not data:
                break
        self.lines = number
