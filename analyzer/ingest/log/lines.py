"""A log as clean logical lines: read in bounded pieces, decoded, and stripped of what launchers add.

What a line may carry before the text we read: ANSI colour (`ESC[31m`), HTML escapes from a page the log was
copied from (`&gt;`, `&#39;`), torchrun's `[rank3]:` and `[default0]:` (the rank is kept), srun's `0: `,
mpirun's `[1,0]<stderr>:`, Ray's and vLLM's `(RayWorkerWrapper pid=12, ip=10.0.0.1)` and
`(VllmWorkerProcess pid=521)`, SGLang's `[2024-01-01 12:00:00 TP3]` (the rank is kept), and a GitHub quote's
`> `. Lines wrapped by a terminal or a mail are rejoined by the readers that need it (the OOM message), since
only they know where their text ends.

The file is never read whole: `readline(MAX_LINE)` bounds each piece, and a longer line arrives as several
pieces (none of the texts we read is longer than a few hundred characters).
"""
from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

#: bytes read at most per line; a longer line is read as several
MAX_LINE = 1 << 16

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_PREFIXES = [
    re.compile(r"^\[(?:rank|default)(?P<rank>\d+)\]:?\s?"),          # torchrun --tee / log prefixes
    re.compile(r"^\[(?P<rank>\d+),\d+\]<std(?:out|err)>:\s?"),      # mpirun --tag-output
    re.compile(r"^\((?:[A-Za-z_][\w]*)\s+pid=\d+(?:,\s*ip=[\w.:\-]+)?\)\s?"),  # Ray / vLLM workers
    re.compile(r"^(?P<rank>\d{1,5}):\s(?=\S)"),                      # srun -l / torchrun numbered output
    re.compile(r"^>\s?"),                                            # a quoted block from an issue
]
_SGLANG_TP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? (?:DP\d+ )?TP(?P<rank>\d+)(?: EP\d+)?\]\s?")


@dataclass(frozen=True)
class Line:
    """One cleaned line: where it is in the file (1-based), its text, and the rank a prefix named."""

    number: int
    text: str
    rank: int | None


def clean(raw: str) -> tuple[str, int | None]:
    """The text of one decoded line without colour, HTML escapes and launcher prefixes, and the rank they named."""
    text = _ANSI.sub("", raw.rstrip("\r\n"))
    if "&" in text and ";" in text:
        text = html.unescape(text)
    rank: int | None = None
    stripped = True
    while stripped:
        stripped = False
        for prefix in (*_PREFIXES, _SGLANG_TP):
            m = prefix.match(text)
            if m and m.end() > 0:
                named = m.groupdict().get("rank")
                if named is not None and rank is None:
                    rank = int(named)
                text = text[m.end():]
                stripped = prefix is not _SGLANG_TP  # SGLang's stamp is last: what follows is the message
                break
    return text, rank


def read_lines(stream: IO[bytes]) -> Iterator[Line]:
    """Every line of `stream`, cleaned, in bounded pieces."""
    number = 0
    while True:
        piece = stream.readline(MAX_LINE)
        if not piece:
            return
        number += 1
        text, rank = clean(piece.decode("utf-8", errors="replace"))
        yield Line(number, text, rank)
