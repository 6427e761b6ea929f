"""The GPU under the allocator: how much physical memory is free, and which virtual addresses cudaMalloc returns.

The model needs only what the caching allocator observes: cudaMalloc succeeds when the device has that many
bytes free and returns a fresh address range (freed ranges are reused, lowest address first, as the driver
tends to); expandable segments reserve a large virtual range up front and then map physical pages into it.
"""
from __future__ import annotations

from bisect import insort

_VA_ALIGN = 2 << 20              # cudaMalloc ranges are 2 MiB aligned
_MALLOC_BASE = 0x7F0000000000    # where cudaMalloc'd ranges start (a typical CUDA VA region)
_RESERVE_BASE = 0x7E0000000000   # where expandable segments reserve their virtual ranges


def _align(size: int) -> int:
    return (size + _VA_ALIGN - 1) // _VA_ALIGN * _VA_ALIGN


class DeviceMemory:
    """Physical memory of one device (capacity minus what is in use) and its virtual address allocator."""

    def __init__(self, capacity: int | None, used_outside: int = 0,
                 recorded_addresses: list[tuple[int, int]] | None = None) -> None:
        self.capacity = capacity          # None: unlimited (replaying a recording whose device is unknown)
        self.used_outside = used_outside  # CUDA context and other processes: never available to the allocator
        self.in_use = 0                   # bytes cudaMalloc'd or mapped by the allocator
        self._holes: list[tuple[int, int]] = []   # freed cudaMalloc ranges (addr, size), sorted by address
        self._malloc_top = _MALLOC_BASE
        self._reserve_top = _RESERVE_BASE
        # (size, addr) of a recording's cudaMallocs, handed out in order while the sizes agree (replays only)
        self._recorded = list(reversed(recorded_addresses or []))

    @property
    def free(self) -> int:
        """What cudaMemGetInfo would report as free."""
        if self.capacity is None:
            return 1 << 62
        return max(self.capacity - self.used_outside - self.in_use, 0)

    def state(self, relative: bool = False) -> tuple:
        """What later cudaMallocs depend on: capacity, use, and where the next address ranges come from; with
        `relative` (the allocator names its ranges by rank: CachingAllocator.state) not where the next reserved
        range lies, which is above every one before it wherever that is."""
        return (self.capacity, self.used_outside, self.in_use, tuple(self._holes), self._malloc_top,
                None if relative else self._reserve_top, tuple(self._recorded))

    def take(self, size: int) -> bool:
        """Back `size` bytes with physical memory (cudaMalloc or cuMemCreate); False when the device is full."""
        if size > self.free:
            return False
        self.in_use += size
        return True

    def give_back(self, size: int) -> None:
        self.in_use -= size

    def malloc_address(self, size: int) -> int:
        """A virtual address for a new cudaMalloc range: the lowest freed range that fits, else fresh space."""
        if self._recorded and self._recorded[-1][0] == size:
            return self._recorded.pop()[1]
        span = _align(size)
        for i, (addr, hole) in enumerate(self._holes):
            if hole >= span:
                if hole == span:
                    del self._holes[i]
                else:
                    self._holes[i] = (addr + span, hole - span)
                return addr
        addr = self._malloc_top
        self._malloc_top += span
        return addr

    def free_address(self, addr: int, size: int) -> None:
        insort(self._holes, (addr, _align(size)))
        merged: list[tuple[int, int]] = []
        for start, span in self._holes:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + span)
            else:
                merged.append((start, span))
        self._holes = merged

    def reserve_address(self, size: int) -> int:
        """Virtual space for an expandable segment (cuMemAddressReserve); never backed until mapped."""
        addr = self._reserve_top
        self._reserve_top += _align(size)
        return addr
