"""The Python traceback printed before an OOM: what the run was doing (its phase) and the user's own line.

Python prints the frames outermost first, then the exception; a chained exception prints a second traceback.
When an OOM is read, the lines before it are read back (`frames_before`) for the frames of the traceback it
ends: a log is not searched for tracebacks, only for OOMs.

The phase is read from the frames' functions, files and code, most telling first: a `backward` anywhere means
the backward pass (autograd runs the forward's saved graph, never the reverse); then the optimizer step,
a checkpoint save, loading (a model moved to the device: `Module._apply`, `from_pretrained`,
`load_state_dict`; a batch moved with `.to(device)` is not loading), inference (`generate`, vLLM's and SGLang's model runners), and last the forward pass
(`forward`, `Module._call_impl`), which every other phase may call.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from analyzer.core.vocabulary import Phase

#: a run's phase that training has no word for: serving or generating
INFERENCE = "inference"

Frame = tuple[str, int, str, str]  # (file, line, function, code)

_FILE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
_HEADER = re.compile(r"^\s*Traceback \(most recent call last\):")
_LIBRARY = re.compile(r"site-packages|dist-packages|[/\\]lib[/\\]python\d|[/\\]Lib[/\\]|^<frozen|^<string>|"
                      r"[/\\]conda[/\\]pkgs[/\\]")

#: (phase, pattern over "file function code" of one frame), most telling first
_PHASE_RULES: list[tuple[str, re.Pattern[str]]] = [
    (Phase.BACKWARD.value, re.compile(r"\b(?:_engine_run_backward|run_backward)\b|\bbackward\b|\.backward\(")),
    (Phase.OPTIMIZER.value, re.compile(r"[/\\]torch[/\\]optim[/\\]|\boptimizer\.step\(|\b_?optimizer_step\b|"
                                       r"\bzero_grad\b|\bstep\b.*\boptim")),
    (Phase.CHECKPOINT_SAVE.value, re.compile(r"\bsave_checkpoint\b|\bsave_pretrained\b|\btorch\.save\(|"
                                             r"serialization\.py \S*\bsave\b|\bsave_model\b")),
    (Phase.LOAD.value, re.compile(r"\bfrom_pretrained\b|\bload_state_dict\b|\bload_checkpoint\b|\bload_model\b|"
                                  r"\bload_weights\b|\btorch\.load\(|module\.py _apply\b")),
    (INFERENCE, re.compile(r"\bgenerate\b|\bexecute_model\b|\bprofile_run\b|\b_dummy_run\b|\bcapture_model\b|"
                           r"\bforward_batch\w*\b|\bpredict\b|\binference\b|\bsample\b")),
    (Phase.FORWARD.value, re.compile(r"\bforward\b|\b_call_impl\b|\b_wrapped_call_impl\b")),
]


class TracebackWindow:
    """The frames of the traceback being printed, fed line by line (a bounded number kept)."""

    MAX_FRAMES = 256

    #: lines between a traceback's last frame and the exception it ends (its code line, ^^^ marks, a blank)
    NEAR = 4

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self._pending: tuple[str, int, str] | None = None
        self._last = -self.NEAR - 1   # line number of the last frame or code line

    def feed(self, number: int, text: str) -> None:
        if _HEADER.match(text):
            self.frames, self._pending = [], None
            return
        m = _FILE.match(text)
        if m:
            self._flush("")
            self._pending, self._last = (m.group("file"), int(m.group("line")), m.group("function")), number
            return
        if self._pending is not None:
            code = text.strip()
            if code and not set(code) <= set("^~ "):
                self._flush(code)
                self._last = number

    def _flush(self, code: str) -> None:
        if self._pending is not None:
            self.frames.append((*self._pending, code))
            del self.frames[: -self.MAX_FRAMES]
            self._pending = None

    @property
    def busy(self) -> bool:
        """A frame's line was read and its code line is next."""
        return self._pending is not None

    def take(self, number: int) -> tuple[Frame, ...]:
        """The frames of the traceback that ends just before line `number` (none if it ended further up: a
        logger's OOM line is not that traceback's exception); the window starts over."""
        self._flush("")
        frames, self.frames = tuple(self.frames), []
        return frames if number - self._last <= self.NEAR else ()


#: words of the raw lines the window reads: a frame, a traceback's header (the line after a frame, its code, is
#: read while the window is busy)
TRACEBACK_WORDS = (b'File "', b"raceback")


def frames_before(lines: Sequence[tuple[int, bytes]], decode: Callable[[bytes], str], number: int,
                  text: str) -> tuple[Frame, ...]:
    """The frames of the traceback that ends at line `number` (`text`), read back from the raw `lines` before it
    (those after the previous OOM, which took the frames before it): what a window fed every line would give.
    Only the lines that can matter are decoded."""
    window = TracebackWindow()
    for n, raw in lines:
        if window.busy or any(map(raw.__contains__, TRACEBACK_WORDS)):
            window.feed(n, decode(raw))
    window.feed(number, text)
    return window.take(number)


def phase_of(frames: Sequence[Frame]) -> str | None:
    """The phase the frames show (the most telling rule that any frame matches), None without frames or match."""
    texts = [f"{file} {function} {code}" for file, _, function, code in frames]
    return next((phase for phase, rule in _PHASE_RULES if any(rule.search(t) for t in texts)), None)


def user_frame(frames: Sequence[Frame]) -> str | None:
    """'train.py:42 in train_step': the innermost frame outside installed libraries and torch."""
    for file, line, function, _ in reversed(frames):
        if not _LIBRARY.search(file):
            return f"{file}:{line} in {function}"
    return None
