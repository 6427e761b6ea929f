"""Strings from an input, made safe to show: every control character, line separator and bidi override written
as an escape (`\x1b`, `\u202e`), and a huge string shortened, saying so.

A terminal obeys what it prints: `\r` and `ESC[2K` rewrite the line, OSC 0 sets the window title, OSC 52 writes
the clipboard, a C1 `\x9b` starts a CSI and NEL or U+2028 starts a new line, so one error line can print a fake
`report written to ok.html`. Rich strips only BEL, BS, VT, FF and CR. In HTML and Markdown a U+202E shows a name
reversed. A 4 MiB function name repeated in forty frames makes a report of gigabytes.
"""
from __future__ import annotations

#: characters a string keeps whole; a longer one keeps its start and its end (where a path says the most)
MAX_SHOWN = 4096

_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, *_BIDI]


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_ESCAPED = {code: _escape(code) for code in _CONTROLS}
_ESCAPED_KEEP_LINES = {code: text for code, text in _ESCAPED.items() if chr(code) not in "\n\t"}


def printable(text: str) -> str:
    """`text` on one terminal line: every C0/C1 control, line separator and bidi control escaped."""
    return text.translate(_ESCAPED)


def visible(text: str) -> str:
    """`text` for a report (HTML, Markdown): shortened past MAX_SHOWN characters, and every control, separator and
    bidi override but new lines and tabs (which the formats' own escaping handles) shown as an escape."""
    return shorten(text).translate(_ESCAPED_KEEP_LINES)


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` itself, or its start and end around a note of how many characters were left out."""
    if len(text) <= limit:
        return text
    half = (limit - 64) // 2  # room for the note: the result is never longer than `limit`
    return f"{text[:half]} …[{len(text) - 2 * half} characters left out]… {text[-half:]}"

