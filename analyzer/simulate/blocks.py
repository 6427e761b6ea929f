"""Blocks and block pools: the data structures of the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

A segment is not an object of its own, as in the C++: it is a chain of blocks linked by `prev`/`next`, whose
head has `prev is None`. Free blocks live in their pool's `blocks` set ordered by (stream, size, address), so
that a best-fit search is a lower-bound lookup; unmapped address ranges of expandable segments live in
`unmapped`, ordered by (stream, address), so that the lowest address is found first.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from analyzer.simulate.expandable import ExpandableSegment


@dataclass(frozen=True)
class CallContext:
    """What the allocator records with an entry: when it happened and the Python stack (innermost first)."""

    time_us: int
    frames: list[dict[str, Any]] = field(default_factory=list)


NO_CONTEXT = CallContext(0)


@dataclass(eq=False)
class Block:
    """A range of device memory: allocated to a tensor, cached free, or (expandable) not backed by pages."""

    stream: int
    size: int
    addr: int
    pool: BlockPool
    allocated: bool = False
    requested: int = 0              # kept after a free, as the C++ keeps requested_size
    mapped: bool = True
    prev: Block | None = None
    next: Block | None = None
    expandable: ExpandableSegment | None = None
    context: CallContext | None = None          # when handed out (None while free)
    segment_context: CallContext | None = None  # when its segment was created (head blocks only)

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def size_key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


class _SortedBlocks:
    """A set of blocks ordered by a key tuple, with lower-bound search (std::set in the C++). The key is built
    in place, not by a key function: a replay adds and removes blocks hundreds of thousands of times."""

    def __init__(self, by_size: bool) -> None:
        self._by_size = by_size
        self._keys: list[tuple] = []
        self._blocks: dict[tuple, Block] = {}

    def add(self, block: Block) -> None:
        key = (block.stream, block.size, block.addr) if self._by_size else (block.stream, block.addr)
        blocks = self._blocks
        if key in blocks:
            raise AssertionError(f"block {key} inserted twice")
        insort(self._keys, key)
        blocks[key] = block

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.addr) if self._by_size else (block.stream, block.addr)
        if self._blocks.pop(key, None) is not block:
            raise AssertionError(f"block {key} is not in the set")
        keys = self._keys
        del keys[bisect_left(keys, key)]

    def lower_bound(self, key: tuple) -> tuple[int, Block | None]:
        """The place of the first block at or after `key`, and that block (None past the last): a best fit's
        one lookup."""
        keys = self._keys
        i = bisect_left(keys, key)
        return i, (self._blocks[keys[i]] if i < len(keys) else None)

    def remove_at(self, i: int) -> None:
        """Remove the block at place `i` (`remove` without looking for its place again)."""
        del self._blocks[self._keys.pop(i)]

    def __iter__(self) -> Iterator[Block]:
        return iter([self._blocks[k] for k in self._keys])

    def from_key(self, key: tuple) -> Iterator[Block]:
        """Blocks at or after `key`, in order (lower_bound and onwards), walked in place rather than copied: a
        best fit reads one or two of thousands. The set must not change while the walk goes on."""
        keys, i = self._keys, bisect_left(self._keys, key)
        while i < len(keys):
            yield self._blocks[keys[i]]
            i += 1

    def before_key(self, key: tuple) -> Iterator[Block]:
        """Blocks strictly before `key`, last first (for the C++ loops that walk back from a lower bound)."""
        for k in reversed(self._keys[:bisect_left(self._keys, key)]):
            yield self._blocks[k]


class BlockPool:
    """The small (≤ 1 MiB) or large pool: cached free blocks, and unmapped ranges of expandable segments."""

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks = _SortedBlocks(by_size=True)
        self.unmapped = _SortedBlocks(by_size=False)
