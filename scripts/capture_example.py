"""A small training loop recorded with analyzer's capture helpers, on CUDA when there is one, else on the CPU.

    python scripts/capture_example.py [--out DIR] [--steps N]
    analyze run -- python scripts/capture_example.py

On CUDA it writes snapshots (`rank0_step1.pickle`, ...); without CUDA, a profiler trace of host memory
(`rank0_trace.json.gz`). Either way the phases (`phase::forward`, ...) and the module ranges
(`module::forward::layers.1.mlp`, `module::backward::layers.1.mlp`, ...) are in the recording. Under
`analyze run` the capture that `analyze run` started is joined, and the files go where it says.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import analyzer


class Block(nn.Module):
    """A residual MLP block: enough structure for nested module names (layers.N.mlp.K)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyModel(nn.Module):
    def __init__(self, width: int = 64, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="memory_capture", help="run directory (default: memory_capture)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyModel().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    analyzer.tag_modules(model)
    with analyzer.capture(args.out, dump_at_steps=(1, args.steps)) as cap:
        for _ in range(args.steps):
            inputs = torch.randn(32, 64, device=device)
            targets = torch.randint(0, 10, (32,), device=device)
            with analyzer.phase("forward"):
                loss = nn.functional.cross_entropy(model(inputs), targets)
            with analyzer.phase("backward"):
                loss.backward()
            with analyzer.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            cap.step()
    for path in cap.files:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
