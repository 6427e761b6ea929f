"""Write a large snapshot made from a real recording in ../shared/real, repeated to N trace entries.

The real files are read at run time and what is written goes to benchmarks/data/ (ignored by git): some of the
recordings have no license, so no derived copy of them is ever committed.

Each copy of a device's history is the recorded one with its times shifted past the previous copy's end; its
frames lists are fresh lists of the recording's frame dicts (one list per entry shared as the recording shares
them, the dicts shared by every copy, as torch's pickle writes them), and so are its annotations (optimizer steps,
data loading), once a copy. So that every copy starts from the state
the recording started from, a copy after the first begins by making again what the recording freed without
having made it (memory from before the recording: an `alloc`, or a `segment_alloc` / `segment_map`), and a copy
before the last ends by freeing what it made and kept (the reverse). The last copy ends as the recording ends,
and the segments and the allocator settings are the recording's.

    python benchmarks/make_real_snapshot.py CASE OUT --entries 1000000
"""
from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

REAL = Path(__file__).resolve().parents[2] / "shared" / "real"

#: name -> (file under ../shared/real, what it stands for)
CASES = {
    "cpp-frames": ("wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle",
                   "CS336 medium model, one training step; C++ and Python frames, allocator settings"),
    "expandable": ("constructor-sun-code_location/memory_snapshot.pickle",
                   "multi-GPU training with expandable segments (segment_map/unmap), allocator settings, an OOM"),
    "python-frames": ("zidongliu-decomfl/memory.pickle",
                      "federated learning run; Python-only stacks, segment_alloc, allocator settings"),
    "small": ("magma27-cs336-a2/memory_snapshot.pickle",
              "CS336 training, newest schema, 5,163 entries: the unit tests' case (tests/unit/test_fast_forward.py)"),
}

_MADE = {"alloc": "free_completed", "segment_alloc": "segment_free", "segment_map": "segment_unmap"}
_GONE = {"free_completed": "alloc", "segment_free": "segment_alloc", "segment_unmap": "segment_map"}
_EXTRA = {"free_completed": ("free_requested", "free_completed")}   # a free is written as both entries


class _Refusing(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _balance(trace: list[dict]) -> tuple[list[dict], list[dict]]:
    """What a copy must make first (memory the recording frees without having made it) and free last (what it
    makes and keeps), each as entries made from the recorded ones."""
    live: dict[tuple[str, int], dict] = {}
    before: list[dict] = []
    for entry in trace:
        action, addr = entry["action"], entry.get("addr")
        if action in _MADE:
            live[(action, addr)] = entry
        elif action in _GONE:
            made = (_GONE[action], addr)
            if made in live:
                del live[made]
            else:
                before.append({**entry, "action": _GONE[action]})
    after = []
    for (action, _), entry in reversed(live.items()):
        for gone in _EXTRA.get(_MADE[action], (_MADE[action],)):
            after.append({**entry, "action": gone})
    return before, after


def _copy(entries: list[dict], shift: int, lists: dict[int, list]) -> list[dict]:
    out = []
    for entry in entries:
        copied = dict(entry)
        if "time_us" in copied:
            copied["time_us"] += shift
        frames = entry.get("frames")
        if isinstance(frames, list):
            copied["frames"] = lists.setdefault(id(frames), list(frames))
        out.append(copied)
    return out


def repeat(trace: list[dict], entries: int) -> tuple[list[dict], int, int]:
    """The history repeated to at least `entries` entries (a whole number of copies), the number of copies and
    the time between them."""
    if not trace:
        return trace, 1, 0
    before, after = _balance([e for e in trace if e["action"] != "oom"])
    times = [e["time_us"] for e in trace if "time_us" in e]
    span = (max(times) - min(times) + 1_000) if times else 0
    out: list[dict] = []
    copies = max(1, -(-entries // (len(trace) + len(before) + len(after))))
    for j in range(copies):
        last = j == copies - 1
        body = trace if last else [e for e in trace if e["action"] != "oom"]
        start = body[0].get("time_us", 0)
        lists: dict[int, list] = {}          # one fresh list per recorded list in each copy, shared as recorded
        if j:
            out += _copy([{**e, "time_us": start} if "time_us" in e else e for e in before], j * span, lists)
        out += _copy(body, j * span, lists)
        if not last:
            end = body[-1].get("time_us", 0)
            out += _copy([{**e, "time_us": end} if "time_us" in e else e for e in after], j * span, lists)
    return out, copies, span


def make(case: str, entries: int) -> dict:
    path = REAL / CASES[case][0]
    with open(path, "rb") as f:
        snapshot = _Refusing(f).load()
    traces = snapshot["device_traces"]
    total = sum(len(t) for t in traces) or 1
    repeated = [repeat(t, entries * len(t) // total) for t in traces]
    snapshot["device_traces"] = [r[0] for r in repeated]
    # the annotations (optimizer steps, data loading: where steps begin) of each device, once a copy
    annotations = snapshot.get("external_annotations") or []
    copies = {d: (n, span) for d, (_, n, span) in enumerate(repeated)}
    snapshot["external_annotations"] = [
        {**a, "time_us": a["time_us"] + j * span} if "time_us" in a else a
        for a in annotations for n, span in [copies.get(a.get("device"), (1, 0))] for j in range(n)]
    snapshot["external_annotations"].sort(key=lambda a: a.get("time_us", 0))
    return snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    if not REAL.is_dir():
        sys.exit(f"{REAL} is absent: the real recordings are needed to build this benchmark's input")
    snapshot = make(args.case, args.entries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    n = sum(len(t) for t in snapshot["device_traces"])
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB, {n} entries from {CASES[args.case][0]}")


if __name__ == "__main__":
    main()
