"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator).

Rules implemented, each as the C++ does it:
- requests are rounded (`round_size`: 512 B multiples, or roundup_power2_divisions when configured);
- requests of ≤ 1 MiB (rounded) use the small pool, larger ones the large pool; blocks are cached per
  (pool, stream) and a request is served by the best fit: the smallest free block of the same stream that is
  large enough, ties broken by address (`get_free_block`);
- with max_split_size set, a request below it never takes a block at or above it, and a request above it only
  takes a block less than max_non_split_rounding_size (default 20 MiB) larger than itself;
- a new segment is cudaMalloc'd when nothing fits (`get_allocation_size`): 2 MiB for small requests, 20 MiB
  for requests below 10 MiB, the request rounded up to 2 MiB above that;
- a block is split when the remainder is worth keeping (`should_split`): ≥ 512 B in the small pool or with
  expandable segments, > 1 MiB in the large pool (and only below max_split_size);
- a freed block merges with free neighbours of its segment (`free_block` / `try_merge_blocks`);
- when cudaMalloc fails the allocator frees cached oversize blocks (with max_split_size), then every cached
  segment that is not split (`release_cached_blocks`), and retries; when that fails too it records an `oom`
  entry with cudaMemGetInfo's free bytes and the rounded size, and raises. The snapshot taken then shows only
  what could not be released: memory held by split segments (fragmentation) and live blocks;
- expandable segments: one virtual range per (pool, stream), pages mapped on demand at the lowest free
  address (`find_expandable_block`, `map_block`), free pages unmapped when memory runs out (`unmap_block`);
  `segment_map` / `segment_unmap` entries instead of `segment_alloc` / `segment_free`;
- `empty_cache()` releases every unsplit cached segment, as `torch.cuda.empty_cache()` does.

Left out, because they need information a CPU trace does not have or matter only for rare programs:
cudaMallocAsync (`backend:cudaMallocAsync` bypasses all of this); CUDA graph private pools and user memory
pools; frees of blocks used on other streams (recordStream), which the real allocator completes later, after
an event: here `free_completed` always follows `free_requested` at once; garbage_collection_threshold and
per-process memory fractions; free-memory callbacks; IPC sharing.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from analyzer.core.allocator_rules import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    division_table,
    round_with,
    segment_size,
)
from analyzer.simulate.blocks import NO_CONTEXT, Block, BlockPool, CallContext
from analyzer.simulate.device import DeviceMemory
from analyzer.simulate.expandable import ExpandableSegment

_NO_LIMIT = (1 << 64) - 1   # SIZE_MAX: max_split_size when it is not configured


@dataclass(frozen=True)
class AllocatorSettings:
    """The PYTORCH_CUDA_ALLOC_CONF options the model honours."""

    expandable_segments: bool = False
    max_split_size: int | None = None                    # bytes; None = not set (no limit)
    max_non_split_rounding_size: int = LARGE_BUFFER
    roundup_power2_divisions: dict[str, int] = field(default_factory=dict)

    @property
    def split_limit(self) -> int:
        return self.max_split_size if self.max_split_size is not None else _NO_LIMIT

    def conf_string(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size >> 20}")
        return ",".join(parts)


class SimulatedOutOfMemory(Exception):
    """The allocator could not serve a request, even after releasing its cache (torch.OutOfMemoryError)."""

    def __init__(self, requested: int, rounded: int, alloc_size: int, device_free: int,
                 allocated: int, reserved: int) -> None:
        self.requested, self.rounded, self.alloc_size = requested, rounded, alloc_size
        self.device_free, self.allocated, self.reserved = device_free, allocated, reserved
        super().__init__(f"CUDA out of memory. Tried to allocate {alloc_size} bytes; {device_free} bytes free; "
                         f"{allocated} allocated by PyTorch, {reserved - allocated} reserved but unallocated")


class _Places(list):
    """Blocks' addresses as `CachingAllocator.state` names them; `relative`: by range rank and offset."""

    def __init__(self, named: list[tuple[int, int]], relative: bool) -> None:
        super().__init__(named)
        self.relative = relative


class CachingAllocator:
    """One device's caching allocator; every action is appended to `trace` as a torch snapshot trace entry."""

    def __init__(self, device: DeviceMemory, settings: AllocatorSettings = AllocatorSettings(),
                 device_index: int = 0, record: bool = True) -> None:
        self.device = device
        self.settings = settings
        self.device_index = device_index
        self.small = BlockPool(is_small=True)
        self.large = BlockPool(is_small=False)
        self.active: set[Block] = set()
        self.trace: list[dict[str, Any]] = []
        self.record = record            # False: decisions only, no trace (a replay's prediction needs no snapshot)
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self._divisions = division_table({"roundup_power2_divisions": settings.roundup_power2_divisions})
        self._rounded: dict[int, int] = {}     # request size -> rounded: a replay asks the same sizes again and again
        self._split_limit = settings.split_limit
        self._split_any = settings.expandable_segments   # every pool splits off remainders of MIN_BLOCK_SIZE

    # ---- public API --------------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0, ctx: CallContext = NO_CONTEXT) -> Block:
        """Serve a request of `size` bytes, as DeviceCachingAllocator::malloc; raises SimulatedOutOfMemory."""
        rounded = self._rounded.get(size)
        if rounded is None:
            rounded = self._rounded[size] = round_with(size, self._divisions)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, rounded, stream)
        if block is None:
            alloc_size = segment_size(rounded)
            block = self._alloc_block(pool, rounded, alloc_size, stream, ctx)
            if block is None and self._release_available_cached_blocks(pool, rounded, stream, ctx):
                block = self._alloc_block(pool, rounded, alloc_size, stream, ctx)
            if block is None and self.release_cached_blocks(ctx):
                block = self._alloc_block(pool, rounded, alloc_size, stream, ctx)
            if block is None:
                free = self.device.free
                self._record("oom", None, rounded, stream, ctx, device_free=free)
                raise SimulatedOutOfMemory(size, rounded, alloc_size, free, self.allocated_bytes, self.reserved_bytes)
        return self._alloc_found_block(block, rounded, size, stream, ctx)

    def free(self, block: Block, ctx: CallContext | None = None) -> None:
        """Return a block to the cache (free_requested, then free_completed at once: one stream)."""
        if not block.allocated:
            raise AssertionError(f"double free of {block.addr:#x}")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.active.discard(block)
        if self.record:
            ctx = ctx or block.context or NO_CONTEXT
            self._record("free_requested", block.addr, block.requested, block.stream, ctx)
            self._record("free_completed", block.addr, block.requested, block.stream, ctx)
        self._free_block(block)

    def empty_cache(self, ctx: CallContext = NO_CONTEXT) -> None:
        """torch.cuda.empty_cache(): release every cached segment that is not split."""
        self.release_cached_blocks(ctx)

    def state(self) -> tuple:
        """Everything the model's later decisions depend on: every block of every segment (free, allocated or
        unmapped; where its segment begins and ends), the device, and the byte counts. Two models in equal states
        serve the same requests the same way (analyzer.simulate.requests skips repeated periods by it).

        Where every segment is expandable, a block's address is named by its range's rank and its offset in the
        range: a range is reserved at fresh addresses, above every range before it, so two states that differ
        only by where their ranges lie, in the same order, make the same decisions (the model compares addresses,
        never adds one range's to another's). A run that empties its cache every step reserves its ranges anew
        each time: its states repeat only so."""
        every = (*self.small.blocks, *self.large.blocks, *self.small.unmapped, *self.large.unmapped, *self.active)
        where = self._places(every)
        blocks = sorted((where[k], b.size, b.stream, b.allocated, b.mapped, b.pool.is_small, b.prev is None,
                         b.next is None, None if b.expandable is None else where[k][:1] + (b.expandable.size,))
                        for k, b in enumerate(every))
        return tuple(blocks), self.allocated_bytes, self.reserved_bytes, self.device.state(relative=where.relative)

    def places(self, blocks: list[Block | None]) -> tuple:
        """Where each of `blocks` lies (None: nowhere), named as `state` names addresses."""
        every = (*self.small.blocks, *self.large.blocks, *self.small.unmapped, *self.large.unmapped, *self.active)
        where = self._places(every, blocks)
        return tuple(where[len(every) + k] for k in range(len(blocks)))

    @staticmethod
    def _places(every: tuple[Block, ...], more: Sequence[Block | None] = ()) -> _Places:
        ranges = sorted({b.expandable.addr for b in every if b.expandable is not None})
        relative = bool(ranges) and all(b.expandable is not None for b in every)
        rank = {addr: k for k, addr in enumerate(ranges)}
        named: list[tuple[int, int]] = []
        for b in (*every, *more):
            if b is None:
                named.append((-2, -1))
            elif relative and b.expandable is not None:
                named.append((rank.get(b.expandable.addr, -3), b.addr - b.expandable.addr))
            else:
                named.append((-1, b.addr))
        return _Places(named, relative)

    def all_blocks(self) -> list[Block]:
        """Mapped blocks, free and allocated (what `snapshot()` walks; unmapped ranges are not memory)."""
        return [*self.small.blocks, *self.large.blocks, *self.active]

    # ---- finding and carving blocks ----------------------------------------------------------------
    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        free = pool.blocks
        found, block = free.lower_bound((stream, size, 0))
        if block is None or block.stream != stream:
            return None
        if block.expandable is not None:
            candidates = free.from_key((stream, size, 0))
            next(candidates)
            if self.settings.expandable_segments:
                # best fit counts the unmapped space after a block as part of it: prefer blocks that cannot grow
                for nxt in candidates:
                    if (block.expandable is None or nxt.stream != stream
                            or self._expandable_size(nxt) >= self._expandable_size(block)):
                        break
                    block = nxt
            else:
                block = next((b for b in candidates if b.expandable is None or b.stream != stream), None)
                if block is None or block.stream != stream:
                    return None
            found = -1   # another block than the lower bound's
        limit = self._split_limit
        if size < limit <= block.size:
            return None
        if size >= limit and block.size >= size + self.settings.max_non_split_rounding_size:
            return None
        if found < 0:
            free.remove(block)
        else:
            free.remove_at(found)
        return block

    @staticmethod
    def _expandable_size(block: Block) -> int:
        nxt = block.next
        return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _alloc_found_block(self, block: Block, size: int, requested: int, stream: int, ctx: CallContext) -> Block:
        # should_split: a remainder worth keeping (any of 512 B in the small pool or with expandable segments, of
        # over 1 MiB in the large pool, and only below max_split_size)
        remaining_size = block.size - size
        if remaining_size >= MIN_BLOCK_SIZE and (block.pool.is_small or self._split_any
                                                 or remaining_size > SMALL_SIZE and size < self._split_limit):
            # the front part becomes a new block; the original object (and its segment record) is the remainder,
            # which is why a split segment's snapshot entry has no frames, in torch as here
            remaining = block
            block = Block(stream=stream, size=size, addr=remaining.addr, pool=remaining.pool,
                          expandable=remaining.expandable, prev=remaining.prev, next=remaining)
            if block.prev is not None:
                block.prev.next = block
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            remaining.pool.blocks.add(remaining)
        block.allocated = True
        block.requested = requested
        block.context = ctx
        self.active.add(block)
        self.allocated_bytes += block.size
        if self.record:
            self._record("alloc", block.addr, requested, block.stream, ctx)
        return block

    # ---- getting memory from the device ------------------------------------------------------------
    def _alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, ctx: CallContext) -> Block | None:
        if self.settings.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream, ctx)
        if not self.device.take(alloc_size):
            return None
        block = Block(stream=stream, size=alloc_size, addr=self.device.malloc_address(alloc_size), pool=pool,
                      segment_context=ctx)
        self.reserved_bytes += alloc_size
        self._record("segment_alloc", block.addr, alloc_size, stream, ctx)
        return block

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int, ctx: CallContext) -> bool:
        """With max_split_size: free one cached oversize block big enough, else the largest ones until enough."""
        limit = self.settings.split_limit
        if limit == _NO_LIMIT:
            return False
        key = (stream, max(size, limit), 0)
        found = next(pool.blocks.from_key(key), None)
        if found is not None and found.stream == stream and found.expandable is None:
            self._release_block(found, ctx)
            return True
        released = 0
        for block in list(pool.blocks.before_key(found.size_key() if found is not None else (stream + 1, 0, 0))):
            if released >= key[1] or block.size < limit or block.stream != stream:
                break
            if block.expandable is None:
                released += block.size
                self._release_block(block, ctx)
        return released >= key[1]

    def release_cached_blocks(self, ctx: CallContext) -> bool:
        """Free every cached block that is a whole segment; unmap free pages of expandable segments."""
        for pool in (self.large, self.small):
            to_unmap = []
            for block in pool.blocks:
                if block.expandable is not None:
                    to_unmap.append(block)
                elif not block.is_split:
                    self._release_block(block, ctx)
            for block in to_unmap:
                self._unmap_block(block, ctx)
                if not block.is_split:   # wholly unmapped: the virtual range itself goes (no trace entry)
                    pool.unmapped.remove(block)
        return True

    def _release_block(self, block: Block, ctx: CallContext) -> None:
        self._record("segment_free", block.addr, block.size, block.stream, ctx)
        self.device.give_back(block.size)
        self.device.free_address(block.addr, block.size)
        self.reserved_bytes -= block.size
        block.pool.blocks.remove(block)

    # ---- returning blocks to the cache -------------------------------------------------------------
    def _free_block(self, block: Block) -> None:
        block.context = None
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            self._try_merge(block, before)
        if after is not None and not after.allocated:
            self._try_merge(block, after)
        block.pool.blocks.add(block)

    @staticmethod
    def _try_merge(dst: Block, src: Block | None) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            dst.segment_context = src.segment_context
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        (src.pool.blocks if src.mapped else src.pool.unmapped).remove(src)
        return src.size

    # ---- expandable segments -----------------------------------------------------------------------
    def _find_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        def allocatable(b: Block | None) -> TypeGuard[Block]:
            return b is not None and not b.allocated

        def has_room(b: Block | None) -> bool:
            room = 0
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            return room >= size

        for candidate in pool.unmapped.from_key((stream, 0)):
            if candidate.stream != stream:
                break
            if allocatable(candidate.prev):
                candidate = candidate.prev
            if has_room(candidate):
                return candidate
        segment = ExpandableSegment(self.device, SMALL_BUFFER if pool.is_small else LARGE_BUFFER)
        if segment.size < size:
            return None
        block = Block(stream=stream, size=segment.size, addr=segment.addr, pool=pool, mapped=False,
                      expandable=segment)
        pool.unmapped.add(block)
        return block

    def _map_block(self, block: Block, size: int, ctx: CallContext) -> bool:
        assert block.expandable is not None, "only ranges of expandable segments are mapped"
        addr, mapped = block.expandable.map(block.addr, size)
        if mapped == 0:
            return False
        pool = block.pool
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(stream=block.stream, size=block.size - mapped, addr=block.addr + mapped, pool=pool,
                         mapped=False, expandable=block.expandable, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.unmapped.add(rest)
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.blocks.add(block)
        self.reserved_bytes += mapped
        self._record("segment_map", addr, mapped, block.stream, ctx)
        if block.prev is None and block.segment_context is None:
            block.segment_context = ctx
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int, stream: int, ctx: CallContext) -> Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), ctx):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None, "_find_expandable_block checked the room up to `size`"
            if not self._map_block(following, min(size - candidate.size, following.size), ctx):
                return None
            candidate = following
        pool.blocks.remove(candidate)
        return candidate

    def _unmap_block(self, block: Block, ctx: CallContext) -> None:
        assert block.expandable is not None, "only blocks of expandable segments are unmapped"
        addr, size = block.expandable.unmap(block.addr, block.size)
        if size == 0:
            return
        pool = block.pool
        pool.blocks.remove(block)
        before = addr - block.addr
        if before > 0:
            head = Block(stream=block.stream, size=before, addr=block.addr, pool=pool, expandable=block.expandable,
                         prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pool.blocks.add(head)
        after = block.size - before - size
        if after > 0:
            tail = Block(stream=block.stream, size=after, addr=addr + size, pool=pool, expandable=block.expandable,
                         prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.blocks.add(tail)
        block.addr, block.size, block.mapped = addr, size, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.unmapped.add(block)
        self.reserved_bytes -= size
        self._record("segment_unmap", addr, size, block.stream, ctx)

    # ---- history -----------------------------------------------------------------------------------
    def _record(self, action: str, addr: int | None, size: int, stream: int, ctx: CallContext,
                device_free: int | None = None) -> None:
        if not self.record:
            return
        entry: dict[str, Any] = {"action": action}
        if addr is None:
            entry["device_free"] = device_free
        else:
            entry["addr"] = addr
        entry.update(size=size, stream=stream, time_us=ctx.time_us, compile_context="N/A", user_metadata="",
                     frames=ctx.frames)
        self.trace.append(entry)
