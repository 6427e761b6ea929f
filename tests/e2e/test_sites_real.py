"""On every real snapshot: the allocating site is a Python frame of the user's code, never a C/C++ frame, and
the op comes from the C++ frames; on a torch.compile recording, running the compiled graph is forward work,
not compile-time memory."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import analyzer
from analyzer.attribute.frames import stack_facts
from analyzer.core.stacks import format_frame
from support.paths import REAL, real_snapshots

SNAPSHOTS = real_snapshots() or [pytest.param(None, marks=pytest.mark.skip(reason=f"no real snapshots at {REAL}"))]
COMPILED = REAL / "kkaitlyn111-cs336-a2" / "memory_ctx512_forward.pickle"
STACKS_ALL = REAL / "nothanmin-cs336-a2" / "memory_snapshot_forward.pickle"
# Compile-time memory live at the peak of the compiled forward: 0 bytes are measured (the 44 autotuning
# L2-flush buffers of 256 MiB and the constant folding's tensors are freed before it); before the compiled
# graph's own frames were told apart from compiling, 20.7 GiB (62% of the 33.6 GiB peak) were `compile`.
COMPILE_SHARE_BOUND = 0.01
# What the peak is instead: 62% activations of the compiled forward (20.7 GiB); the rest, 38% (12.8 GiB), is
# blocks allocated before the recording started, which carry no stack, and 32 MiB of the compiled backward.
FORWARD_SHARE_AT_LEAST = 0.6
_PYTHON_SOURCE = re.compile(r"(\.pyw?|^<ipython-input-[^>]*>|^<stdin>)$", re.IGNORECASE)
_C_FILE = re.compile(r"(^\?\?$|^$|\.(c|cc|cpp|cxx|h|hpp|cu|o|so)$)", re.IGNORECASE)


def _id(p):
    return str(p.relative_to(REAL)) if isinstance(p, Path) else "absent"


def _users_own(filename: str) -> bool:
    """Written here again, plainly: Python source outside torch, triton, generated code and the stdlib."""
    path = filename.replace("\\", "/").lower()
    if not _PYTHON_SOURCE.search(path) or _C_FILE.search(path):
        return False
    if re.search(r"(^|/)(torch|functorch|triton)/|torchinductor_", path):
        return False
    if "site-packages/" in path or "dist-packages/" in path:
        return True
    return not re.search(r"/lib/python[\d.]+t?/|python[^/]*/lib/", path)


@pytest.mark.parametrize("path", SNAPSHOTS, ids=_id)
def test_sites_are_python_frames_and_ops_come_from_cpp_frames(path: Path) -> None:
    stacks = analyzer.load(path).stacks
    for frames, site, op in zip(stacks["frames"], stacks["top_user_frame"], stacks["op"], strict=True):
        users = [f for f in frames if _users_own(f[0])]
        assert site == (format_frame(users[0]) if users else None), frames
        below_python = frames[:next((i for i, f in enumerate(frames) if _PYTHON_SOURCE.search(f[0])), len(frames))]
        ops = {m[1] or m[2] for f in below_python
               if (m := re.match(r"at::(?:_ops::(\w+)::(?:call|redispatch)\(|native::(\w+)\()", f[2]))}
        assert (op is None) == (not ops), frames
        assert op is None or (re.fullmatch(r"aten::\w+", op) and op[len("aten::"):] in ops), op


def test_the_peak_of_a_compiled_forward_is_forward_work_not_compile(real_dir: Path) -> None:
    result = analyzer.analyze(COMPILED)
    (device,) = result.devices
    peak = device.peak.allocated_bytes
    by_phase = {r["name"]: r["bytes"] for r in device.by_phase}
    print({name: f"{b / peak:.1%}" for name, b in by_phase.items()})
    assert by_phase.get("compile", 0) / peak < COMPILE_SHARE_BOUND
    assert by_phase.get("forward", 0) / peak >= FORWARD_SHARE_AT_LEAST
    sites = [s["top_user_frame"] for s in device.by_site if s["top_user_frame"]]
    assert sites and all("torchinductor_" not in s and ".py:" in s for s in sites)
    assert sites[0].endswith("cs336_basics/transformer.py:142 softmax")   # the attention scores' softmax


def test_compile_time_and_the_compiled_graph_are_told_apart_on_real_frames(real_dir: Path) -> None:
    """Each stack of the compiled recording, classified here from the frames it holds, against the rules."""
    expected, said = [], []
    for frames in analyzer.load(COMPILED).stacks["frames"]:
        files = " ".join(f"{f[0]}:{f[2]}" for f in frames)
        if "triton/testing.py" in files or ":benchmark_all_configs" in files:
            expected.append(("compile", "frames:compile-autotune"))
        elif "_dynamo/convert_frame.py" in files:
            expected.append(("compile", "frames:torch.compile"))
        elif "runtime_wrappers.py:_backward_impl" in files:
            expected.append(("backward", "frames:compiled-backward"))
        elif "/torchinductor_" in files:
            expected.append(("forward", "frames:compiled-graph"))
        else:
            expected.append((None, None))
        facts = stack_facts(frames)
        said.append((facts.phase, facts.phase_signal))
    assert said == expected
    assert Counter(expected) == {("forward", "frames:compiled-graph"): 651, ("compile", "frames:compile-autotune"): 24,
                                 ("compile", "frames:torch.compile"): 3, ("backward", "frames:compiled-backward"): 1,
                                 (None, None): 1}


def test_allocations_without_a_python_frame_show_their_op(real_dir: Path) -> None:
    """stacks="all": the autograd engine's thread has C++ frames only; the JSON names their op instead."""
    doc = analyzer.analyze(STACKS_ALL).to_json()
    rows = [a for d in doc["devices"] for a in d["peak"]["top_allocations"]]
    assert all("op" in a for a in rows)
    frameless = [a for a in rows if a["has_frames"] and a["top_user_frame"] is None]
    assert frameless and all(a["op"] and a["op"].startswith("aten::") for a in frameless)
    sites = [s["top_user_frame"] for d in doc["devices"] for s in d["peak"]["by_site"]]
    assert all(s is None or ".py:" in s for s in sites)
