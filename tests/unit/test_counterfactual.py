"""Counterfactual replay on hand-made streams: each transform changes what its remedy acts on and nothing else,
and the replay's peaks and out-of-memory answer are the allocator model's, fragmentation included."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analyzer.attribute import attribute
from analyzer.diagnose.blocks import blocks
from analyzer.diagnose.counterfactual import Replayer, predict, recorded_stream, replay, requests_of
from analyzer.diagnose.transforms import Stream, accumulation, bf16, checkpointing, micro_batch, zero, zero3
from analyzer.simulate.allocator import AllocatorSettings
from tests.support.snapshots import MiB, Recording

NO_STACKS = pd.DataFrame({"stack_id": pd.Series(dtype="int64"), "frames": pd.Series(dtype=object),
                          "op": pd.Series(dtype=object)})


def stream(rows: list[tuple], stacks: pd.DataFrame = NO_STACKS) -> Stream:
    """rows: (at, until, bytes, category, phase, module[, step, stack_id])."""
    full = [(*r, 1.0, np.nan)[:8] if len(r) == 6 else r for r in rows]
    frame = pd.DataFrame(full, columns=["at", "until", "bytes", "category", "phase", "module", "step", "stack_id"])
    frame["stream"] = 0
    return Stream(rows=frame.astype({"at": float, "until": float, "bytes": "int64", "step": float, "stack_id": float}),
                  releases=np.array([]), stacks=stacks)


def live_after(s: Stream, position: float) -> int:
    r = s.rows
    return int(r.loc[(r["at"] <= position) & (r["until"] > position), "bytes"].sum())


def test_micro_batch_scales_what_the_batch_makes_and_leaves_model_states():
    s = stream([(0, 9, 8 * MiB, "activation", "forward", "m"), (1, 2, 4 * MiB, "temporary", "backward", "m"),
                (-1, np.inf, 6 * MiB, "parameter", "load", "m"), (3, 4, 2 * MiB, "temporary", "optimizer", "m"),
                (5, 6, 2 * MiB, "input", "other", "m")])
    out = micro_batch(s, 2).rows["bytes"].tolist()
    assert out == [4 * MiB, 2 * MiB, 6 * MiB, 2 * MiB, 1 * MiB]


def test_replay_out_of_memory_on_each_side_of_the_capacity():
    s = stream([(0, 5, 30 * MiB, "activation", "forward", "m"), (1, 6, 30 * MiB, "activation", "forward", "m")])
    fits, short = replay(s, 60 * MiB), replay(s, 60 * MiB - 512)
    assert (fits.oom, short.oom) == (False, True)
    assert fits.peak_allocated_bytes == short.peak_allocated_bytes == 60 * MiB   # the run goes on past the OOM
    assert fits.peak_reserved_bytes == 60 * MiB
    assert short.oom_at == 1
    assert replay(s, None).oom is None


def test_a_resized_stream_takes_the_order_of_one_at_the_same_places_and_only_that():
    """A transform that only resizes rows reuses the order of a stream at the same places (no sort): the requests
    are those of sorting anew; a row made elsewhere, or one of 0 bytes (it makes no request), is sorted anew."""
    rows = [(i % 7, 9 + (i * 5) % 11, (1 + i) * MiB, "activation", "forward", "m") for i in range(40)]
    base = stream(rows)
    like = (base, requests_of(base))
    for changed, reused in ((micro_batch(base, 2), True), (base.with_rows(base.rows.assign(at=base.rows["at"] + 0.5)), False),
                            (base.with_rows(base.rows.assign(bytes=base.rows["bytes"].where(base.rows.index != 3, 0))), False)):
        shared, fresh = requests_of(changed, like), requests_of(changed)
        assert (shared.kind is like[1].kind) == reused
        for field in ("kind", "ordinal", "position", "size", "stream", "row"):
            assert np.array_equal(getattr(shared, field), getattr(fresh, field)), field
        assert replay(changed, None, requests=shared) == replay(changed, None)


def test_fragmentation_fails_where_expandable_segments_fit():
    """Nine 6 MiB blocks in three 20 MiB segments; two of each three freed: 36 MiB cached, but every segment is
    split by its live block, so a 30 MiB request needs a new segment the device cannot give."""
    rows = [(i, 120 if i % 3 == 1 else 20, 6 * MiB, "activation", "forward", "m") for i in range(9)]
    rows.append((30, 40, 30 * MiB, "activation", "forward", "m"))
    s = stream(rows)
    fixed = replay(s, 80 * MiB)
    expandable = replay(s, 80 * MiB, AllocatorSettings(expandable_segments=True))
    assert fixed.oom is True and expandable.oom is False
    assert fixed.peak_allocated_bytes == expandable.peak_allocated_bytes == 54 * MiB


def test_checkpointing_keeps_block_outputs_and_recomputes_in_backward():
    rows = []
    for b in range(2):          # block b: three activations in forward, freed in backward in reverse
        for j in range(3):
            at = 10 * b + j
            rows.append((at, 100 - at, 4 * MiB, "activation", "forward", f"layers.{b}.mlp"))
        rows.append((10 * b + 3, 10 * b + 4, 1 * MiB, "temporary", "forward", f"layers.{b}"))
    rows.append((95, 96, 1 * MiB, "temporary", "backward", "layers.1.mlp"))
    before = stream(rows)
    after = checkpointing(before)
    assert live_after(before, 50) == 24 * MiB
    assert live_after(after, 50) == 8 * MiB                      # the two outputs
    # block 1 is recomputed before the first free of what it saved (88), block 0 before its own (99)
    assert live_after(after, 89.5) == 8 * MiB                    # block 1's last saved tensor and block 0's output
    assert live_after(after, 99.5) == live_after(before, 99.5) == 4 * MiB
    assert live_after(after, 98.5) == 0                          # the output went at 98, the recompute comes at 99
    assert len(after.rows) == len(before.rows) + 8


def test_checkpointing_needs_repeated_blocks():
    s = stream([(0, 9, 4 * MiB, "activation", "forward", "encoder"), (1, 8, 4 * MiB, "activation", "forward", "encoder")])
    assert checkpointing(s).rows.equals(s.rows)
    found = blocks(["GPT › Block[3] › MLP", "model.layers.12.self_attn", "lm_head"])
    assert found["GPT › Block[3] › MLP"].path == "GPT › Block[3]"
    assert found["model.layers.12.self_attn"].path == "model.layers.12"
    assert found["lm_head"] is None


def test_bf16_halves_what_the_ops_say_runs_in_bf16():
    stacks = pd.DataFrame({"stack_id": [0, 1, 2, 3],
                           "frames": [(), (), (), (("/x/site-packages/torch/nn/modules/linear.py", 1, "forward"),)],
                           "op": ["aten::addmm", "aten::native_layer_norm", "aten::gelu", None]})
    s = stream([(-1, np.inf, 8 * MiB, "parameter", "load", "fc", 0, np.nan),
                (1, 9, 4 * MiB, "activation", "forward", "fc", 1, 0),
                (2, 9, 6 * MiB, "activation", "forward", "ln", 1, 1),
                (3, 9, 2 * MiB, "activation", "forward", "act", 1, 2),
                (4, 9, 10 * MiB, "activation", "forward", "fc2", 1, 3),
                (8, 8.5, 4 * MiB, "temporary", "backward", "", 1, np.nan)], stacks)
    out = bf16(s).rows
    assert out["bytes"].tolist()[:6] == [8 * MiB, 2 * MiB, 6 * MiB, 2 * MiB, 5 * MiB, 2 * MiB]
    copy = out.iloc[6]                                   # the bf16 copy of fc's weight, forward to end of backward
    assert (copy["bytes"], copy["at"] < 1, copy["until"] > 8) == (4 * MiB, True, True)
    assert len(out) == 7


def test_zero_shards_model_states_by_stage():
    s = stream([(-1, np.inf, 8 * MiB, "parameter", "load", "m"), (5, 20, 8 * MiB, "gradient", "backward", "m"),
                (10, np.inf, 16 * MiB, "optimizer_state", "optimizer", "m")])
    one, two = zero(s, 1, 4).rows, zero(s, 2, 4).rows
    assert one["bytes"].tolist() == [8 * MiB, 8 * MiB, 4 * MiB]
    assert two["bytes"].tolist() == [8 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]   # the full gradient last: transient
    assert two.iloc[3]["until"] - two.iloc[3]["at"] < 1


def test_accumulation_keeps_the_first_micro_batch_gradients():
    s = stream([(1, 4, 8 * MiB, "activation", "forward", "m"), (3, 20, 2 * MiB, "gradient", "backward", "m"),
                (10, 11, 1 * MiB, "temporary", "optimizer", "m")])
    out = accumulation(s, 2).rows
    grads = out[out["category"] == "gradient"]
    assert sorted(grads["bytes"].tolist()) == [2 * MiB, 2 * MiB]
    assert grads["until"].max() == 20 and (grads["until"] - grads["at"]).min() < 1   # the second is summed in
    assert sorted(out.loc[out["category"] == "activation", "bytes"].tolist()) == [4 * MiB, 4 * MiB]
    assert live_after(stream([(1, 4, 8 * MiB, "activation", "forward", "m")]), 2) == 8 * MiB
    assert max(live_after(accumulation(s, 2).with_rows(out[out["category"] == "activation"]), p)
               for p in np.arange(0, 10, 0.25)) == 4 * MiB   # the two halves never live at once


def test_recorded_stream_carries_the_failed_request_and_needs_a_history():
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(64 * MiB)
    rec.oom(128 * MiB, device_free=0)
    trace = attribute(rec.trace())   # the 64 MiB made in forward and freed never: an activation
    s = recorded_stream(trace, 0)
    assert s is not None and s.rows["bytes"].tolist()[-1] == 128 * MiB
    p = predict(trace, 0, ["micro_batch", "no_such_remedy"], capacity=64 * MiB, shards=None)
    assert set(p) == {"micro_batch"} and p["micro_batch"].oom is True
    # a remedy whose transform finds nothing it acts on is left to the formula: the replay cannot judge it
    assert predict(trace, 0, ["optimizer_8bit"], capacity=64 * MiB, shards=None) == {}
    rec.forget_history()
    assert recorded_stream(rec.trace(), 0) is None


def test_a_micro_batch_scales_activations_of_an_unknown_phase_not_the_optimizers():
    """A memory timeline records categories but no phase: its activations still scale with the batch; what the
    optimizer step, loading or checkpoint saving make does not."""
    s = stream([(1, 4, 8 * MiB, "activation", "unattributed", "m"), (2, 5, 4 * MiB, "temporary", "optimizer", "m"),
                (3, 6, 2 * MiB, "activation", "load", "m")])
    assert micro_batch(s, 2).rows["bytes"].tolist() == [4 * MiB, 4 * MiB, 2 * MiB]


def _two_block_step() -> Stream:
    """Two blocks of 8 MiB of parameters and a 4 MiB embedding (the root unit); one step: the embedding's output,
    each block's forward, each block's backward making its gradient, the embedding's gradient, Adam's state."""
    return stream([
        (-1, np.inf, 8 * MiB, "parameter", "load", "layers.0.fc"), (-1, np.inf, 8 * MiB, "parameter", "load", "layers.1.fc"),
        (-1, np.inf, 4 * MiB, "parameter", "load", "embed"),
        (0, 16, 1 * MiB, "activation", "forward", "embed"),
        (1, 15, 2 * MiB, "activation", "forward", "layers.0.fc"), (2, 3, 1 * MiB, "temporary", "forward", "layers.0"),
        (4, 11, 2 * MiB, "activation", "forward", "layers.1.fc"), (5, 6, 1 * MiB, "temporary", "forward", "layers.1"),
        (10, 12, 1 * MiB, "temporary", "backward", "layers.1.fc"), (11, 30, 8 * MiB, "gradient", "backward", "layers.1.fc"),
        (13, 17, 1 * MiB, "temporary", "backward", "layers.0.fc"), (14, 30, 8 * MiB, "gradient", "backward", "layers.0.fc"),
        (18, 30, 4 * MiB, "gradient", "backward", "embed"),
        (20, np.inf, 40 * MiB, "optimizer_state", "optimizer", "m")])


def test_zero3_gathers_each_block_around_its_forward_and_its_backward():
    before = _two_block_step()
    after = zero3(before, 4)
    shards = 5 * MiB                                   # the 20 MiB of parameters over 4 GPUs
    assert live_after(before, -0.5) == 20 * MiB and live_after(after, -0.5) == shards
    # block 0 running forward: its 8 MiB gathered, the root's 4 MiB gathered from the step's start
    assert live_after(after, 1.5) == shards + 4 * MiB + 8 * MiB + 1 * MiB + 2 * MiB
    assert live_after(after, 3.5) == shards + 4 * MiB + 1 * MiB + 2 * MiB      # block 0's freed after its forward
    assert live_after(after, 4.5) == shards + 4 * MiB + 8 * MiB + 1 * MiB + 2 * MiB + 2 * MiB
    assert live_after(after, 8) == shards + 4 * MiB + 1 * MiB + 4 * MiB      # between forward and backward
    # block 1's backward: gathered again (8 MiB); at its gradient (its activation freed) the reduce-scatter's
    # 8 MiB buffer, then the 2 MiB shard; then the full gradient, the buffer and the gathered parameters go
    assert live_after(after, 10.5) == shards + 4 * MiB + 1 * MiB + 4 * MiB + 8 * MiB + 1 * MiB
    assert live_after(after, 11 + 2e-4) == live_after(after, 10.5) - 2 * MiB + 8 * MiB + 8 * MiB
    assert live_after(after, 11 + 3e-4) == live_after(after, 10.5) - 2 * MiB + 8 * MiB + 8 * MiB + 2 * MiB
    assert live_after(after, 11.5) == live_after(after, 10.5) - 2 * MiB - 8 * MiB + 2 * MiB
    # the root unit is gathered until its own reduce-scatter, after the embedding's gradient (18)
    assert live_after(after, 18 + 3e-4) == shards + 4 * MiB + 4 * MiB + 4 * MiB + 2 * MiB + 2 * MiB + 1 * MiB
    # after the step: the parameters' and the gradients' shards, Adam's state 1/4
    assert live_after(after, 25) == shards + 5 * MiB + 10 * MiB
    assert live_after(before, 25) == 20 * MiB + 20 * MiB + 40 * MiB


def test_zero3_needs_blocks_and_a_backward_to_place_its_gathers():
    blocks_without_backward = stream([(-1, np.inf, 8 * MiB, "parameter", "load", "layers.0.fc"),
                                      (1, 3, 2 * MiB, "activation", "forward", "layers.0.fc"),
                                      (4, 6, 2 * MiB, "activation", "forward", "layers.1.fc")])
    one_module = stream([(-1, np.inf, 8 * MiB, "parameter", "load", "encoder"),
                         (1, 3, 2 * MiB, "activation", "forward", "encoder"), (4, 6, 2 * MiB, "gradient", "backward", "encoder")])
    assert zero3(blocks_without_backward, 4) is blocks_without_backward and zero3(one_module, 4) is one_module
    # parameters made before the recording own no module: which unit gathers them is unknown
    rows = _two_block_step().rows
    unowned = _two_block_step().with_rows(rows.assign(module=rows["module"].where(rows["category"] != "parameter",
                                                                                  "unattributed")))
    assert zero3(unowned, 4) is unowned and len(zero3(_two_block_step(), 4).rows) > len(rows)   # owned: gathered


def _no_optimizer(expandable: bool = False):
    """A forward pass that keeps a 64 MiB activation and a backward: no optimizer, no blocks."""
    rec = Recording()
    with rec.step(1):
        with rec.phase("forward"):
            kept = rec.alloc(64 * MiB)
            rec.free(rec.alloc(32 * MiB))
        with rec.phase("backward"):
            rec.free(rec.alloc(2 * MiB))
            rec.free(kept)
    return attribute(rec.trace(expandable_segments=expandable))


def test_the_plan_and_the_remedy_list_replay_by_one_rule():
    """A remedy is replayed only where its transform acts on the recording, whether the remedy list (predict)
    or the plan (Replayer) asks: micro-batches act on this forward's activations, 8-bit Adam finds no optimizer
    state, ZeRO-3 no blocks, bf16 no op or frame it halves (its transform returns the same values, in a wider
    column); expandable segments act unless the recording already had them."""
    trace = _no_optimizer()
    replayer = Replayer(trace, 0, 256 * MiB, {"zero3": 4})
    asked = ["micro_batch", "optimizer_8bit", "zero3", "bf16", "expandable_segments"]
    assert [replayer.can(r, None) for r in asked] == [True, False, False, False, True]
    assert set(predict(trace, 0, asked, 256 * MiB, 4)) == {"micro_batch", "expandable_segments"}
    assert replayer.run([("micro_batch", 2)]).peak_allocated_bytes == 48 * MiB
    assert predict(trace, 0, ["micro_batch"], 256 * MiB, 4)["micro_batch"].peak_allocated_bytes == 64 * MiB // 2 + 16 * MiB
    already = _no_optimizer(expandable=True)
    assert not Replayer(already, 0, 256 * MiB, {}).can("expandable_segments", None)
    assert predict(already, 0, ["expandable_segments"], 256 * MiB, 4) == {}


def _cached_then_smaller(**settings):
    """A 100 MiB activation freed, then a 10 MiB one: the second can take the first's cached block."""
    from dataclasses import replace

    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.free(rec.alloc(100 * MiB))
        rec.free(rec.alloc(10 * MiB))
    trace = attribute(rec.trace())
    return replace(trace, allocator_settings={**trace.allocator_settings, **settings})


@pytest.mark.parametrize("settings, reserved", [({"max_split_size": -1}, 50 * MiB),
                                                ({"max_split_size": 32 * MiB}, 70 * MiB),
                                                ({"max_split_size": "32 MiB"}, 50 * MiB)])
def test_a_replay_runs_with_the_recordings_allocator_settings(settings, reserved):
    """Halved, the 5 MiB request is cut from the cached 50 MiB block, unless the recording ran with
    max_split_size_mb:32: a request below it never takes a block above it, and a 20 MiB segment is made. torch
    reports the setting in bytes, -1 when unset; a value of another type is no setting."""
    run = Replayer(_cached_then_smaller(**settings), 0, None, {}).run([("micro_batch", 2)])
    assert (run.peak_allocated_bytes, run.peak_reserved_bytes) == (50 * MiB, reserved)


def test_recorded_settings_read_the_divisions_by_interval_and_drop_what_is_not_one():
    from analyzer.diagnose.counterfactual import recorded_settings

    trace = _cached_then_smaller(roundup_power2_divisions={"1": 4, "2": "x", "bad": 8}, expandable_segments="yes")
    assert recorded_settings(trace) == AllocatorSettings(roundup_power2_divisions={"1": 4})
