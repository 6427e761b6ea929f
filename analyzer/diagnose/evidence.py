"""Evidence shared by detectors: the allocations behind a number, with where they came from."""
from __future__ import annotations

import pandas as pd

from analyzer.core.module_tree import module_in_sentence
from analyzer.core.trace import MemoryTrace
from analyzer.core.vocabulary import UNATTRIBUTED, names_module, phase_in_sentence
from analyzer.result import TopAllocation


def top_allocations(trace: MemoryTrace, rows: pd.DataFrame, n: int = 5) -> list[TopAllocation]:
    frames, ops = trace.stacks["top_user_frame"], trace.stacks["op"]
    out: list[TopAllocation] = []
    for r in rows.sort_values("allocated_bytes", ascending=False, kind="stable").head(n).itertuples(index=False):
        framed = not pd.isna(r.stack_id)
        out.append({"bytes": int(r.allocated_bytes), "module": str(r.module), "category": str(r.category),
                    "phase": str(r.phase), "top_user_frame": frames.iat[int(r.stack_id)] if framed else None,
                    "op": ops.iat[int(r.stack_id)] if framed else None})
    return out


def oom_where(phase: str | None, module: str | None, step: int | None) -> str:
    """'in the forward pass of step 1 (GPT › Block[3] › MLP)', or '(model.py:54 forward)' where no class is known."""
    parts = []
    if phase and phase != UNATTRIBUTED:
        parts.append(f"in {phase_in_sentence(phase)}")
    if step is not None:
        parts.append(f"of step {step}" if parts else f"in step {step}")
    if names_module(module):
        parts.append(module if module.startswith("(") else f"({module_in_sentence(module)})")
    return " ".join(parts)
