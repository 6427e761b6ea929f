"""What every streaming JSON reader shares: the ijson backend that parses, a peek at the first byte (an object
or a list, before any parsing), and one CorruptInput naming the file for whatever bad JSON raises.

Nesting depth is guarded apart, by `json_depth.DepthLimitedStream`, which wraps the stream the parser reads.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import ijson

from analyzer.errors import CorruptInput


@contextmanager
def reading(name: str, hint: str) -> Iterator[None]:
    """Turn what malformed JSON or an unexpected layout raises into one CorruptInput naming the file."""
    try:
        yield
    except ijson.JSONError as error:
        first_line = str(error).strip().splitlines()[0]
        raise CorruptInput(name, f"the JSON is malformed or truncated ({first_line})", hint) from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as error:
        raise CorruptInput(name, f"the content has an unexpected layout ({type(error).__name__}: {str(error)[:120]})",
                           hint) from None


def first_byte(stream: IO[bytes]) -> bytes:
    """The first non-blank byte, without consuming anything (b"" when the start is all blank)."""
    return stream.peek(4096)[:4096].lstrip()[:1]  # type: ignore[attr-defined]


def ijson_backend() -> tuple[Any, list[str]]:
    """The C backend (several times faster); the pure-Python one with a warning where it is not built."""
    try:
        return ijson.get_backend("yajl2_c"), []
    except ImportError:
        return ijson, ["ijson's C backend (yajl2_c) is not available: reading falls back to Python and is slower"]
