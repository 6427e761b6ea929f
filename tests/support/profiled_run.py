"""A tiny CPU training run under torch.profiler, with torch's own memory-profiler category of every allocation
(by address and time), for scoring profiler-trace attribution against the truth torch itself computes.

Torch's categories come from heuristics over its data-flow graph, and one of them is contradicted by the run
itself: in single-tensor Adam, `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` divides by a
Python float, which torch wraps as a 0-dim tensor made outside any op; `_set_inputs` calls that tensor an
INPUT, so `_set_parameters_using_data_flow` takes the op's other operand (`exp_avg_sq.sqrt()`) for a weight
applied to an input (PARAMETER) and `_set_activations` floods the quotient (ACTIVATION). The same tensors are
unlabelled in a step that no later forward reads, and under `foreach=True` (no wrapped scalar). Each row
therefore says, from the run and not from the analyser, whether torch's label can hold: a PARAMETER must be
the storage of one of the model's parameters, and an ACTIVATION cannot be made inside `Optimizer.step`."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from support.paths import ROOT

STEPS = 3
#: optimizers a run can be recorded with (the default first: single-tensor Adam, torch's choice on the CPU)
OPTIMIZERS: dict[str, Callable] = {
    "adam": lambda torch, params: torch.optim.Adam(params, lr=1e-3),
    "adamw_foreach": lambda torch, params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "sgd_momentum": lambda torch, params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}
#: torch's MemoryProfile passes, in the order its constructor runs them
_PASSES = ("_set_gradients_and_temporaries", "_set_parameters_using_python_tracer", "_set_inputs",
           "_set_parameters_using_data_flow", "_set_activations", "_set_optimizer_state", "_set_autograd_detail")


def record(out: Path, optimizer: str = "adam") -> tuple[Path, pd.DataFrame]:
    """Profile STEPS training steps of scripts/record_kineto_fixtures.py's model (profile_memory, record_shapes,
    with_stack, with_modules; one warmup step) and return the trace's path and torch's categories: one row per
    allocation torch saw made (addr, t_us, bytes, torch: its category at creation, None where it gave none;
    rule: the MemoryProfile pass that set it; contradicted: whether the run contradicts it, as above)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    sys.path.insert(0, str(ROOT / "scripts"))
    from record_kineto_fixtures import make_model, train_step

    torch.manual_seed(0)
    model = make_model()
    optim = OPTIMIZERS[optimizer](torch, model.parameters())
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    trace = out / "run.pt.trace.json"
    rows: list[tuple] = []

    def ready(prof: profile) -> None:
        """Export the trace and read torch's categories of the same cycle (the profiler clears it after)."""
        prof.export_chrome_trace(str(trace))
        with _passes_recorded() as rule_of:
            memory = prof._memory_profile()
        steps = [(e.start_time_ns, e.end_time_ns) for e in memory._op_tree.dfs()
                 if e.name.startswith("Optimizer.step#")]
        for t_ns, action, (key, version), size in memory.timeline:
            storage = getattr(key, "storage", None)
            if action.name == "CREATE" and storage is not None:
                category = memory._categories.get(key, version)
                name = category.name.lower() if category else None
                in_step = any(start <= t_ns <= end for start, end in steps)
                contradicted = (name == "parameter" and storage.ptr not in parameters
                                or name == "activation" and in_step)
                rows.append((storage.ptr, t_ns // 1000, size, name, rule_of(memory, key, version), contradicted))

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=STEPS),
                 on_trace_ready=ready, profile_memory=True, record_shapes=True, with_stack=True,
                 with_modules=True) as prof:
        for _ in range(STEPS + 1):
            train_step(model, optim)
            prof.step()
    return trace, pd.DataFrame(rows, columns=["addr", "t_us", "bytes", "torch", "rule", "contradicted"])


@contextmanager
def _passes_recorded() -> Iterator[Callable]:
    """While open, each MemoryProfile pass notes the categories it set; yields rule_of(memory, key, version):
    the first pass after which that tensor version had a category (None: never)."""
    from torch.profiler import _memory_profiler as mp

    after: dict[int, list[tuple[str, dict]]] = {}
    originals = {name: getattr(mp.MemoryProfile, name) for name in _PASSES if hasattr(mp.MemoryProfile, name)}

    def noting(name: str, method: Callable) -> Callable:
        def run(self) -> None:
            method(self)
            after.setdefault(id(self), []).append((name, self._category_snapshot()))
        return run

    def rule_of(memory, key, version) -> str | None:
        return next((name for name, snapshot in after.get(id(memory), []) if snapshot.get((key, version))), None)

    for name, method in originals.items():
        setattr(mp.MemoryProfile, name, noting(name, method))
    try:
        yield rule_of
    finally:
        for name, method in originals.items():
            setattr(mp.MemoryProfile, name, method)


def aligned(ours: pd.DataFrame, truth: pd.DataFrame) -> pd.DataFrame:
    """`ours` (columns addr, t_us, bytes, ...) joined to torch's row of the same address, size and time. The two
    clocks differ by a constant: the offset is the most common difference over pairs of equal address and size
    (true pairs share it to the microsecond; false ones scatter), and times then match within 2 µs."""
    pairs = ours.merge(truth, on=["addr", "bytes"], suffixes=("", "_torch"))
    offset = int((pairs["t_us"] - pairs["t_us_torch"]).mode().iloc[0])
    shifted = truth.assign(t_us=truth["t_us"] + offset).sort_values("t_us")
    return pd.merge_asof(ours.sort_values("t_us"), shifted, on="t_us", by=["addr", "bytes"], tolerance=2,
                         direction="nearest").dropna(subset=["torch"])
