"""Record the small Kineto fixtures under fixtures/traces/kineto/ on the CPU (no GPU needed).

Each scenario trains a tiny transformer-style model for a few steps under torch.profiler with
profile_memory=True, record_shapes=True, with_stack=True, with_modules=True (nn.Module spans) and a schedule
(1 wait, 1 warmup, 2 active steps; 6 for `leak`, so that growth per step is measurable) and writes the Chrome
trace gzipped; for the plain run it also writes the
export_memory_timeline files of the same run (`.raw.json.gz` rows and the `.json.gz` per-category curve;
device="cpu", the device the run used).

Scenarios:
- train:      forward, backward, Adam step, zero_grad;
- grad_accum: two micro-batches per optimizer step (gradients live across forwards);
- checkpoint: as train, plus torch.save of model and optimizer state inside a record_function range;
- leak:       as train, plus a validation loss computed without torch.no_grad() and kept as a tensor in a
              list: its graph holds every activation the forward saved, so memory grows every step;
- lora:       LoRA fine-tuning (rank 4 adapters beside every nn.Linear of a frozen base made before the trace,
              as PEFT's LoraLayer does): the base has no gradients and no optimizer state, Adam keeps the
              adapters' only.

An out-of-memory event cannot be forced on the CPU (the CPU allocator does not report [OutOfMemory]), so no
fixture has one; the real GPU recordings in ../shared/real have none either.

Run: python scripts/record_kineto_fixtures.py [--out fixtures/traces/kineto] [NAME ...]
"""
from __future__ import annotations

import argparse
import gzip
import io
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function, schedule

ROOT = Path(__file__).resolve().parents[1]
WAIT, WARMUP, ACTIVE = 1, 1, 2
LONG_ACTIVE = {"leak": 6}   # active steps where a scenario needs more than ACTIVE
BATCH, SEQ, WIDTH = 8, 16, 64


class TinyBlock(nn.Module):
    """Attention + MLP with residuals: enough distinct modules for module attribution to have work."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads=4, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), TinyBlock(WIDTH), TinyBlock(WIDTH), nn.Linear(WIDTH, 10))


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable rank-r update B·A (B starts at zero), as PEFT's LoraLayer."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def make_lora_model() -> nn.Module:
    """make_model's network, frozen, every nn.Linear but attention's projections wrapped in a LoRALinear."""
    model = make_model().requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(parent, nn.MultiheadAttention):
                setattr(parent, name, LoRALinear(child))
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, SEQ, WIDTH), torch.randint(0, 10, (BATCH, SEQ))


def loss_of(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    for _ in range(micro_batches):
        loss_of(model, *batch()).div(micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def leaky_step(model: nn.Module, optimizer: torch.optim.Optimizer, validation_losses: list[torch.Tensor]) -> None:
    train_step(model, optimizer)
    validation_losses.append(loss_of(model, *batch()))   # forgot torch.no_grad() and .item()


def checkpoint_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    train_step(model, optimizer)
    with record_function("checkpoint"):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())


SCENARIOS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "train": train_step,
    "grad_accum": lambda model, optimizer: train_step(model, optimizer, micro_batches=2),
    "checkpoint": checkpoint_step,
    "leak": partial(leaky_step, validation_losses=[]),
    "lora": train_step,
}
MODELS: dict[str, Callable[[], nn.Module]] = {"lora": make_lora_model}   # make_model for the others


def gzip_to(source: Path, target: Path) -> None:
    with open(source, "rb") as f, gzip.open(target, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)


def record(name: str, step: Callable[[nn.Module, torch.optim.Optimizer], None], out: Path, timelines: bool) -> None:
    """Profile the steps of one scenario and write its trace (and memory timelines) under `out`."""
    active = LONG_ACTIVE.get(name, ACTIVE)
    torch.manual_seed(0)
    model = MODELS.get(name, make_model)()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        raw_trace = Path(tmp) / "trace.json"
        prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=WAIT, warmup=WARMUP, active=active),
                       on_trace_ready=lambda p: p.export_chrome_trace(str(raw_trace)),
                       profile_memory=True, record_shapes=True, with_stack=True, with_modules=True)
        with prof:
            for _ in range(WAIT + WARMUP + active):
                step(model, optimizer)
                prof.step()
        gzip_to(raw_trace, out / f"{name}.pt.trace.json.gz")
        if timelines:
            prof.export_memory_timeline(str(out / f"{name}.memory_timeline.raw.json.gz"), device="cpu")
            prof.export_memory_timeline(str(out / f"{name}.memory_timeline.json.gz"), device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "fixtures" / "traces" / "kineto")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"scenarios to record: {', '.join(SCENARIOS)} (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(SCENARIOS):
        record(name, SCENARIOS[name], args.out, timelines=name == "train")
    for path in sorted(args.out.iterdir()):
        print(f"{path.stat().st_size:>9,d}  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
