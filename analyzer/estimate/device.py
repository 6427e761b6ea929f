"""The memory a GPU gives away before and around PyTorch's allocator: what `torch.cuda.max_memory_allocated()`
counts that the model's tensors are not (the cuBLAS and Transformer Engine workspaces, the batch), and what it
never counts but still takes the card (the CUDA context, NCCL's buffers, the caching allocator's headroom).

These are estimates, not calibrated on the functional tests (which log allocated bytes only): the CUDA context
of a CUDA 12 process with lazy module loading is about 0.5 GiB; NCCL keeps, per communicator a rank has used,
buffers for each channel and peer direction (NCCL_BUFFSIZE, 4 MiB by default, plus the LL and LL128 protocols'
smaller ones: about 4.6 MiB a channel and direction, 16 channels on NVLink); the caching allocator reserves
more than it hands out (rounding, blocks split and cached): 10% of the peak allocated is kept as headroom.
"""
from __future__ import annotations

from dataclasses import dataclass

from analyzer.estimate.config import TrainingConfig

MiB = 2**20
TORCH_CUBLAS_WORKSPACE = 32 * MiB     # CUBLAS_WORKSPACE_CONFIG=:4096:8 (Megatron's tests set it): 8 x 4 MiB
TE_WORKSPACE = {True: 32 * MiB + 1024, False: 4 * MiB}   # Transformer Engine's cuBLASLt workspace: sm90+ or not
CUDA_CONTEXT = 512 * MiB
NCCL_CHANNEL_BUFFERS = 4.6 * MiB       # one channel, one direction, all three protocols
NCCL_CHANNELS = 16
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class Device:
    """A GPU as the estimate needs it: its memory and whether it is Hopper or newer (compute capability 9+)."""

    memory: int | None = None
    hopper: bool = True


def workspaces(c: TrainingConfig, device: Device) -> int:
    """Inside the allocator but not the model's: PyTorch's and Transformer Engine's cuBLAS workspaces and the
    micro-batch itself (token ids, labels, positions as int64, the loss mask in fp32, the causal mask a byte a
    pair)."""
    b, s = c.micro_batch, c.seq // c.cp
    batch = b * s * (8 + 8 + 8 + 4) + b * s * c.seq
    return int(TORCH_CUBLAS_WORKSPACE + TE_WORKSPACE[device.hopper] + batch)


def communicators(c: TrainingConfig) -> dict[str, int]:
    """The NCCL communicators a rank uses (groups of more than one rank), with their sizes."""
    groups = {"data_parallel": c.dp * c.cp, "tensor_parallel": c.tp, "pipeline_parallel": c.pp,
              "context_parallel": c.cp}
    if c.moe is not None:
        groups |= {"expert_parallel": c.ep * c.expert_tp, "expert_data_parallel": c.expert_dp}
    if c.pp > 1 and not c.untied:
        groups["embedding"] = 2             # the first and last stages share the tied embedding's gradient
    return {name: size for name, size in groups.items() if size > 1}


def outside_allocator(c: TrainingConfig, peak_allocated: int) -> dict[str, int]:
    """What the card loses outside max_memory_allocated, by part."""
    nccl = len(communicators(c)) * 2 * NCCL_CHANNELS * NCCL_CHANNEL_BUFFERS
    return {"cuda_context": CUDA_CONTEXT, "nccl_buffers": int(nccl),
            "fragmentation_headroom": int(FRAGMENTATION * peak_allocated)}
