"""Library workspaces: memory torch's BLAS handle pool keeps for the process, `other` whatever pass made it.

torch keeps one cuBLAS / cuBLASLt workspace per thread and stream (aten/src/ATen/cuda/CublasHandlePool.cpp:
8.125 MiB by default, 32 MiB on sm90), made through the caching allocator at the thread's first matmul and never
freed. Left to the lifetime rules it reads as whatever that first matmul's pass made: a forward activation that
never dies, a gradient, or, made before the recording, a parameter. What tells it apart, strongest first:

1. the C++ frames (`stacks="all"`) show the handle pool making it (`frames:blas-workspace`);
2. a frameless block from before the recording, kept to the end, of a size rule 1 found
   (`structure:blas-workspace-size`: the main thread's, made before recording, beside the autograd thread's);
3. a profiler trace's reader set it apart from what lived before the trace (`DeviceInfo.workspace_before_bytes`);
4. the default size itself, 8,519,680 B (8 MiB + 128 KiB: no round tensor has it), kept to the end and never
   made or freed otherwise on its device, at most one a thread (MAX_WORKSPACES), not while loading: with Python
   frames only nothing else says so (`structure:blas-workspace-size`). The sm90 default, 32 MiB, is a size many
   tensors have: it needs rule 1.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.core.allocator_rules import BLAS_WORKSPACE_BYTES
from analyzer.core.vocabulary import Category, Phase

#: the category signals of a workspace: what the frames show made it; its size (a structural guess)
WORKSPACE, WORKSPACE_SIZE = "frames:blas-workspace", "structure:blas-workspace-size"
MAX_WORKSPACES = 2   # handles a training process has on a device: the main thread's and autograd's


def label_workspaces(a: pd.DataFrame, stacks: np.ndarray, made_by_blas: np.ndarray, phase: np.ndarray,
                     category: np.ndarray, source: np.ndarray, set_apart: dict[int, int | None]) -> np.ndarray:
    """Label the workspaces among the rows of `a` (one device or several) `other`, in `category` and its
    `source` in place. `stacks`: each row's stack id (-1: none); `made_by_blas`: its frames show the handle pool
    making it; `set_apart`: device -> the workspace a profiler trace's reader set apart. Returns the rows so
    labelled that were made before the recording: no pass is known to have made them."""
    other = Category.OTHER.value
    category[made_by_blas], source[made_by_blas] = other, WORKSPACE
    sizes = a["requested_bytes"].to_numpy()
    kept = a["t_free_us"].isna().to_numpy() & a["seq_free"].isna().to_numpy()
    origin = a["origin"].astype(str).to_numpy()
    before = kept & (stacks < 0) & (origin != "trace")
    twin = before & np.isin(sizes, sizes[made_by_blas])
    devices = a["device"].to_numpy()
    for device, size in set_apart.items():
        if size:
            twin |= before & (devices == device) & (sizes == size) & (origin == "end_state")
    twin |= _of_the_default_size(devices, sizes, kept, phase) & ~made_by_blas
    category[twin], source[twin] = other, WORKSPACE_SIZE
    return twin & (origin != "trace") & (stacks < 0)   # rule 1 needs frames: its rows are never among these


def _of_the_default_size(devices: np.ndarray, sizes: np.ndarray, kept: np.ndarray, phase: np.ndarray) -> np.ndarray:
    """Rule 4: on each device, the rows of the default workspace size, where every such row is kept to the end,
    none was made while loading, and there are at most MAX_WORKSPACES of them."""
    out = np.zeros(len(sizes), dtype=bool)
    for device in np.unique(devices):
        rows = (devices == device) & (sizes == BLAS_WORKSPACE_BYTES)
        if rows.any() and rows.sum() <= MAX_WORKSPACES and kept[rows].all() and not (phase[rows] == Phase.LOAD).any():
            out |= rows
    return out
