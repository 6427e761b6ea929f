"""The domain's words, spelled once: enums that read as their words, and one writer and reader per annotation name."""
from __future__ import annotations

import json

import pytest

from analyzer.attribute.annotations import classify, tensor_marks
from analyzer.core.units import binary_unit, format_bytes, gib, human_bytes, rate_bytes, relative_seconds
from analyzer.core.vocabulary import (
    CATEGORY_ORDER,
    PHASES,
    ROOT_MODULE,
    UNATTRIBUTED,
    Category,
    Phase,
    Role,
    category_color,
    category_plural,
    category_rank,
    module_label,
    parse_module_label,
    parse_phase_label,
    parse_tensor_mark,
    phase_color,
    phase_in_sentence,
    phase_label,
    phase_noun,
    tensor_mark,
)
from analyzer.simulate.events import CATEGORIES as TRUTH_CATEGORIES


def test_members_read_as_their_words():
    assert Phase.FORWARD == "forward" and {Phase.LOAD: 1}["load"] == 1
    assert f"{Phase.CHECKPOINT_SAVE}" == str(Phase.CHECKPOINT_SAVE) == "checkpoint_save"
    assert type(str(Category.INPUT)) is str and json.dumps({Category.INPUT: Phase.LOAD}) == '{"input": "load"}'
    assert PHASES == ("load", "forward", "backward", "optimizer", "checkpoint_save", "compile", "other")
    assert CATEGORY_ORDER[-1] == UNATTRIBUTED and CATEGORY_ORDER[0] == "parameter"


def test_truth_keeps_buffers_that_the_analysis_files_as_parameters():
    assert Role.BUFFER.category is Category.PARAMETER and Role.GRADIENT.category is Category.GRADIENT
    assert "buffer" in TRUTH_CATEGORIES and "buffer" not in CATEGORY_ORDER
    assert set(TRUTH_CATEGORIES) - {"buffer"} == set(CATEGORY_ORDER) - {UNATTRIBUTED}


def test_words_in_sentences_and_unknown_names():
    assert Phase.OPTIMIZER.noun == "optimizer step" and Phase.OPTIMIZER.in_sentence == "the optimizer step"
    assert phase_noun("warmup") is None and phase_noun(None) is None and phase_in_sentence("warmup") == "warmup"
    assert category_plural("optimizer_state") == "optimizer states" and category_plural("autograd_detail") == "autograd_detail"
    assert phase_color("forward") == Phase.FORWARD.color and category_color(UNATTRIBUTED) == phase_color(UNATTRIBUTED)
    assert phase_color("warmup") == phase_color("warmup") != phase_color("forward")
    assert sorted(["unattributed", "zz", "activation", "parameter"], key=category_rank) == \
        ["parameter", "activation", "unattributed", "zz"]


def test_every_name_the_writers_make_is_read_back():
    assert parse_phase_label(phase_label("forward")) == "forward"
    assert parse_phase_label("phase::two words") is None
    for direction in (Phase.FORWARD, Phase.BACKWARD):
        for fqn in ("", "layers.0.mlp"):
            assert parse_module_label(module_label(direction, fqn)) == (direction, fqn)
    with pytest.raises(ValueError):
        module_label("sideways", "x")
    for role in Role:
        assert parse_tensor_mark(tensor_mark(role, "layers.1", 0x7F00)) == (role, "layers.1", 0x7F00)
    assert tensor_mark("parameter", "w", "uid:3") == "tensor::parameter::w::uid:3"
    assert parse_tensor_mark(tensor_mark("parameter", "w", "uid:3")) is None   # not an address yet


def test_the_attribution_reads_the_protocol():
    assert classify(phase_label("backward"))[:2] == ("tag", "backward")
    assert classify(module_label(Phase.FORWARD, "")) == ("tag", "forward", ROOT_MODULE, "tag:module")
    assert classify(tensor_mark(Role.BUFFER, "bn", 16))[3] == "tag:tensor"
    import pandas as pd

    marks = tensor_marks(pd.DataFrame({"name": [tensor_mark(Role.BUFFER, "", 0x10)], "start_us": [5.0]}))
    assert marks.to_dict("records") == [{"addr": 16, "t_us": 5.0, "role": "buffer", "module": ROOT_MODULE}]


@pytest.mark.parametrize(("n", "auto", "in_gib", "rate"), [
    (None, "unknown", "unknown", "unknown"),
    (512, "512 B", "512 B", "0.0 MiB"),          # issue 33.4: never "0.00 GiB" for a few bytes
    (1536, "1.50 KiB", "1.50 KiB", "0.0 MiB"),
    (-3 * 2**20, "-3.00 MiB", "-3.00 MiB", "-3.0 MiB"),
    (2**30 // 100 - 1, "10.24 MiB", "10.24 MiB", "10.2 MiB"),   # SMALLEST_GIB, each side
    (2**30 // 100, "10.24 MiB", "0.01 GiB", "10.2 MiB"),
    (80 * 2**30, "80.00 GiB", "80.00 GiB", "80.00 GiB"),
    (2**45, "32.00 TiB", "32768.00 GiB", "32768.00 GiB"),
])
def test_one_byte_formatter_three_policies(n, auto, in_gib, rate):
    assert format_bytes(n) == human_bytes(n) == auto
    assert format_bytes(n, "GiB") == gib(n) == in_gib
    assert format_bytes(n, "rate") == rate_bytes(n) == rate


def test_units_and_times():
    assert binary_unit(1023) == (1, "B") and binary_unit(2**30) == (2**30, "GiB") and binary_unit(2**60) == (2**40, "TiB")
    assert relative_seconds(2_500_000, 1_000_000) == "1.500 s" and relative_seconds(None, 0) == "time not recorded"
