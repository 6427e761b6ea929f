"""Issue 4 benchmark: does applying a remedy save what the analysis estimated it would?

For each GPT configuration, a baseline training run is simulated on the CPU (`analyzer.simulate.run` under
FakeTensorMode, so the sizes are those of a real GPU run), analysed, and each remedy that can run here is
applied and simulated again: the micro-batch halved, bf16 autocast, activation checkpointing of every block,
gradient accumulation over 2 micro-batches of half the size. The baseline's `saved_bytes` for that remedy is
compared with the measured saving, the difference of `demand_bytes` (the peak: no run here runs out of memory).
Target: every estimate within 15% of the measured saving.

    python benchmarks/remedy_accuracy.py [--out benchmarks/results/remedy_accuracy.md]

bf16 is run twice. CPU autocast (`torch.autocast("cpu", dtype=torch.bfloat16)`) is what the tracer sees, but its
op lists are not CUDA's: CUDA autocast runs softmax, log_softmax and layer_norm in fp32 and CPU autocast does not
(see `torch._C._dispatch_dump("aten::softmax.int")`: an AutocastCUDA kernel, no AutocastCPU one). The second
run registers CUDA's policy for those ops on the AutocastCPU key, so it allocates what a GPU step would.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from analyzer.result import DeviceAnalysis
from analyzer.pipeline import analyze
from analyzer.simulate import run
from analyzer.simulate.gpt import GPT, Attention, Block, GPTConfig

GiB = 1 << 30
DEVICE = 80 * GiB          # large enough that no run here runs out of memory: demand is the peak
STEPS = 3                  # optimizer steps; the peak is reached by step 2, when Adam's state exists
TOLERANCE = 0.15
RESULTS = Path(__file__).resolve().parent / "results" / "remedy_accuracy.md"


# ---- the remedies that change the model ------------------------------------------------------------------
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


class Model(GPT):
    """The scenarios' GPT with the model-side switches. Blocks and attention are retyped in place: the
    subclasses change only `forward`, so parameters and module names stay those of `analyzer.simulate.gpt`."""

    def __init__(self, config: GPTConfig, fused_attention: bool, checkpointing: bool, autocast: bool) -> None:
        super().__init__(config)
        self.autocast = autocast
        for block in self.layers:
            if checkpointing:
                block.__class__ = CheckpointedBlock
            if fused_attention:
                block.attn.__class__ = FusedAttention

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return super().forward(idx, targets)


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


# ---- the remedies that change the loop -------------------------------------------------------------------
class StepEvery:
    """Gradient accumulation inside the simulator's loop, which steps the optimizer after every batch: the
    wrapped optimizer steps (and gradients are cleared) only every `n`-th call, so gradients accumulate
    over n micro-batches as in `for chunk in batch.chunk(n): loss(chunk).backward()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, n: int) -> None:
        self.optimizer, self.n, self.calls = optimizer, n, 0

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.n == 0:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.calls % self.n == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)


# ---- configurations and runs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One training configuration; the remedies are changes of it."""

    name: str
    config: GPTConfig
    batch: int
    seq: int
    fused_attention: bool = False
    checkpointing: bool = False
    autocast: str | None = None       # None, "cpu" (CPU autocast's op lists) or "cuda" (CUDA's)
    accumulation: int = 1

    def loop(self) -> dict[str, Any]:
        """The keyword arguments of `analyzer.simulate.run` for this setup."""
        config, micro = self.config, self.batch // self.accumulation

        def optimizer_fn(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer | StepEvery:
            adam = torch.optim.Adam(params, lr=3e-4, foreach=True)
            return adam if self.accumulation == 1 else StepEvery(adam, self.accumulation)

        return {"model_fn": lambda: Model(config, self.fused_attention, self.checkpointing, self.autocast is not None),
                "batch_fn": lambda step: (torch.randint(0, config.vocab, (micro, self.seq)),
                                          torch.randint(0, config.vocab, (micro, self.seq))),
                "optimizer_fn": optimizer_fn, "steps": STEPS * self.accumulation}


CONFIGS = [
    Setup("eager d768 L6 s1024 b8", GPTConfig(d_model=768, layers=6, heads=12, max_seq=1024), batch=8, seq=1024),
    Setup("eager d1024 L12 s512 b8", GPTConfig(d_model=1024, layers=12, heads=16, max_seq=512), batch=8, seq=512),
    Setup("eager d512 L4 s2048 b4", GPTConfig(d_model=512, layers=4, heads=8, max_seq=2048), batch=4, seq=2048),
    Setup("sdpa d768 L6 s1024 b8", GPTConfig(d_model=768, layers=6, heads=12, max_seq=1024), batch=8, seq=1024,
          fused_attention=True),
    Setup("sdpa d1024 L12 s2048 b4", GPTConfig(d_model=1024, layers=12, heads=16, max_seq=2048), batch=4, seq=2048,
          fused_attention=True),
]
# (remedy id, label, the setup after applying it)
REMEDIES: list[tuple[str, str, Callable[[Setup], Setup]]] = [
    ("micro_batch", "micro-batch halved", lambda s: replace(s, batch=s.batch // 2)),
    ("bf16", "bf16 autocast (CPU op lists)", lambda s: replace(s, autocast="cpu")),
    ("bf16", "bf16 autocast (CUDA op lists)", lambda s: replace(s, autocast="cuda")),
    ("activation_checkpointing", "activation checkpointing", lambda s: replace(s, checkpointing=True)),
    ("gradient_accumulation", "gradient accumulation 2 x half", lambda s: replace(s, accumulation=2)),
]


def simulate(setup: Setup, folder: Path) -> DeviceAnalysis:
    """Trace the setup's training steps, write the snapshot and analyse it."""
    out = folder / f"{abs(hash(setup))}.pickle"
    policy = cuda_autocast_policy() if setup.autocast == "cuda" else contextlib.nullcontext()
    with policy:
        run(**setup.loop(), gpu_memory=DEVICE, out=out, fake=True)
    device = analyze(out).devices[0]
    if device.oom is not None:
        raise RuntimeError(f"{setup.name}: out of memory on the simulated {DEVICE / GiB:.0f} GiB device")
    return device


@dataclass
class Row:
    setup: str
    remedy: str
    label: str
    estimated: int | None
    measured: int

    @property
    def error(self) -> float | None:
        """Estimate relative to the measured saving (+: the estimate promised more)."""
        if self.estimated is None or not self.measured:
            return None
        return (self.estimated - self.measured) / abs(self.measured)


def measure(setups: list[Setup], folder: Path) -> list[Row]:
    rows = []
    for setup in setups:
        before = simulate(setup, folder)
        estimates = {r["id"]: r["saved_bytes"] for r in before.diagnosis.remedies}
        for remedy, label, apply in REMEDIES:
            after = simulate(apply(setup), folder)
            rows.append(Row(setup.name, remedy, label, estimates.get(remedy), before.diagnosis.demand_bytes - after.diagnosis.demand_bytes))
            print(f"  {setup.name}: {label} done", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    """A markdown table: configuration, remedy, estimated and measured saving (GiB), error."""
    lines = ["| configuration | remedy | estimated GiB | measured GiB | error |", "|---|---|---:|---:|---:|"]
    for r in rows:
        estimated = "not listed" if r.estimated is None else f"{r.estimated / GiB:.2f}"
        error = "" if r.error is None else f"{r.error:+.1%}" + ("" if abs(r.error) <= TOLERANCE else " ✗")
        lines.append(f"| {r.setup} | {r.label} | {estimated} | {r.measured / GiB:.2f} | {error} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = measure(CONFIGS, Path(folder))
    text = table(rows)
    within = sum(r.error is not None and abs(r.error) <= TOLERANCE for r in rows)
    summary = f"{within} of {len(rows)} estimates within {TOLERANCE:.0%} of the measured saving"
    print(text + "\n\n" + summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"# Remedy accuracy (benchmarks/remedy_accuracy.py)\n\nSaving of each remedy as the baseline's "
                        f"analysis estimated it and as the simulated run with the remedy measured it (difference of "
                        f"`demand_bytes`); error = (estimated - measured) / measured, ✗ beyond {TOLERANCE:.0%}.\n\n"
                        f"{text}\n\n{summary}\n")


if __name__ == "__main__":
    main()
