"""The CUDA caching allocator's sizing rules (c10/cuda/CUDACachingAllocator.cpp), shared by the reader and the simulator.

Trace entries record requested bytes; `torch.cuda.memory_allocated()` counts block sizes. `round_size` is the
rule that turns one into the other (a block can still be larger when the remainder of a free block was too
small to split; the reader uses the final block sizes where the snapshot has them).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

MIN_BLOCK_SIZE = 512            # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 << 20            # kSmallSize: requests up to 1 MiB use the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: small-pool segments are 2 MiB
LARGE_BUFFER = 20 << 20         # kLargeBuffer: requests below 10 MiB get a 20 MiB segment
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge: larger segments are rounded to 2 MiB

#: torch's cuBLAS workspace, one per handle and stream, made through this allocator at a thread's first matmul
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, CUBLAS_WORKSPACE_CONFIG unset: ":4096:2:16:8", 32 MiB on sm90)
BLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
BLAS_WORKSPACE_BYTES_SM90 = 4096 * 8 * 1024

_INTERVAL_START_LOG2 = 20       # roundup_power2_divisions intervals start at 1 MiB ...
_INTERVAL_COUNT = 16            # ... and there are 16 of them (1 MiB .. 32 GiB and above)


def division_table(settings: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The roundup_power2_divisions of each interval, in interval order; () when none divides (the default).
    Read once per settings: the allocator model rounds every request with it."""
    table = settings.get("roundup_power2_divisions") if settings else None
    if not isinstance(table, Mapping) or not table:
        return ()
    values = tuple(int(v) for _, v in sorted(table.items(), key=lambda kv: int(kv[0])))
    return values[:_INTERVAL_COUNT] if any(v > 1 for v in values) else ()


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size <= 4 or divisions <= 1 or size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded_floor = size & ~(step - 1)
    return size if rounded_floor == size else rounded_floor + step


def round_with(size: int, divisions: tuple[int, ...]) -> int:
    """`round_size` with the settings' `division_table` read beforehand."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions:
        index = max(size.bit_length() - 1 - _INTERVAL_START_LOG2, 0)
        by = divisions[min(index, len(divisions) - 1)]
        if by > 1 and size > MIN_BLOCK_SIZE * by:
            return _roundup_power2_next_division(size, by)
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def round_size(size: int, settings: Mapping[str, Any] | None = None) -> int:
    """The block size the allocator carves for a request of `size` bytes (before split decisions)."""
    return round_with(size, division_table(settings))


def segment_size(rounded: int) -> int:
    """The cudaMalloc size for a new segment that must hold a block of `rounded` bytes."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def round_sizes(sizes: np.ndarray, settings: Mapping[str, Any] | None = None) -> np.ndarray:
    """`round_size` over an int64 array: vectorised for the default settings (no power-of-2 divisions)."""
    divisions = division_table(settings)
    if divisions:
        return np.fromiter((round_with(int(s), divisions) for s in sizes), dtype=np.int64, count=len(sizes))
    return np.maximum(MIN_BLOCK_SIZE, (sizes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE).astype(np.int64)


def blas_workspace_bytes(compute_capability: tuple[int, int]) -> int | None:
    """The default size of torch's cuBLAS workspace on a CUDA device of this compute capability, where every torch
    that sizes it by architecture agrees: 32 MiB on sm90, 8.125 MiB before it; None on later GPUs, which newer
    versions give 32 MiB and older ones 8.125 MiB."""
    if compute_capability == (9, 0):
        return BLAS_WORKSPACE_BYTES_SM90
    return BLAS_WORKSPACE_BYTES if compute_capability[0] < 9 else None
