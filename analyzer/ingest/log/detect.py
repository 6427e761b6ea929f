"""Is the head of a file a text log? Decided from bytes, after the binary and JSON formats had their say.

Text is taken for a log when it holds no NUL byte and decodes as UTF-8 (a cut multi-byte character at the end
of the head aside), unless its first line is a protocol-0 pickle opcode line (`(dp0`, `ctorch._utils`,
`S'x'`): those are ASCII too, and the snapshot reader refuses what they try. A `[` opens a log
(`[rank0]: ...`, `[2024-01-01 ...]`) unless JSON follows it; `{` stays the JSON readers'.
"""
from __future__ import annotations

import re

# MARK then any opcode ("(dp0", "(S'x'", "(cos"), unless it is a Ray/vLLM worker prefix "(Name pid=1)"; a global
# ("cos"); an empty dict or list; an int, long, float, string or None written as protocol 0 writes them. Not a bare
# letter and anything: `GPU:0` (torch.cuda.list_gpu_processes()) opens a log, not a BINFLOAT
_PICKLE_V0_LINE = re.compile(rb"^(?:\((?![A-Za-z_]\w*\s+pid=\d).*|c[\w.]+|[}\]]q?.*|I-?\d+|L-?\d+L?|F-?[\d.eE+-]+"
                             rb"|S'.*'|N|\.)\r?$")
_JSON_LIST = re.compile(rb"^\s*\[\s*(?:\[|\{|\]|\"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*[,\]])")


def json_list(head: bytes) -> bool:
    """`head` starts a JSON array (an export_memory_timeline file), not a bracketed log prefix."""
    return bool(_JSON_LIST.match(head))


def text_log(head: bytes) -> bool:
    """`head` is text that is not a protocol-0 pickle."""
    if not head or b"\x00" in head:
        return False
    try:
        head[:-4].decode("utf-8") if len(head) > 4 else head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    first = head.lstrip(b"\xef\xbb\xbf").split(b"\n", 1)[0]
    return not _PICKLE_V0_LINE.match(first)
