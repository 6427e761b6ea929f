"""Issue 31 benchmark: read a large noisy training log, side by side with `grep -c "out of memory"` on the same
file, in one run.

    python benchmarks/bench_log.py [--megabytes 200] [--repeats 3]

The log is generated: rank-prefixed, coloured training lines, tqdm bars, a Megatron memory line every 100 lines,
and every 500,000 lines a traceback and an OOM message (torch <= 1.3's or 2.1+'s). Target: within 4x the time
of grep and under 200 MiB peak RSS on a 2 GB log (`--megabytes 2000`); CPU time is the ratio to read on a
shared machine, where other work stretches wall time (and, less, CPU time: take several runs). The analysis
starts in about 0.25-0.3 s of CPU (0.03 s of it compiling the package's sources where PYTHONDONTWRITEBYTECODE is
set; an installed package has its bytecode); docs/results/performance.md says where the rest goes.
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
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


#: a larger log is this many MiB generated once and written again until it is as long (grep and the reader see
#: the same bytes either way; generating 2 GB in Python takes minutes)
UNIT_MEGABYTES = 200


def make_log(path: Path, megabytes: int) -> None:
    if megabytes > UNIT_MEGABYTES:
        unit = path.with_name(f"train_{UNIT_MEGABYTES}MB.log")
        if not unit.exists():
            make_log(unit, UNIT_MEGABYTES)
        with open(path, "wb") as out:
            for _ in range(-(-megabytes // UNIT_MEGABYTES)):
                with open(unit, "rb") as piece:
                    shutil.copyfileobj(piece, out, 1 << 24)
        return
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
    # grep's count goes to a file: GNU grep whose output is /dev/null (where measure() sends it) stops at the first
    # match, which read 47 MiB of any of these logs and made every earlier baseline a tenth of a whole read
    results = compare({
        "grep -c (baseline)": ["sh", "-c", 'exec grep -c "out of memory" "$0" > "$1"', str(path),
                               str(DATA / "grep_out.txt")],
        "analyze FILE --format json": [sys.executable, "-m", "analyzer", str(path), "--format", "json", "-o",
                                       str(DATA / "log_out.json"), "-q"],
    }, args.repeats)
    print_table(results, "grep -c (baseline)")


if __name__ == "__main__":
    main()
