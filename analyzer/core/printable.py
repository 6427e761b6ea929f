"""Strings from an input, made safe to show: every control character, line separator and bidi override written
as an escape (`\x1b`, `\u202e`), and a huge string shortened, saying so.

A terminal obeys what it prints: `\r` and `ESC[2K` rewrite the line, OSC 0 sets the window title, OSC 52 writes
the clipboard, a C1 `\x9b` starts a CSI and NEL or U+2028 starts a new line, so one error line can print a fake
`report written to ok.html`. Rich strips only BEL, BS, VT, FF and CR. In HTML and Markdown a U+202E shows a name
reversed. Invisible characters (zero-width spaces and joiners, U+FEFF, soft hyphens, Hangul fillers, the
blank braille pattern, Unicode tag characters) hide or disguise text the same way, and a lone surrogate (which a
pickle's unpickler accepts) cannot be encoded as UTF-8 at all: both are shown as escapes too. A 4 MiB function
name repeated in forty frames makes a report of gigabytes.
"""
from __future__ import annotations

#: characters a string keeps whole; a longer one keeps its start and its end (where a path says the most)
MAX_SHOWN = 4096

_BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
#: characters that show nothing: soft hyphen, combining grapheme joiner, Hangul fillers, Mongolian vowel separator,
#: zero-width space / non-joiner / joiner, word joiner and invisible operators, deprecated format controls, the
#: blank braille pattern, U+FEFF, interlinear annotation, Unicode tags
_INVISIBLE = [0x00AD, 0x034F, 0x115F, 0x1160, 0x180E, *range(0x200B, 0x200E), *range(0x2060, 0x2066),
              *range(0x206A, 0x2070), 0x2800, 0x3164, 0xFEFF, 0xFFA0, *range(0xFFF9, 0xFFFC), *range(0xE0000, 0xE0080)]
_SURROGATES = range(0xD800, 0xE000)
_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, *_BIDI, *_INVISIBLE, *_SURROGATES]


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


_ESCAPED = {code: _escape(code) for code in _CONTROLS}
_ESCAPED_KEEP_LINES = {code: text for code, text in _ESCAPED.items() if chr(code) not in "\n\t"}


def printable(text: str) -> str:
    """`text` on one terminal line: every C0/C1 control, line separator, bidi control, invisible character and
    lone surrogate escaped."""
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

