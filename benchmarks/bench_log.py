"""Issue 31 benchmark: read a large noisy training log, side by side with `grep -c "out of memory"` on the same
file, in one run.

    python benchmarks/bench_log.py [--megabytes 200] [--repeats 3]

The log is generated: rank-prefixed, coloured training lines, tqdm bars, Megatron memory lines every 100 lines,
a memory_summary() table and a traceback now and then, and OOM messages of the three eras. Target: within 4x
the wall time of grep and under 200 MiB peak RSS (the issue asks this of a 2 GB log; the shared machine gets a
smaller one by default, which the reader's constant memory makes representative: only OOMs and readings are
kept).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from measure import compare, print_table

DATA = Path(__file__).resolve().parent / "data"

_NOISE = [
    "[rank{r}]: \x1b[32mINFO\x1b[0m step {s} | loss {l:.4f} | lr 3.0e-04 | tokens/s 151234 | grad norm 0.93",
    "[rank{r}]: Epoch 3:  41%|####      | {s}/2538 [12:01<17:10,  1.25it/s, loss={l:.3f}]",
    "[rank{r}]: [2024-05-01 12:00:00,000] [INFO] [logging.py:96:log_dist] step={s}, skipped=0, lr=[0.0003]",
]
_MEMORY = "[Rank {r}] (after {s} iterations) memory (MB) | allocated: {a:.1f} | max allocated: {p:.1f} | reserved: 30000.0 | max reserved: 30000.0"
_OOMS = [
    "RuntimeError: CUDA out of memory. Tried to allocate 1.72 GiB (GPU 0; 10.76 GiB total capacity; 4.01 GiB already allocated; 356.00 MiB free; 5.54 GiB cached)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, this process has 20.81 GiB memory in use. Of the allocated memory 12.09 GiB is allocated by PyTorch, and 4.84 GiB is reserved by PyTorch but unallocated.",
]
_TRACEBACK = ["Traceback (most recent call last):", '  File "/home/u/train.py", line 42, in <module>',
              "    loss.backward()"]


def make_log(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    target, written, step = megabytes << 20, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            step += 1
            lines = [rng.choice(_NOISE).format(r=step % 8, s=step, l=rng.random()) for _ in range(99)]
            lines.append(_MEMORY.format(r=step % 8, s=step, a=20000 + rng.random() * 100, p=25000.0))
            if step % 5000 == 0:
                lines += [f"[rank{step % 8}]: {t}" for t in _TRACEBACK] + [f"[rank{step % 8}]: {rng.choice(_OOMS)}"]
            text = "\n".join(lines) + "\n"
            out.write(text)
            written += len(text.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    DATA.mkdir(exist_ok=True)
    path = DATA / f"train_{args.megabytes}MB.log"
    if not path.exists():
        make_log(path, args.megabytes)
    print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB")
    import sys
    results = compare({
        "grep -c (baseline)": ["grep", "-c", "out of memory", str(path)],
        "analyze FILE --format json": [sys.executable, "-m", "analyzer", str(path), "--format", "json", "-o",
                                       str(DATA / "log_out.json"), "-q"],
    }, args.repeats)
    print_table(results, "grep -c (baseline)")


if __name__ == "__main__":
    main()
