"""Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one big virtual range per stream and
pool, backed by physical pages (2 MiB in the small pool, 20 MiB in the large one) only where memory is in use.

Mirrors `ExpandableSegment::map` / `unmap`: mapping covers whole pages and is all-or-nothing (a page that cannot
be created releases the ones created in the same call); unmapping releases only pages that lie entirely inside
the free range.
"""
from __future__ import annotations

from analyzer.simulate.device import DeviceMemory


class ExpandableSegment:
    """One reserved virtual range, mapped and unmapped in whole pages (the blocks record which are mapped)."""

    def __init__(self, device: DeviceMemory, page_size: int) -> None:
        total = device.capacity if device.capacity is not None else 80 << 30
        # the C++ reserves address space for 1 1/8 of the device's memory
        self.page_size = page_size
        self.max_pages = -(-(total + total // 8) // page_size)
        self.device = device
        self.addr = device.reserve_address(self.size)

    @property
    def size(self) -> int:
        return self.max_pages * self.page_size

    def _page_left(self, addr: int) -> int:
        return (addr - self.addr) // self.page_size

    def _page_right(self, addr: int) -> int:
        return -(-(addr - self.addr) // self.page_size)

    def map(self, addr: int, size: int) -> tuple[int, int]:
        """Map the pages covering [addr, addr + size); returns the range mapped, size 0 when the device is full."""
        begin, end = self._page_left(addr), self._page_right(addr + size)
        if begin == end:
            return self.addr + begin * self.page_size, 0
        if not self.device.take((end - begin) * self.page_size):
            return self.addr + begin * self.page_size, 0
        return self.addr + begin * self.page_size, (end - begin) * self.page_size

    def unmap(self, addr: int, size: int) -> tuple[int, int]:
        """Unmap the pages lying wholly inside [addr, addr + size); returns the range released (size may be 0)."""
        begin, end = self._page_right(addr), self._page_left(addr + size)
        if begin >= end:
            return addr, 0
        self.device.give_back((end - begin) * self.page_size)
        return self.addr + begin * self.page_size, (end - begin) * self.page_size
