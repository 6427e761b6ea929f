"""Why one OOM message's request did not fit, from its numbers alone: capacity, fragmentation, other_process,
or unknown (the text does not say enough, or its numbers contradict each other).

R is the request, T the device's capacity (or the allowed limit), F what the driver called free after the
allocator had released every cached block it could, A allocated by PyTorch, U reserved by PyTorch but
unallocated, and "outside" the device memory neither PyTorch's cache nor free: the other processes NVML listed
plus this process's non-PyTorch memory (torch >= 2.1), or T - F - A - U when the message does not split it.

In order:
1. no numbers (an OOM outside the caching allocator, a cut message) -> unknown;
2. numbers that contradict each other: where the allocator's own (a size above the capacity, reserved + free
   above it) -> unknown, saying which; where only NVML's per-process figures (this process "using" 2**64 bytes,
   NVML's "not available" under WSL and Windows, or "0 bytes" in a container while PyTorch holds memory) -> said,
   set aside, and the rules below read the allocator's numbers alone;
3. the request alone is larger than the capacity -> capacity; reserved + request above an allowed limit
   (`set_per_process_memory_fraction`), or within the printed sizes' rounding of it -> capacity, against that
   limit (the allocator refuses `reserved + alloc_size > allowed` before it asks the driver, so with the limit
   in reach it is the explanation: ROCm/TheRock#2118 prints 1072 MiB reserved + 2 MiB against "1.05 GiB");
4. F >= R + FREE_SLACK: the driver said the request fits -> unknown (a driver limit, a per-allocation limit,
   another process allocating at that moment: nothing in the numbers);
5. U >= R: the cache held the bytes but no free block that large -> fragmentation;
6. outside - CONTEXT_ALLOWANCE >= what must go (R + FREE_SLACK - F) -> other_process;
7. else -> capacity: PyTorch's own memory fills the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analyzer.core.log_records import Era, OomText
from analyzer.core.units import human_bytes

#: device memory any CUDA process holds outside PyTorch's cache (context, cuBLAS/cuDNN workspaces, NCCL
#: buffers): less than this outside the cache is not "another process took the room"
CONTEXT_ALLOWANCE = 1 << 30
#: room the driver needs beyond a request (2 MiB pages, its own bookkeeping): a device with less than this
#: over the request free is full
FREE_SLACK = 64 << 20
#: NVML's "not available" (all 64 bits set) printed as a size: 17179869184.00 GiB; anything this large is it
NVML_NOT_AVAILABLE = 2**63

CAPACITY, FRAGMENTATION, OTHER_PROCESS, UNKNOWN = "capacity", "fragmentation", "other_process", "unknown"


@dataclass(frozen=True, kw_only=True)
class Cause:
    """The cause of one OOM, the sentence that says why, and the bytes behind it."""

    cause: str
    reason: str
    must_free_bytes: int | None = None      # what must go for the request to fit (R + FREE_SLACK - F)
    outside_bytes: int | None = None        # device memory outside PyTorch's cache and not free
    non_pytorch_bytes: int | None = None    # this process's memory outside PyTorch's cache (torch >= 2.1)
    other_processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes), largest first
    limit: str | None = None                # "allowed" when an allowed fraction, not the device, was the limit
    inconsistent: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "reason": self.reason, "must_free_bytes": self.must_free_bytes,
                "outside_bytes": self.outside_bytes, "non_pytorch_bytes": self.non_pytorch_bytes,
                "other_processes": [{"pid": p, "bytes": b} for p, b in self.other_processes],
                "limit": self.limit, "inconsistent": self.inconsistent, "notes": self.notes}


def _above_capacity(name: str, value: int | None, total: int, tol: int) -> list[str]:
    if value is None or value <= total + tol:
        return []
    if value >= NVML_NOT_AVAILABLE:
        return [f"{name} is NVML's 'not available' ({value / 2**30:.2f} GiB, 2**64 bytes: WSL and Windows cannot "
                "read per-process use)"]
    return [f"{name} ({human_bytes(value)}) is more than the device's total capacity ({human_bytes(total)})"]


def _contradictions(o: OomText, others: list[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """What in the message cannot all be true (sizes as printed, within their rounding): in the allocator's own
    numbers, and in NVML's per-process figures."""
    own: list[str] = []
    nvml: list[str] = []
    tol = o.tolerance_bytes
    total = o.capacity_bytes
    if total:
        for name, value in (("allocated by PyTorch", o.allocated_bytes), ("reserved by PyTorch", o.reserved_bytes),
                            ("free", o.free_bytes)):
            own += _above_capacity(name, value, total, tol)
        if not own and o.reserved_bytes is not None and o.free_bytes is not None \
                and o.reserved_bytes + o.free_bytes > total + tol:
            own.append(f"reserved ({human_bytes(o.reserved_bytes)}) plus free ({human_bytes(o.free_bytes)}) is more than the "
                       f"total capacity ({human_bytes(total)})")
        nvml += _above_capacity("this process's use", o.this_process_bytes, total, tol)
        listed = [b for _, b in others]
        nvml += _above_capacity("the other processes' use", max(listed) if any(b >= NVML_NOT_AVAILABLE for b in listed)
                                else sum(listed) if listed else None, total, tol)
    if o.this_process_bytes is not None and o.reserved_bytes and o.era != Era.MPS \
            and o.this_process_bytes + tol < o.reserved_bytes:
        nvml.append(f"this process is said to use {human_bytes(o.this_process_bytes)} while PyTorch alone reserves "
                    f"{human_bytes(o.reserved_bytes)} (a container or WSL hides the process from NVML)")
    return own, nvml


def judge(o: OomText) -> Cause:
    """The cause of `o` by the rules of the module docstring."""
    if o.era == Era.OUTSIDE:
        return Cause(cause=UNKNOWN, reason=f"an allocation outside PyTorch's caching allocator failed ({_OUTSIDE[o.source]}); "
                     "the error prints no sizes")
    if o.requested_bytes is None or o.capacity_bytes is None:
        return Cause(cause=UNKNOWN, reason="the message is cut off before the numbers that would tell")
    R, T, F, U = o.requested_bytes, o.capacity_bytes, o.free_bytes, o.unallocated_bytes
    others = sorted(o.processes, key=lambda p: -p[1])
    notes: list[str] = []
    this = o.this_process_bytes
    if this is None and o.reserved_bytes and others and others[0][1] + o.tolerance_bytes >= o.reserved_bytes:
        pid, this = others.pop(0)
        notes.append(f"process {pid} ({human_bytes(this)}) holds at least what PyTorch reserves and no line names "
                     "this process: it is taken to be this process (a container renumbers its processes)")
    own_contradictions, nvml_contradictions = _contradictions(o, others)
    if own_contradictions:
        contradictions = own_contradictions + nvml_contradictions
        return Cause(cause=UNKNOWN, reason="the message's numbers contradict each other: " + "; ".join(contradictions),
                     inconsistent=contradictions, notes=notes)
    if nvml_contradictions:   # NVML's figures go; the allocator's own numbers still say why
        this, others = None, []
        notes.append("NVML's per-process figures contradict the rest of the message and are set aside: the cause "
                     "rests on the allocator's own numbers")
    # this process's memory outside PyTorch's cache: NVML's figure less what PyTorch reserves (MPS: less allocated)
    own = o.allocated_bytes if o.era == Era.MPS else o.reserved_bytes
    non_pytorch = this - (own or 0) if this is not None else None
    if o.era in (Era.OF_WHICH, Era.MPS) and (this is not None or others):
        outside: int | None = sum(b for _, b in others) + max(non_pytorch or 0, 0)
    elif F is not None and o.reserved_bytes is not None:
        outside = max(T - F - o.reserved_bytes, 0)
    else:
        outside = None
    must = max(R + FREE_SLACK - F, 0) if F is not None else None
    base: dict[str, Any] = {"must_free_bytes": must, "outside_bytes": outside, "non_pytorch_bytes": non_pytorch,
                            "other_processes": others, "notes": notes, "inconsistent": nvml_contradictions}
    limit = o.allowed_bytes if o.allowed_bytes is not None and o.era != Era.MPS else None
    if R > T:
        return Cause(cause=CAPACITY, reason=f"the request alone ({human_bytes(R)}) is larger than the device ({human_bytes(T)})", **base)
    if limit is not None and o.reserved_bytes is not None and o.reserved_bytes + R + o.tolerance_bytes > limit:
        than = "more than" if o.reserved_bytes + R > limit else "within the printed sizes' rounding of"
        return Cause(cause=CAPACITY, limit="allowed", reason=f"reserved ({human_bytes(o.reserved_bytes)}) plus the request "
                     f"({human_bytes(R)}) is {than} the allowed {human_bytes(limit)} (set_per_process_memory_fraction) of {human_bytes(T)}", **base)
    if F is None:
        return Cause(cause=UNKNOWN, reason="the message does not print the device's free memory", **base)
    if F >= R + FREE_SLACK:
        return Cause(cause=UNKNOWN, reason=f"the driver reported {human_bytes(F)} free, enough for the {human_bytes(R)} requested: the "
                     "numbers do not explain the failure (a driver or per-allocation limit, or memory taken by "
                     "another process in that moment)", **base)
    if U is not None and U >= R:
        return Cause(cause=FRAGMENTATION, reason=f"PyTorch held {human_bytes(U)} reserved but unallocated, more than the "
                     f"{human_bytes(R)} requested, but in pieces too small for it", **base)
    if outside is not None and must is not None and outside - CONTEXT_ALLOWANCE >= must:
        who = "other processes" if others else "memory outside PyTorch's cache"
        return Cause(cause=OTHER_PROCESS, reason=f"{who} held {human_bytes(outside)}; without them the {human_bytes(R)} requested "
                     f"would fit ({human_bytes(must)} had to be freed)", **base)
    return Cause(cause=CAPACITY, reason=f"PyTorch's own memory fills the device: {human_bytes(o.reserved_bytes)} reserved of "
                 f"{human_bytes(T)}, {human_bytes(F)} free for a {human_bytes(R)} request", **base) if o.reserved_bytes is not None else \
        Cause(cause=CAPACITY, reason=f"{human_bytes(F)} free for a {human_bytes(R)} request of {human_bytes(T)}", **base)


_OUTSIDE = {"cuda_error": "CUDA error: out of memory", "cublas": "cuBLAS could not allocate its workspace",
            "nccl": "NCCL could not allocate its buffers", "thcudacheck": "THCudaCheck error=2",
            "caching_allocator": "caching allocator"}
