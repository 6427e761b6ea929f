"""Every failure a user can cause has a class here, and renders as one line: the file, what is wrong, what to do.

The CLI maps any AnalyzerError to exit code 2 and prints `str(error)`; nothing else reaches the user.
"""
from __future__ import annotations

from pathlib import Path

EXIT_BAD_INPUT = 2


class AnalyzerError(Exception):
    """Base class: a problem with what the user handed us, explained in one line."""

    def __init__(self, path: str | Path | None, problem: str, hint: str = "") -> None:
        self.path = str(path) if path is not None else None
        self.problem = problem
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        hint = f" {self.hint}" if self.hint else ""
        return f"{where}{self.problem}.{hint}".replace("\n", " ")


class InputNotFound(AnalyzerError):
    """The path does not exist or cannot be read."""


class UnsupportedFormat(AnalyzerError):
    """The bytes are not any format we read (or a format we can only point the user away from)."""


class CorruptInput(AnalyzerError):
    """The format is recognised but the content is truncated, malformed or inconsistent."""


class UnsafePickle(AnalyzerError):
    """A pickle tried to import or call something: snapshots never need to, so we refuse it."""


class ResourceLimit(AnalyzerError):
    """The input would exceed a configured limit (decompressed size, nesting depth, entry count)."""


class OutputError(AnalyzerError):
    """The report cannot be written where asked: no such folder, a directory, a full disk, a planted link."""


class UserCodeError(AnalyzerError):
    """The user's own model code (run by `analyze simulate FILE`) raised: their bug, told in one line."""


def user_code_error(error: BaseException, file: str | Path) -> AnalyzerError | None:
    """A UserCodeError for `error` when its traceback passes through `file` (the user's script), else None (a bug
    of ours, reported as one)."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if not any(Path(f).resolve() == Path(file).resolve() for f in frames if not f.startswith("<")):
        return None
    return UserCodeError(file, f"the model code raised {type(error).__name__}: {str(error)[:300]}",
                         "Fix it and run again (python FILE shows the full traceback).")
