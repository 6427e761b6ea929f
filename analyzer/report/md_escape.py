"""Markdown's escaping, for every report written as Markdown (a recording's, a log's, a check's comment): every
string from an input goes through `md_text` or `md_code`. Apart from analyzer.report.markdown so that a log's
report imports no recording's view (pandas)."""
from __future__ import annotations

import re

from analyzer.core.printable import visible

# inline constructs: escapes, code, emphasis, links and images, raw HTML and autolinks, entities, strikethrough,
# table cells, math, and a colon before a non-space (URL schemes `http:`, `mailto:`, and emoji codes)
_MARKUP = re.compile(r"([\\`*_\[\]<>!&~|$]|:(?=\S))")


def md_text(value: object) -> str:
    """Plain text on one line: Markdown punctuation backslash-escaped; `www.` broken so that GitHub does not
    make it a link; a zero-width space after `@` and `#`, and inside `GH-1`, so that no one is mentioned and no
    issue is linked."""
    text = _MARKUP.sub(r"\\\1", " ".join(visible(str(value)).split()))
    text = re.sub(r"(?i)\b(www)\.", r"\1\\.", text)
    text = re.sub(r"(?i)\b(gh)-(?=\d)", "\\1-\u200b", text)
    return text.replace("@", "@\u200b").replace("#", "#\u200b")


def md_code(value: object, in_table: bool = False) -> str:
    """An inline code span (nothing inside one is markup or a link); in a table cell `|` is escaped, the one
    character GitHub's table parser reads inside code."""
    text = " ".join(visible(str(value)).split())
    if in_table:
        text = text.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def code_block(code: str, indent: str) -> list[str]:
    """`code` in a fence longer than any run of backticks inside it, each line indented by `indent`."""
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", code)), default=0) + 1)
    return [f"{indent}{fence}", *(f"{indent}{line}" for line in code.splitlines()), f"{indent}{fence}"]
