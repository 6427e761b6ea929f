"""Model states at the peak of a real recording against what its own source code says (`shared/real/truth.json`).

For each recording whose truth is established (or partly so), and each of parameters, gradients and optimizer
state that the truth gives, one check: do the bytes the analysis puts in that category at the peak agree with
the source? Agreement is within 10% of the truth, or, where the truth is zero, at most 1% of the peak. A
recording that does not say what was alive before it began (a 2021 profiler trace: no running total) does not
hold the model states made before it: those checks are counted apart, as not held, never as agreeing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analyzer.pipeline import analyze
from analyzer.result import Analysis

#: the truth's field for each category it gives at the peak
TRUTH_FIELDS = {"parameter": "param_bytes", "gradient": "grad_bytes_at_peak",
                "optimizer_state": "optimizer_state_bytes_at_peak"}
RELATIVE_TOLERANCE = 0.10
ZERO_TOLERANCE = 0.01  # of the peak, where the truth is that nothing of the category is live
_NOT_TRUTH = ("NOT", "SYNTHETIC")


@dataclass(frozen=True)
class Check:
    """One category on one device of one recording."""

    recording: str
    device: str
    category: str
    truth_bytes: int
    measured_bytes: int
    peak_bytes: int
    held: bool = True   # False: the truth's bytes were made before the recording, which does not hold them

    @property
    def agrees(self) -> bool:
        """Within the tolerance of the truth; a check of what the recording does not hold never agrees."""
        if not self.held:
            return False
        if self.truth_bytes == 0:
            return self.measured_bytes <= ZERO_TOLERANCE * self.peak_bytes
        return abs(self.measured_bytes - self.truth_bytes) <= RELATIVE_TOLERANCE * self.truth_bytes


def load_truth(real: Path) -> dict[str, dict[str, Any]]:
    """The truth of every recording that has one worth checking against (established or partial)."""
    truth: dict[str, dict[str, Any]] = json.loads((real / "truth.json").read_text(encoding="utf-8"))
    return {name: t for name, t in truth.items()
            if not str(t.get("status", "")).startswith(_NOT_TRUTH) and (real / name).exists()}


def checks(real: Path, name: str, truth: dict[str, Any]) -> list[Check]:
    """The checks of one recording: on each device the truth names, else on the device with the highest peak."""
    analysis = analyze(real / name)
    assert isinstance(analysis, Analysis), f"{name} is one recording, not a set of ranks"
    per_device: dict[str, int] = truth.get("per_device_param_bytes") or {}
    out = []
    for d in analysis.devices:
        label = analysis.trace.device_label(d.device)
        if per_device and label not in per_device:
            continue
        if not per_device and d is not max(analysis.devices, key=lambda x: x.peak.allocated_bytes):
            continue
        measured = {r["name"]: int(r["bytes"]) for r in d.by_category}
        for category, field in TRUTH_FIELDS.items():
            expected = per_device.get(label) if per_device and category == "parameter" else truth.get(field)
            if expected is None:
                continue
            held = expected == 0 or analysis.trace.devices[d.device].before_recorded
            out.append(Check(name, label, category, int(expected), measured.get(category, 0), d.peak.allocated_bytes,
                             held))
    return out
