"""Write a large synthetic snapshot (torch 2.13 layout) for benchmarks: N trace entries with Python frames.

The shape follows real snapshots: a few hundred distinct frame dicts shared by every entry (pickle memoises
them), a fresh frames list per alloc that its two free entries share (torch records the allocation's context
on the free), alloc / free_requested / free_completed triples, ~20 frames a stack.
"""
from __future__ import annotations

import argparse
import pickle
import random
from pathlib import Path

BASE = 0x7F0000000000


def make(entries: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    frame_pool = [{"filename": f"/home/user/project/model/layer_{i % 40}.py", "line": 10 + i, "name": f"fn_{i}"}
                  for i in range(600)]
    torch_frames = [{"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1750 + i,
                     "name": "_call_impl"} for i in range(20)]
    stacks = [[*rng.sample(torch_frames, 4), *rng.sample(frame_pool, 16)] for _ in range(300)]
    trace, live, t = [], [], 1_700_000_000_000_000
    sizes = [512, 4096, 1 << 20, 3 << 20, 24 << 20, 96 << 20]
    next_addr = BASE
    while len(trace) < entries:
        t += rng.randint(1, 50)
        if live and (len(live) > 400 or rng.random() < 0.45):
            addr, size, frames = live.pop(rng.randrange(len(live)))
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                              "compile_context": "N/A", "user_metadata": "", "frames": frames})
        else:
            size = rng.choice(sizes) + rng.randint(0, 511)
            frames = list(rng.choice(stacks))
            addr = next_addr
            next_addr += (size + 511) // 512 * 512
            live.append((addr, size, frames))
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t,
                          "compile_context": "N/A", "user_metadata": "", "frames": frames})
    segments = []
    for addr, size, frames in live:  # one segment per live block, so blocks tile their segments exactly
        block = (size + 511) // 512 * 512
        segments.append({"device": 0, "address": addr, "total_size": block, "allocated_size": block,
                         "active_size": block, "requested_size": size, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                         "blocks": [{"address": addr, "size": block, "requested_size": size,
                                     "state": "active_allocated", "frames": frames}]})
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
            "external_annotations": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as f:
        pickle.dump(make(args.entries), f, protocol=4)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB, {args.entries} entries")


if __name__ == "__main__":
    main()
