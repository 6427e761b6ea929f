"""How a verdict names what the peak is made of and where: the composition threshold and call paths in a
sentence."""
from __future__ import annotations

import pandas as pd

from analyzer.core.module_tree import SENTENCE_LEVELS, module_in_sentence
from analyzer.core.timeline import Peak
from analyzer.result import COMPOSITION_SHARE, DeviceMeasures


def measures(parameter_share: float) -> DeviceMeasures:
    total = 1000
    known = int(round(parameter_share * total))
    rows = [{"name": "unattributed", "bytes": total - known, "share": 1 - parameter_share},
            {"name": "parameter", "bytes": known, "share": parameter_share}]
    empty = pd.DataFrame()
    return DeviceMeasures(device=0, peak=Peak(0, total, total, total, None, 0, empty), reserved_peak_bytes=total,
                          end={}, trace_entries=1, history_truncated=False, oom=None, recorded_capacity_bytes=None,
                          by_category=rows, by_phase=[], by_module=[], by_site=[], module_tree=[], peak_step=None,
                          peak_phase=None, peak_module=None, steps=[], labels=empty)


def test_a_largest_known_category_under_ten_percent_is_not_named() -> None:
    assert measures(COMPOSITION_SHARE).composition() == "parameters are 10% of the peak"
    assert measures(COMPOSITION_SHARE - 0.001).composition() == ""


def test_a_call_path_in_a_sentence_keeps_its_innermost_levels_by_file_name() -> None:
    path = " › ".join(["/home/u/pkg/model.py:253 forward", "/home/u/pkg/model.py:382 forward[23]",
                       "LlamaMLP", "/home/u/pkg/model.py:520 forward"])
    assert SENTENCE_LEVELS == 3
    assert module_in_sentence(path) == "… › model.py:382 forward[23] › LlamaMLP › model.py:520 forward"
    assert module_in_sentence("GPT › Block[3] › MLP") == "GPT › Block[3] › MLP"
    assert module_in_sentence("layers.3.mlp") == "layers.3.mlp"
    assert module_in_sentence(r"C:\src\train.py:12 forward") == "train.py:12 forward"
