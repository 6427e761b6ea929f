"""Which module's code a stack was running: the module call path of its `forward` (and constructor) frames.

Frames are innermost first. Every frame of a module's `forward` (torch's `__call__` / `_call_impl` plumbing
around it is skipped) gives one level of the path, outermost first: `LlamaForCausalLM › LlamaModel ›
LlamaDecoderLayer › LlamaMLP › Linear`. A parameter made while a model is built has the path of the module
constructors (`__init__`) it was made in, the same classes as its forward path.

A level's class is read from source files, parsed (never imported), only where the user named a folder of the
code the recording ran (`--source-root`, `source_roots=`): the longest suffix of the recorded path found under
one of them (the recorded path itself when it lies under one). Nothing else is read, neither the recorded file
at its path here nor the analysing environment's site-packages: a copy of another version gives other classes,
and one file must give one report on every machine. A copy under a source root that is not the one recorded is
still caught by checking that every line the recording names in it falls in a function of the recorded name
(`SourceIndex.check`): one line that does not, and the file is not read. Where no file is read, the level keeps
its `file:line forward` text.

Not module levels: torch's own `forward`s that are not modules (autograd Functions, compiled-graph wrappers),
a `forward` run by `Function.apply` or written as a static method, and a `super().forward()` call (the same
module as its caller).
"""
from __future__ import annotations

import ast
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from analyzer.core.stacks import Frame, format_frame
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR

SEPARATOR = MODULE_PATH_SEPARATOR
#: no real source file is larger; bigger ones are not read
MAX_SOURCE_BYTES = 4 << 20
#: components of a recorded path's longest suffix looked for under a root (no checkout nests deeper; trying
#: every suffix of a 1,300-level path was quadratic in its depth)
MAX_SUFFIX_PARTS = 64
#: module levels kept of one call path, the innermost: no model nests deeper, and a stack of 1,500 `forward`
#: frames made a 1,500-level path per stack (labelling its calls is quadratic in the depth: 24 s for 200 stacks)
MAX_LEVELS = 64

_FORWARD, _INIT = "forward", "__init__"
_TORCH = re.compile(r"(^|[\\/])torch[\\/]")
# torch files whose `forward` is a module's (and whose `__init__` builds one): nn modules, DDP/FSDP wrappers
_TORCH_MODULE_FORWARD = re.compile(r"(^|[\\/])torch[\\/](nn|ao[\\/]nn|distributed)[\\/]")
_TORCH_NOT_MODULE = re.compile(r"(^|[\\/])torch[\\/]nn[\\/](modules[\\/]module\.py|parallel[\\/]_functions\.py)$")
_TORCH_MODULE_INIT = re.compile(r"(^|[\\/])torch[\\/](nn|ao[\\/]nn)[\\/]modules[\\/](?!container\.py$|module\.py$)\w+\.py$")
# a forward run by autograd (Function.apply, functorch's autograd_function) is a Function's, not a module's
_AUTOGRAD_CALLER = re.compile(r"(^|[\\/])torch[\\/](autograd[\\/]function\.py|_functorch[\\/])")
# a call of the parent class's method on the same object: the inner frame is the same module
_SAME_OBJECT_CALL = re.compile(r"super\([^)]*\)\s*\.\s*(forward|__init__)\s*\(|\.(forward|__init__)\(\s*self\b")
_MODULE_BASE = re.compile(r"(Module|Model)$")


@dataclass(frozen=True)
class Level:
    """One level of a call path: `identity` tells calls of one module class apart from other classes' (the
    class, or the file for a class not known here); `label` is what is shown; `line` is where that level's
    frame was, its position within the call."""

    identity: str
    label: str
    line: int
    resolved: bool


CallPath = tuple[Level, ...]  # outermost first


def path_label(levels: Sequence[Level], indices: Sequence[int | None] | None = None) -> str:
    """`A › B[3] › C`: the levels' labels, each with its order number where one is given."""
    indices = indices or [None] * len(levels)
    return SEPARATOR.join(lv.label if i is None else f"{lv.label}[{i}]" for lv, i in zip(levels, indices, strict=True))


@dataclass(frozen=True)
class _Method:
    start: int
    end: int
    name: str
    owner: str | None      # the class whose body defines it directly, else None
    plain: bool            # an instance method (not a static or class method)


@dataclass(frozen=True)
class _Source:
    methods: tuple[_Method, ...]
    module_classes: frozenset[str]   # classes that look like modules: a `forward`, or a base named *Module/*Model
    lines: tuple[str, ...]

    def method_at(self, line: int) -> _Method | None:
        enclosing = [m for m in self.methods if m.start <= line <= m.end]
        return max(enclosing, key=lambda m: m.start) if enclosing else None


_EMPTY = _Source((), frozenset(), ())


def _read_regular_file(filename: str) -> bytes | None:
    """The bytes of a regular file of at most MAX_SOURCE_BYTES, else None.

    The name comes from the input, so it is untrusted: the file is opened without blocking and checked with
    fstat, so a frame naming /dev/zero, a FIFO or a huge file can neither exhaust memory nor block the analysis."""
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        with open(fd, "rb") as source:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = source.read(MAX_SOURCE_BYTES + 1)
    except (OSError, ValueError):
        return None
    return data if len(data) <= MAX_SOURCE_BYTES else None


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):  # Generic[...]-style bases
        return _base_name(node.value)
    return ""


def _parse(data: bytes) -> _Source:
    text = data.decode("utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _EMPTY
    methods: list[_Method] = []
    modules: set[str] = set()

    def visit(node: ast.AST, owner: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if any(_MODULE_BASE.search(_base_name(b)) for b in child.bases):
                    modules.add(child.name)
                visit(child, child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {_base_name(d) for d in child.decorator_list}
                plain = owner is not None and not decorators & {"staticmethod", "classmethod"}
                methods.append(_Method(child.lineno, child.end_lineno or child.lineno, child.name,
                                       owner.name if owner is not None else None, plain))
                if owner is not None and child.name == _FORWARD and plain:
                    modules.add(owner.name)
                visit(child, None)
            else:
                visit(child, owner)

    try:
        visit(tree, None)
    except RecursionError:
        return _EMPTY
    return _Source(tuple(methods), frozenset(modules), tuple(text.splitlines()))


@dataclass(frozen=True)
class _FileVersion:
    """A file as it is now, by identity: every spelling of its path (`/x/./y.py`, `/x//y.py`, a link) is one."""

    device: int
    inode: int
    mtime_ns: int
    size: int
    name: str = field(compare=False)   # one of its spellings, to read it by


@lru_cache(maxsize=1024)
def _parsed(version: _FileVersion) -> _Source:
    data = _read_regular_file(version.name)
    return _EMPTY if data is None else _parse(data)


def read_source(filename: str) -> _Source:
    """The parsed source of a readable file (parsed once per file, whatever the spelling of its path, and again
    only when it changes), else an empty one."""
    try:
        st = os.stat(filename)
    except (OSError, ValueError):
        return _EMPTY
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
        return _EMPTY
    return _parsed(_FileVersion(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, filename))


def _parts(filename: str) -> list[str]:
    """The components of a recorded path, POSIX or Windows ('C:' and empty parts dropped)."""
    pieces = re.split(r"[\\/]+", filename)
    if pieces and re.fullmatch(r"[A-Za-z]:", pieces[0]):
        pieces = pieces[1:]
    return [p for p in pieces if p]


class SourceIndex:
    """Finds where a file named by a recorded frame can be read here, and what the source says at a line.

    `roots` (the `--source-root` folders) are the only places searched: for every root, the longest suffix of the
    recorded path that names a file under it wins. Looked up once per distinct file name."""

    def __init__(self, roots: Iterable[str | Path] = ()) -> None:
        self.roots = tuple(str(Path(r).expanduser()) for r in roots)
        self._located: dict[str, str | None] = {}
        self._other_version: set[str] = set()

    def check(self, frames: Iterable[Frame]) -> None:
        """Leave unread every file whose local copy is not the one recorded: a frame of it names a function
        (not a comprehension or lambda) that does not enclose its line there. Only files holding a module's
        `forward` or constructor frame are checked, since only their classes are read."""
        by_file: dict[str, set[tuple[int, str]]] = {}
        for filename, line, function in frames:
            by_file.setdefault(filename, set()).add((line, function))
        for filename, named in by_file.items():
            local = self.locate(filename)
            if not any(f in (_FORWARD, _INIT) for _, f in named) or local is None:
                continue
            source = self.source(filename)
            checked = [(line, function) for line, function in named if not function.startswith("<")]
            if not all((m := source.method_at(line)) is not None and m.name == function for line, function in checked):
                self._other_version.add(filename)

    def locate(self, filename: str) -> str | None:
        if filename not in self._located:
            self._located[filename] = self._locate(filename)
        return self._located[filename]

    def _locate(self, filename: str) -> str | None:
        if not filename.lower().endswith(".py") or not self.roots:
            return None
        if os.path.isabs(filename) and _is_regular(filename) and any(
                filename.startswith(os.path.join(r, "")) for r in self.roots):
            return filename
        parts = _parts(filename)
        if any(p in (".", "..") for p in parts):
            return None
        best: tuple[int, str] | None = None
        for root in self.roots:
            for start in range(max(0, len(parts) - MAX_SUFFIX_PARTS), len(parts)):
                length = len(parts) - start
                if best is not None and length <= best[0]:
                    break
                candidate = os.path.join(root, *parts[start:])
                if _is_regular(candidate):
                    best = (length, candidate)
                    break
        return best[1] if best else None

    def source(self, filename: str) -> _Source:
        local = None if filename in self._other_version else self.locate(filename)
        return read_source(local) if local else _EMPTY


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


_DEFAULT: list[SourceIndex] = []


def default_index() -> SourceIndex:
    """The index without source roots (it reads no file), made once."""
    if not _DEFAULT:
        _DEFAULT.append(SourceIndex())
    return _DEFAULT[0]


def _is_python(filename: str) -> bool:
    return filename.lower().endswith(".py") and not filename.startswith("<")


def _level(frames: Sequence[Frame], i: int, sources: SourceIndex) -> Level | None:
    """The level frame `i` gives, or None when it is not a module's forward or constructor."""
    filename, line, function = frames[i]
    if function not in (_FORWARD, _INIT) or not _is_python(filename):
        return None
    torch = bool(_TORCH.search(filename))
    if torch:
        allowed = _TORCH_MODULE_FORWARD if function == _FORWARD else _TORCH_MODULE_INIT
        if not allowed.search(filename) or _TORCH_NOT_MODULE.search(filename):
            return None
    caller = frames[i + 1] if i + 1 < len(frames) else None
    if function == _FORWARD and caller is not None and (_AUTOGRAD_CALLER.search(caller[0]) or caller[2] == "apply"):
        return None
    source = sources.source(filename)
    method = source.method_at(line)
    if method is not None and method.name == function and method.owner is not None:
        if not method.plain:
            return None   # a static forward: an autograd Function's
        if function == _INIT and not torch and method.owner not in source.module_classes:
            return None   # the constructor of something that is not a module (a trainer, a dataset)
        return Level(f"{filename}::{method.owner}", method.owner, line, True)
    if function == _INIT and not torch:
        return None       # an unreadable constructor may be anything's
    return Level(filename, format_frame(frames[i]), line, False)


def _same_object_call(frame: Frame, sources: SourceIndex) -> bool:
    """Whether the frame's line calls its parent class's forward/__init__ on itself (`super().forward(x)`)."""
    lines = sources.source(frame[0]).lines
    return 0 < frame[1] <= len(lines) and bool(_SAME_OBJECT_CALL.search(lines[frame[1] - 1]))


def call_path(frames: Sequence[Frame], sources: SourceIndex | None = None) -> CallPath:
    """The module levels of a stack (innermost first), outermost first; empty when it ran no module's code."""
    sources = sources or default_index()
    levels: list[Level] = []
    for i in range(len(frames)):
        level = _level(frames, i, sources)
        if level is None:
            continue
        caller = frames[i + 1] if i + 1 < len(frames) else None
        if caller is not None and caller[2] == frames[i][2] and _same_object_call(caller, sources):
            continue      # the caller is this module too: it shows as the caller's level
        levels.append(level)
        if len(levels) == MAX_LEVELS:
            break
    return tuple(reversed(levels))

