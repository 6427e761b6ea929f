"""A GPT training run and the same run with one remedy applied, for checking what a remedy does to the peak.

`RemedySetup` is one configuration of the scenarios' GPT; `apply(setup, remedy)` is that configuration changed
as the remedy changes a real run: the micro-batch halved, gradient accumulation over two micro-batches of half
the size (the runner's `micro_batches`), every block under `torch.utils.checkpoint`, bf16 autocast with CUDA's
op lists (`cuda_autocast_policy`), ZeRO stage 1 or 2 as rank 0 of N GPUs sees it (`ShardedAdam`: Adam's state
for its 1/N of every parameter; from stage 2 each gradient is reduce-scattered to its shard as it is made), ZeRO-3
/ FSDP full sharding (`fully_shard`: every block one unit, the rest of the model the root unit; parameters
gathered per unit as it runs, gradients reduce-scattered per unit), and 8-bit Adam (`Adam8bit`: uint8 moments with a scale per 2048 values). `simulate(setup)` traces two optimizer
steps under FakeTensorMode and replays them on an 80 GiB device (nothing runs out: the peak is the demand).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from analyzer.core.vocabulary import RemedyId
from analyzer.simulate.allocator import AllocatorSettings
from analyzer.simulate.gpt import GPT, Attention, Block, GPTConfig
from analyzer.simulate.runner import TrainingLoop, simulate_to_files, trace_training
from analyzer.simulate.simulation import Simulation

GiB = 1 << 30
DEVICE = 80 * GiB
STEPS = 2                  # the second step has Adam's state and the first step's gradients freed: the steady peak
_QUANT_BLOCK = 2048        # bitsandbytes' block size for 8-bit optimizer state


class FusedAttention(Attention):
    """Attention through scaled_dot_product_attention: no b·h·s² score tensors are kept for backward."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class CheckpointedBlock(Block):
    """A block whose activations are recomputed in backward: only its input is kept."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, mask, use_reentrant=False)


def model(config: GPTConfig, fused_attention: bool, checkpointing: bool) -> GPT:
    """The scenarios' GPT with its blocks and attention retyped in place: only `forward` changes, so parameters
    and module names stay those of `analyzer.simulate.gpt`."""
    gpt = GPT(config)
    for block in gpt.layers:
        if checkpointing:
            block.__class__ = CheckpointedBlock
        if fused_attention:
            block.attn.__class__ = FusedAttention
    return gpt


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While open, CPU autocast casts as CUDA autocast does for the ops where the two differ in a transformer:
    softmax and log_softmax produce fp32 (CUDA's fp32_set_opt_dtype), layer_norm runs in fp32."""
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def fp32_output(op: Callable) -> Callable:
        def kernel(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return op(x, dim, dtype=torch.float32 if x.is_floating_point() else dtype)
        return kernel

    def layer_norm(x: torch.Tensor, shape: list[int], weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, cudnn_enable: bool = True) -> torch.Tensor:
        fp32 = [t.float() if t is not None and t.is_floating_point() else t for t in (x, weight, bias)]
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return torch.ops.aten.layer_norm(fp32[0], shape, fp32[1], fp32[2], eps, cudnn_enable)

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("softmax.int", fp32_output(torch.ops.aten.softmax.int), "AutocastCPU")
        library.impl("log_softmax.int", fp32_output(torch.ops.aten.log_softmax.int), "AutocastCPU")
        library.impl("layer_norm", layer_norm, "AutocastCPU")
        yield
    finally:
        library._destroy()


def _shard(p: torch.Tensor, shards: int) -> torch.Tensor:
    """Rank 0's share of a parameter: the first ceil(numel / N) values of its flat storage (a view)."""
    return p.detach().view(-1)[: -(-p.numel() // shards)]


class ShardedAdam(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 as rank 0 sees it: Adam over its 1/N shard of every parameter (state 1/N); stage 2
    replaces each gradient, once accumulated, by its shard (the reduce-scatter: the gradient of its shard's view),
    so full gradients are transient. The all-gather of updated shards writes into the parameters in place: no
    memory of its own."""

    def __init__(self, params: Iterable[torch.nn.Parameter], shards: int, stage: int) -> None:
        params = list(params)
        super().__init__(params, {})
        self.views = [_shard(p, shards) for p in params]
        self.inner = torch.optim.Adam(self.views, lr=3e-4, foreach=True)
        if stage >= 2:
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._reduce_scatter(p, i))

    def _reduce_scatter(self, p: torch.Tensor, i: int) -> None:
        assert p.grad is not None
        self.views[i].grad = p.grad.view(-1)[: self.views[i].numel()].clone()
        p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:   # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        for p, view in zip(params, self.views, strict=True):
            if view.grad is None and p.grad is not None:     # stage 1: the shard of the full gradient
                view.grad = p.grad.view(-1)[: view.numel()]
        self.inner.step()
        for view in self.views:
            view.grad = None


class ShardedUnit:
    """One FSDP unit as rank 0 of N sees it: each parameter holds its first ceil(numel / N) values between uses;
    `gather` all-gathers the unit into one flat buffer of its unsharded size and points every parameter at its
    part; `reshard` frees the buffer. When the last of the unit's gradients is accumulated they are
    reduce-scattered: flattened into a buffer of the unit's size, rank 0's shard of each kept as its gradient,
    the full gradients, the buffer and the gathered parameters freed."""

    def __init__(self, owners: list[tuple[torch.nn.Module, str]], shards: int) -> None:
        self.shapes = [getattr(m, n).shape for m, n in owners]
        self.params = []
        for module, name in owners:       # materialized as shards only, as FSDP's meta-device init does
            meta = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(torch.empty(-(-meta.numel() // shards), dtype=meta.dtype)))
            self.params.append(getattr(module, name))
        self.shards = [p.data for p in self.params]
        self.buffer: torch.Tensor | None = None
        self.ready = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def gather(self) -> None:
        if self.buffer is not None:
            return
        self.buffer = torch.empty(sum(s.numel() for s in self.shapes), dtype=self.shards[0].dtype)
        offset = 0
        for p, shard, shape in zip(self.params, self.shards, self.shapes, strict=True):
            part = self.buffer[offset: offset + shape.numel()]
            part[: shard.numel()].copy_(shard)          # the rest comes from the other ranks
            p.data = part.view(shape)
            offset += shape.numel()

    def reshard(self) -> None:
        for p, shard in zip(self.params, self.shards, strict=True):
            p.data = shard
        self.buffer = None

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.buffer is not None and tensor.untyped_storage()._cdata == self.buffer.untyped_storage()._cdata

    def _gradient_ready(self, _: torch.Tensor) -> None:
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0
        flat = torch.cat([p.grad.view(-1) for p in self.params if p.grad is not None])
        grads, offset = [], 0
        for shard, shape in zip(self.shards, self.shapes, strict=True):
            grads.append(flat[offset: offset + shard.numel()].clone())
            offset += shape.numel()
        del flat
        for p in self.params:
            p.grad = None
        self.reshard()
        for p, grad in zip(self.params, grads, strict=True):
            p.grad = grad


def fully_shard(gpt: GPT, shards: int) -> GPT:
    """ZeRO-3 / FSDP full sharding of a GPT built on the meta device, as rank 0 of `shards` GPUs runs it (no
    prefetching): each block is a unit gathered just before its forward and freed after it, gathered again when
    its output's gradient arrives and freed after its gradients are reduce-scattered; the root unit (embeddings,
    final norm, head) stays gathered from the forward's start to the end of its backward, as FSDP keeps the
    root's. Saved tensors that are views of a gathered buffer are saved as their place in it and read back from
    the buffer gathered for backward, so a freed buffer holds no memory in between."""
    in_blocks = {id(m) for block in gpt.layers for m in block.modules()}
    units = [ShardedUnit([(m, n) for m in block.modules() for n, _ in m.named_parameters(recurse=False)], shards)
             for block in gpt.layers]
    root = ShardedUnit([(m, n) for m in gpt.modules() if id(m) not in in_blocks
                        for n, _ in m.named_parameters(recurse=False)], shards)
    gpt.causal_mask = torch.ones(gpt.get_buffer("causal_mask").shape, dtype=torch.bool).tril()  # not sharded
    everything = [root, *units]

    def pack(t: torch.Tensor) -> Any:
        unit = next((u for u in everything if u.holds(t)), None)
        return t if unit is None else (unit, t.size(), t.stride(), t.storage_offset())

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        unit, size, stride, offset = saved
        assert unit.buffer is not None, "a unit is gathered before its backward"
        return unit.buffer.as_strided(size, stride, offset)

    saving = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def root_forward(module: torch.nn.Module, args: Any) -> None:
        root.gather()
        saving.__enter__()

    gpt.register_forward_pre_hook(root_forward)
    gpt.register_forward_hook(lambda module, args, out: saving.__exit__(None, None, None))
    for block, unit in zip(gpt.layers, units, strict=True):
        block.register_forward_pre_hook(lambda module, args, unit=unit: unit.gather())
        block.register_forward_hook(lambda module, args, out, unit=unit: _after_forward(unit, out))
    return gpt


def _after_forward(unit: ShardedUnit, out: torch.Tensor) -> None:
    unit.reshard()
    if out.requires_grad:
        out.register_hook(lambda grad: unit.gather())


class Adam8bit(torch.optim.Optimizer):
    """Adam with both moments in uint8 and one fp32 scale per 2048 values (bitsandbytes' AdamW8bit layout);
    each parameter's update dequantizes into temporaries and quantizes back."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 3e-4) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:   # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    blocks = -(-p.numel() // _QUANT_BLOCK)
                    for name in ("m", "v"):
                        state[name] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
                        state[name + "_scale"] = torch.ones(blocks, device=p.device)
                m = state["m"].float().mul_(0.9).add_(p.grad, alpha=0.1)
                v = state["v"].float().mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.addcdiv_(m, v.sqrt_().add_(1e-8), value=-group["lr"])
                state["m"].copy_(m.clamp_(0, 255))
                state["v"].copy_(v.clamp_(0, 255))


@dataclass(frozen=True)
class RemedySetup:
    """One training configuration; a remedy is a change of it."""

    name: str
    config: GPTConfig
    batch: int
    seq: int
    fused_attention: bool = False
    checkpointing: bool = False
    bf16: bool = False
    micro_batches: int = 1
    zero_stage: int = 0
    shards: int = 1
    optimizer_8bit: bool = False

    def loop(self) -> TrainingLoop:
        config, micro = self.config, self.batch // self.micro_batches

        def model_fn() -> GPT:
            return model(config, self.fused_attention, self.checkpointing)

        if self.zero_stage == 3:
            with torch.device("meta"):                 # built outside the tracer: only the shards are allocated
                meta = model_fn()
            model_fn = lambda: fully_shard(meta, self.shards)   # noqa: E731

        def optimizer_fn(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
            if self.zero_stage in (1, 2):
                return ShardedAdam(params, self.shards, self.zero_stage)
            if self.optimizer_8bit:
                return Adam8bit(params)
            return torch.optim.Adam(params, lr=3e-4, foreach=True)

        return TrainingLoop(
            model_fn=model_fn,
            batch_fn=lambda step: (torch.randint(0, config.vocab, (micro, self.seq)),
                                   torch.randint(0, config.vocab, (micro, self.seq))),
            optimizer_fn=optimizer_fn, micro_batches=self.micro_batches,
            autocast=torch.bfloat16 if self.bf16 else None)


#: remedy id -> the setup with it applied (ZeRO over 4 GPUs)
REMEDY_RUNS: dict[RemedyId, Callable[[RemedySetup], RemedySetup]] = {
    RemedyId.MICRO_BATCH: lambda s: replace(s, batch=s.batch // 2),
    RemedyId.GRADIENT_ACCUMULATION: lambda s: replace(s, micro_batches=2),
    RemedyId.ACTIVATION_CHECKPOINTING: lambda s: replace(s, checkpointing=True),
    RemedyId.BF16: lambda s: replace(s, bf16=True),
    RemedyId.ZERO1: lambda s: replace(s, zero_stage=1, shards=4),
    RemedyId.ZERO2: lambda s: replace(s, zero_stage=2, shards=4),
    RemedyId.ZERO3: lambda s: replace(s, zero_stage=3, shards=4),
    RemedyId.OPTIMIZER_8BIT: lambda s: replace(s, optimizer_8bit=True),
}
SHARDS = 4


def simulate(setup: RemedySetup, out: Path, stacks: str = "python") -> Simulation:
    """Trace the setup's training steps (bf16 under CUDA's autocast lists) and write its snapshot to `out`."""
    policy = cuda_autocast_policy() if setup.bf16 else contextlib.nullcontext()
    with policy:
        run = trace_training(setup.loop(), STEPS, fake=True, stacks=stacks)
    return simulate_to_files(run, out, DEVICE, AllocatorSettings(), scenario=setup.name)
