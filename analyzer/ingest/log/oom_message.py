"""The out-of-memory message, in every form PyTorch and the libraries under it have printed.

Caching-allocator messages, raised from `DeviceCachingAllocator::malloc` in c10/cuda/CUDACachingAllocator.cpp
(THCCachingAllocator.cpp before torch 1.0):

- torch 1.0-1.3 (the message of pytorch/pytorch#13751):
  `CUDA out of memory. Tried to allocate R (GPU n; T total capacity; A already allocated; F free; C cached)`,
  where "cached" is held by the allocator but not allocated (the PR's own glossary), so reserved = A + C.
- torch 1.4-2.0: `... F free; [L allowed; ]R reserved in total by PyTorch)`, often followed by
  `(malloc at .../c10/cuda/CUDACachingAllocator.cpp:N)` (1.4-1.6) or the `max_split_size_mb` hint (1.10+).
  Here reserved is the total, so unallocated = reserved - A.
- torch 2.1+ (pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp at 001074d2, the `TORCH_CHECK_WITH(
  OutOfMemoryError, ...)` in `malloc`): `Tried to allocate R. GPU n has a total capacity of T of which F is
  free. [Process P has M memory in use. ]*[Including non-PyTorch memory, this process has Y memory in use. ]
  [L allowed; ]Of the allocated memory A is allocated by PyTorch, [with P allocated in private pools (e.g.,
  CUDA Graphs), ]and U is reserved by PyTorch but unallocated.` The process list comes from NVML
  (`reportProcessMemoryInfo`): without NVML it is missing, which is the truncated form. A counts private pools;
  U = reserved - A, so reserved = A + U. 2.1 spelled "capacty"; ROCm prints "HIP" (and "HIP Graphs": the
  hipified source, as in ROCm/TheRock#2118), XPU "XPU".
- MPS (aten/src/ATen/mps/MPSAllocator.mm): `MPS backend out of memory (MPS allocated: A, other allocations:
  O, max allowed: M). Tried to allocate R on private pool.`

"Tried to allocate" is the rounded block the allocator asked the driver for (`alloc_size`), not the tensor.

Out-of-memory errors that do not come from the caching allocator carry no numbers: `CUDA error: out of memory`
(a kernel, the context or a library's own cudaMalloc), `CUBLAS_STATUS_ALLOC_FAILED` (cuBLAS's workspace at
`cublasCreate`), NCCL's `Cuda failure 'out of memory'` (with `Failed to CUDA calloc N bytes` when it says how
much) and torch <= 0.4's `THCudaCheck FAIL ... error=2 : out of memory`.
"""
from __future__ import annotations

import re
from dataclasses import replace

from analyzer.core.log_records import Era, OomText
from analyzer.ingest.log.lines import holds_any
from analyzer.ingest.log.sizes import SIZE, rounding, to_bytes

#: continuation lines joined to a message wrapped by a terminal, a mail or an issue
MAX_WRAPPED_LINES = 6

# the message, or its fragment from "Tried to allocate" when it goes on with the "(GPU n; ..." of torch <= 2.0
_START = re.compile(r"(?:(?P<kind>CUDA|HIP|XPU) out of memory\.\s*)?Tried to allocate\s+" + SIZE
                    + r"(?(kind)|(?=\s*\(\s*GPU))|MPS backend out of memory\s*\(")
_OUTSIDE = re.compile(
    r"(?P<cuda_error>CUDA error: out of memory)"
    r"|(?P<cublas>CUBLAS_STATUS_ALLOC_FAILED)"
    r"|(?P<nccl>NCCL WARN Cuda failure (?:2 )?'out of memory')"
    r"|(?P<thcudacheck>THCudaCheck FAIL file=\S+ line=\d+ error=2 : out of memory)")
_NCCL_CALLOC = re.compile(r"NCCL WARN Failed to CUDA calloc (\d+) bytes")

_S = r"\s*" + SIZE  # a size, after optional space
_PAREN = re.compile(
    r"\(\s*GPU\s*(?P<device>\d+);" + _S + r"\s+total capacity;"
    r"(?:" + _S + r"\s+allowed;)?" + _S + r"\s+already allocated;"
    r"(?:" + _S + r"\s+free;)?(?:" + _S + r"\s+allowed;)?" + _S + r"\s+(?P<what>cached|reserved in total by PyTorch)\s*\)",
    re.IGNORECASE)
_HAS = re.compile(r"GPU\s*(?P<device>\d+) has a total capac(?:i)?ty of" + _S + r"\s+of which" + _S + r"\s+is free\.")
_PROCESS = re.compile(r"Process\s+(\d+) has" + _S + r"\s+memory in use\.")
_THIS = re.compile(r"Including non-PyTorch memory, this process has" + _S + r"\s+memory in use\.")
_ALLOWED = re.compile(_S.strip(r"\s*") + r"\s+allowed;")
_OF_ALLOCATED = re.compile(r"Of the allocated memory" + _S + r"\s+is allocated by PyTorch,\s*"
                           r"(?:(?:with|and)" + _S + r"\s+(?:is )?allocated in private pools \(e\.g\., (?:CUDA|HIP) Graphs\),\s*)?"
                           r"and" + _S + r"\s+is reserved by PyTorch but unallocated")
_MPS = re.compile(r"MPS backend out of memory\s*\(MPS allocated:" + _S + r",\s*other allocations:" + _S
                  + r",\s*max allowed:" + _S + r"\)\.\s*Tried to allocate" + _S + r"\s+on (?P<pool>private|shared) pool")
_MALLOC_AT = re.compile(r"\(malloc at \S*?(CUDACachingAllocator\.cpp:\d+)\)")
_COMPLETE = re.compile(r"\)|but unallocated\.|\bpool\b")
_CONTINUES = re.compile(r"^(?:[a-z0-9(;]|GPU|Process|Including|Of the|If |See |PYTORCH|allocated|free|cached|"
                        r"reserved|total|already)")
_NEW_RECORD = re.compile(r"^(?:Traceback|File |During handling|The above exception|\[|\d{4}-\d\d-\d\d)")


#: words one of which every start holds (tested before the patterns: `in` is fifty times cheaper than a search)
START_WORDS = ("out of memory", "Tried to allocate", "CUBLAS_STATUS_ALLOC_FAILED")


def starts(text: str) -> bool:
    """The line holds the start of an OOM message (of any form)."""
    return holds_any(text, START_WORDS) and bool(_START.search(text) or _OUTSIDE.search(text))


def continues(joined: str, line: str) -> bool:
    """`line` is the wrapped rest of the message `joined` so far."""
    body = line.lstrip("# ").rstrip()
    return bool(body) and not _COMPLETE.search(joined.partition("Tried to allocate")[2] or joined) \
        and not _NEW_RECORD.match(body) and not starts(body) and bool(_CONTINUES.match(body))


def _size(m: re.Match[str], number: int) -> tuple[int, int]:
    """(bytes, rounding) of the SIZE whose number is group `number` (its unit is the next group)."""
    value, unit = m.group(number), m.group(number + 1)
    return to_bytes(value, unit), rounding(value, unit)


def _sizes(m: re.Match[str]) -> list[tuple[int, int] | None]:
    """Every SIZE of a match in order, None for an optional one that is absent."""
    out: list[tuple[int, int] | None] = []
    groups = m.groups()
    names = {v: k for k, v in m.re.groupindex.items()}
    i = 1
    while i <= len(groups):
        if i in names:
            i += 1
            continue
        out.append(_size(m, i) if m.group(i) is not None else None)
        i += 2
    return out


def parse(text: str, line: int, rank: int | None) -> OomText | None:
    """The OOM message that starts in `text` (one line, or a wrapped message rejoined), None if there is none."""
    start = _START.search(text)
    if start is None:
        outside = _OUTSIDE.search(text)
        if outside is None:
            return None
        source = next(k for k, v in outside.groupdict().items() if v)
        return OomText(line=line, rank=rank, era=Era.OUTSIDE, backend="CUDA", source=source, text=text[outside.start():])
    message = text[start.start():]
    if '"' in text[:start.start()]:   # kept as a quoted string (JSON, a repr): PyTorch's own message has no '"'
        message = message.split('"', 1)[0]
    if start.group(2) is None:
        return _parse_mps(message, line, rank)
    base = OomText(line=line, rank=rank, era=Era.PARTIAL, backend=(start.group("kind") or "CUDA").upper(), text=message,
                   requested_bytes=to_bytes(start.group(2), start.group(3)))
    tolerance = rounding(start.group(2), start.group(3))
    malloc = _MALLOC_AT.search(message)
    if malloc:
        base = replace(base, malloc_at=malloc.group(1))
    paren = _PAREN.search(message)
    if paren:
        return _parse_paren(base, paren, tolerance)
    has = _HAS.search(message)
    if has:
        return _parse_of_which(base, has, message, tolerance)
    return base


def _parse_paren(base: OomText, m: re.Match[str], tolerance: int) -> OomText:
    """torch <= 2.0: "(GPU n; T total capacity; A already allocated; F free; [L allowed;] X cached|reserved)"."""
    total, allowed_before, allocated, free, allowed_after, held = _sizes(m)
    assert total is not None and allocated is not None and held is not None  # required by the pattern
    allowed = allowed_before or allowed_after
    cached = m.group("what").lower() == "cached"
    unallocated = held[0] if cached else max(held[0] - allocated[0], 0)
    reserved = allocated[0] + held[0] if cached else held[0]
    parts = [total, allocated, held, free, allowed]
    return replace(base, era=Era.CACHED if cached else Era.RESERVED, device=int(m.group("device")),
                   capacity_bytes=total[0], allocated_bytes=allocated[0], free_bytes=free[0] if free else None,
                   allowed_bytes=allowed[0] if allowed else None, reserved_bytes=reserved,
                   unallocated_bytes=unallocated, tolerance_bytes=tolerance + sum(p[1] for p in parts if p))


def _parse_of_which(base: OomText, has: re.Match[str], message: str, tolerance: int) -> OomText:
    """torch >= 2.1: "GPU n has a total capacity of T of which F is free. ... Of the allocated memory ..."."""
    total, free = _sizes(has)
    assert total is not None and free is not None
    rest = message[has.end():]
    processes = tuple((int(p.group(1)), to_bytes(p.group(2), p.group(3))) for p in _PROCESS.finditer(rest))
    this = _THIS.search(rest)
    allowed = _ALLOWED.search(rest.partition("Of the allocated memory")[0])
    of = _OF_ALLOCATED.search(rest)
    parts = [total, free]
    result = replace(base, era=Era.PARTIAL, device=int(has.group("device")), capacity_bytes=total[0], free_bytes=free[0],
                     processes=processes, this_process_bytes=to_bytes(this.group(1), this.group(2)) if this else None,
                     allowed_bytes=to_bytes(allowed.group(1), allowed.group(2)) if allowed else None)
    if this:
        parts.append((0, rounding(this.group(1), this.group(2))))
    if of:
        allocated, private, unallocated = _sizes(of)
        assert allocated is not None and unallocated is not None
        parts += [allocated, unallocated]
        result = replace(result, era=Era.OF_WHICH, allocated_bytes=allocated[0], unallocated_bytes=unallocated[0],
                         reserved_bytes=allocated[0] + unallocated[0],
                         private_pool_bytes=private[0] if private else None)
    return replace(result, tolerance_bytes=tolerance + sum(p[1] for p in parts))


def _parse_mps(message: str, line: int, rank: int | None) -> OomText:
    """MPS: "(MPS allocated: A, other allocations: O, max allowed: M). Tried to allocate R on private pool"."""
    m = _MPS.search(message)
    if m is None:
        return OomText(line=line, rank=rank, era=Era.PARTIAL, backend="MPS", text=message)
    allocated, other, allowed, requested = _sizes(m)
    assert allocated and other and allowed and requested
    return OomText(line=line, rank=rank, era=Era.MPS, backend="MPS", device=0, text=message,
                   requested_bytes=requested[0], allocated_bytes=allocated[0], allowed_bytes=allowed[0],
                   capacity_bytes=allowed[0], this_process_bytes=allocated[0] + other[0],
                   free_bytes=max(allowed[0] - allocated[0] - other[0], 0),
                   tolerance_bytes=allocated[1] + other[1] + allowed[1] + requested[1])


def nccl_calloc_bytes(text: str) -> int | None:
    """NCCL's "Failed to CUDA calloc N bytes": the request of an NCCL OOM, when it says."""
    m = _NCCL_CALLOC.search(text)
    return int(m.group(1)) if m else None
