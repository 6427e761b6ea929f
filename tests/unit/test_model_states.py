"""Model states from structure (analyzer.attribute.model_states), each rule on a hand-made snapshot, with the
case on each side of it."""
from __future__ import annotations

import pandas as pd
import pytest

from analyzer.attribute import attribute
from analyzer.core.timeline import live_at
from analyzer.core.trace import MemoryTrace
from support.snapshots import MiB, Recording

OPTIM = "/venv/lib/python3.11/site-packages/torch/optim/adam.py:120"
LINEAR_INIT = "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py:100"
MODEL = "/src/model.py:14"
SIZES = (4 * MiB, 4 * MiB, 16 * MiB, 2 * MiB)  # a parameter set: two 4 MiB weights, a 16 MiB one, a 2 MiB one


def labels(rec: Recording) -> pd.DataFrame:
    return attribute(rec.trace()).allocations


def by_category(allocations: pd.DataFrame, rows: pd.Series | None = None) -> dict[str, int]:
    chosen = allocations if rows is None else allocations[rows]
    sums = chosen.groupby("category", observed=True)["requested_bytes"].sum()
    return {str(k): int(v) for k, v in sums.items() if v}


def before_recording(rec: Recording, copies: int, extra: int | None = None) -> None:
    """`copies` tensors of every size of the parameter set (and one `extra` tensor) alive when recording starts."""
    for _ in range(copies):
        for size in SIZES:
            rec.alloc(size)
    if extra:
        rec.alloc(extra)
    rec.forget_history()


def forward(rec: Recording) -> list[int]:
    with rec.phase("forward"):
        return [rec.alloc(8 * MiB, MODEL, name="forward") for _ in range(3)]


def pre_recording(allocations: pd.DataFrame) -> pd.Series:
    return allocations["origin"].astype(str) != "trace"


def test_a_backward_that_makes_gradients_means_what_was_there_before_is_parameters() -> None:
    rec = Recording()
    before_recording(rec, copies=2)  # even counts: they would pair up, but the gradients are made here
    saved = forward(rec)
    with rec.phase("backward"):
        for size in SIZES:
            rec.alloc(size, with_frames=False)  # .grad, kept
        for addr in saved:
            rec.free(addr)
    a = labels(rec)
    assert by_category(a, pre_recording(a)) == {"parameter": 2 * sum(SIZES)}
    assert set(a.loc[pre_recording(a), "label_source"].astype(str).str.split(";").str[1]) == {
        "category=structure:persistent-before-recording+gradients-known"}


def test_a_backward_that_makes_no_gradient_accumulated_into_gradients_that_were_there() -> None:
    rec = Recording()
    before_recording(rec, copies=2, extra=1 * MiB)  # parameters + gradients, and one odd tensor
    saved = forward(rec)
    with rec.phase("backward"):
        temporary = rec.alloc(4 * MiB, with_frames=False)  # a gradient computed, added into .grad, dropped
        rec.free(temporary)
        for addr in saved:
            rec.free(addr)
    a = labels(rec)
    assert by_category(a, pre_recording(a)) == {"parameter": sum(SIZES), "gradient": sum(SIZES),
                                                "unattributed": 1 * MiB}


def test_without_backward_the_optimizer_state_says_whether_gradients_are_there() -> None:
    for copies, expected in ((2, {"parameter": sum(SIZES), "gradient": sum(SIZES)}),
                             (1, {"parameter": sum(SIZES)})):
        rec = Recording()
        for _ in range(2):  # Adam's two moments, made in an optimizer step before the recording
            for size in SIZES:
                rec.alloc(size, OPTIM, name="_single_tensor_adam")
        for _ in range(copies):
            for size in SIZES:
                rec.alloc(size, with_frames=False)
        rec.entries.clear()
        rec.annotations.clear()  # the moments keep their frames (a block's own), the rest have none
        forward(rec)
        a = labels(rec)
        rows = pre_recording(a) & (a["category"].astype(str) != "optimizer_state")
        assert by_category(a, rows) == expected, copies
        assert by_category(a, a["category"].astype(str) == "optimizer_state") == {"optimizer_state": 2 * sum(SIZES)}


def test_without_backward_or_optimizer_what_was_there_before_is_parameters() -> None:
    rec = Recording()
    before_recording(rec, copies=2)
    forward(rec)
    a = labels(rec)
    assert by_category(a, pre_recording(a)) == {"parameter": 2 * sum(SIZES)}


def test_state_made_per_parameter_by_an_objects_init_is_optimizer_state() -> None:
    rec = Recording()
    with rec.phase("load"):
        for size in SIZES:
            rec.alloc(size, LINEAR_INIT, name="__init__")  # the model's parameters
        for size in SIZES:
            rec.alloc(size, "/src/estimator.py:30", name="__init__")  # torch.zeros_like(p) per parameter
        rec.alloc(64 * MiB, "/src/data.py:30", name="__init__")  # a user object's buffer of another size
    forward(rec)
    a = labels(rec)
    made = a["t_alloc_us"].notna()
    assert by_category(a, made & (a["requested_bytes"] != 8 * MiB)) == {
        "parameter": sum(SIZES) + 64 * MiB, "optimizer_state": sum(SIZES)}


def test_a_tensor_that_replaces_a_parameter_in_the_optimizer_step_is_the_parameter() -> None:
    rec = Recording()
    with rec.phase("load"):
        weights = [rec.alloc(size, LINEAR_INIT, name="__init__") for size in SIZES]
    saved = forward(rec)
    for addr in saved:
        rec.free(addr)
    with rec.phase("optimizer"):
        for size in SIZES:  # exp_avg, exp_avg_sq: new state, nothing of their size freed
            rec.alloc(size, OPTIM, name="step")
            rec.alloc(size, OPTIM, name="step")
        for size, old in zip(SIZES, weights, strict=True):  # p.data = p - lr * update: a new tensor, the old one freed
            rec.alloc(size, OPTIM, name="step")
            rec.free(old)
    a = labels(rec)
    optimizer_made = a["phase"].astype(str) == "optimizer"
    assert by_category(a, optimizer_made) == {"parameter": sum(SIZES), "optimizer_state": 2 * sum(SIZES)}
    replaced = a[optimizer_made & (a["category"].astype(str) == "parameter")]
    assert set(replaced["label_source"].astype(str).str.split(";").str[1]) == {
        "category=structure:replaces-parameter-in-step"}
    # the parameter from the old one's free (the next event) on; never counted twice in the timeline
    assert (replaced["category_from_seq"] == replaced["seq_alloc"] + 1).all()
    timeline = attribute(rec.trace()).timeline
    steps = timeline["seq"].isin(replaced["seq_alloc"])
    assert (timeline.loc[steps, "parameter_bytes"] == sum(SIZES)).all()


def _replacing_run(steps: int) -> Recording:
    """A hand-written optimizer that makes `p.data` and its moment `m` anew every step (out of place), each new
    value before the old one's free: the step before's replacements are the ones this step replaces."""
    rec = Recording()
    with rec.phase("load"):
        weights = [rec.alloc(size, LINEAR_INIT, name="__init__") for size in SIZES]
    moments: list[int] = []
    for step in range(steps):
        saved = forward(rec)
        for addr in saved:
            rec.free(addr)
        with rec.phase("optimizer"):
            for i, size in enumerate(SIZES):
                new_m = rec.alloc(size, OPTIM, name="step")  # m = beta * m + (1 - beta) * g
                if step:
                    rec.free(moments[i])
                    moments[i] = new_m
                else:
                    moments.append(new_m)
                new_p = rec.alloc(size, OPTIM, name="step")  # p.data = p - lr * m
                rec.free(weights[i])
                weights[i] = new_p
    return rec


def test_a_parameter_replaced_every_step_stays_a_parameter_in_every_later_step() -> None:
    """The step before's new `p.data` is the parameter this step frees: each step's replacement pairs with it,
    so the third forward reads the whole parameter set (it read 0: the second step's new values stayed
    optimizer state), and a moment made anew every step, of the same sizes, stays optimizer state."""
    attributed = attribute(_replacing_run(steps=3).trace())
    a, timeline = attributed.allocations, attributed.timeline
    ends = a.loc[a["phase"].astype(str) == "forward", "seq_alloc"].sort_values().to_numpy()[2::3]  # each forward's last
    at = timeline.set_index("seq").loc[ends]
    assert at["parameter_bytes"].tolist() == [sum(SIZES)] * 3
    assert at["optimizer_state_bytes"].tolist() == [0, sum(SIZES), sum(SIZES)]
    kept = a[a["phase"].astype(str) == "optimizer"]
    assert by_category(kept) == {"parameter": 3 * sum(SIZES), "optimizer_state": 3 * sum(SIZES)}


def test_pairing_starts_at_three_quarters_of_the_optimizer_state() -> None:
    """PAIRED_STATE_SHARE: 6 candidates for 8 state tensors (0.75) pair up; 5 (0.625) are parameters."""
    for extra, paired in ((2, True), (1, False)):
        rec = Recording()
        for _ in range(2):
            for size in SIZES:
                rec.alloc(size, OPTIM, name="_single_tensor_adam")
        for size in (*SIZES, *(4 * MiB,) * extra):
            rec.alloc(size, with_frames=False)
        rec.entries.clear()
        rec.annotations.clear()
        forward(rec)
        a = labels(rec)
        assert ("gradient" in by_category(a, pre_recording(a))) is paired, extra


def test_structural_labels_say_so_with_a_lower_confidence() -> None:
    rec = Recording()
    before_recording(rec, copies=1)
    forward(rec)
    a = labels(rec)
    structural = a[a["label_source"].astype(str).str.contains("category=structure:")]
    assert len(structural) == len(SIZES) and (structural["confidence"] < 0.9).all()


def test_a_backward_counts_from_a_tenth_of_the_forwards_allocations() -> None:
    """BACKWARD_SHARE: 10 forward allocations and 1 in backward (0.1) are a backward that made no gradient, so
    what was there pairs up; with 11 forward allocations (1/11 < 0.1) it is not, and they are parameters."""
    for forward_allocations, paired in ((10, True), (11, False)):
        rec = Recording()
        before_recording(rec, copies=2)
        with rec.phase("forward"):
            saved = [rec.alloc(1 * MiB, MODEL, name="forward") for _ in range(forward_allocations)]
        with rec.phase("backward"):
            rec.free(rec.alloc(1 * MiB, with_frames=False))
            for addr in saved:
                rec.free(addr)
        a = labels(rec)
        assert ("gradient" in by_category(a, pre_recording(a))) is paired, forward_allocations


def test_what_data_parallel_replicates_for_a_forward_is_parameters() -> None:
    rec = Recording(device=1)
    with rec.phase("forward"):
        replica = rec.alloc(4 * MiB, "/venv/lib/python3.11/site-packages/torch/nn/parallel/replicate.py:126",
                            name="replicate")
        activation = rec.alloc(4 * MiB, MODEL, name="forward")
    with rec.phase("backward"):
        rec.free(rec.alloc(1 * MiB, with_frames=False))
        rec.free(activation)
        rec.free(replica)
    a = labels(rec)
    assert by_category(a, a["addr"] == replica) == {"parameter": 4 * MiB}
    assert by_category(a, a["addr"] == activation) == {"activation": 4 * MiB}


def test_without_any_history_nothing_is_called_a_parameter() -> None:
    rec = Recording()
    before_recording(rec, copies=1)  # an end state only: torch.cuda.memory_snapshot() without history
    a = labels(rec)
    assert by_category(a) == {"unattributed": sum(SIZES)}


def _estimator_update(replace_at_once: bool) -> pd.DataFrame:
    return labels(_estimator_recording(replace_at_once))


def _estimator_trace(replace_at_once: bool) -> MemoryTrace:
    return _estimator_recording(replace_at_once).trace()


def _estimator_recording(replace_at_once: bool) -> Recording:
    """A model, an estimator's K per parameter made by its `__init__`, a forward, then K updated out of place
    while the model is reloaded (`K = (1 - h) * K + h * g * g`): each new K made, then the old one freed, at once
    or only after everything else."""
    rec = Recording()
    with rec.phase("load"):
        for size in SIZES:
            rec.alloc(size, LINEAR_INIT, name="__init__")
        states = [rec.alloc(size, "/src/estimator.py:30", name="__init__") for size in SIZES]
    saved = forward(rec)
    for addr in saved:
        rec.free(addr)
    with rec.phase("load"):
        for size, old in zip(SIZES, states, strict=True):
            rec.alloc(size, "/src/estimator.py:60", name="update_K")
            if replace_at_once:
                rec.free(old)
        if not replace_at_once:
            for _ in range(5):   # 10 allocator events: the old K outlives the window
                rec.alloc(MiB, "/src/estimator.py:70", name="update_K")
            for old in states:
                rec.free(old)
    return rec


def test_a_kept_tensor_made_as_an_optimizer_state_of_its_size_is_freed_is_its_new_value() -> None:
    a = _estimator_update(replace_at_once=True)
    kept = a[a["t_alloc_us"].notna() & a["t_free_us"].isna() & (a["requested_bytes"] != 8 * MiB)]
    assert by_category(kept) == {"parameter": sum(SIZES), "optimizer_state": sum(SIZES)}
    replaced = kept[kept["category"].astype(str) == "optimizer_state"]
    assert set(replaced["label_source"].astype(str).str.split(";").str[1]) == {
        "category=structure:replaces-optimizer-state"}


def test_a_new_value_is_the_updates_temporary_until_the_old_state_is_freed() -> None:
    """Between a new K's allocation and the old K's free both are live: the state counts once, the new one as a
    temporary, at that moment and in the category timeline; from the free on it is the state."""
    rec_labels = _estimator_update(replace_at_once=True)
    replaced = rec_labels[rec_labels["label_source"].astype(str).str.contains("replaces-optimizer-state")]
    assert len(replaced) == len(SIZES)
    assert (replaced["category_from_seq"] == replaced["seq_alloc"] + 1).all()   # the old K is freed next
    assert rec_labels.drop(replaced.index)["category_from_seq"].isna().all()
    trace = attribute(_estimator_trace(replace_at_once=True))
    timeline = trace.timeline.set_index("seq")
    categories = [c for c in timeline.columns if c.endswith("_bytes") and c not in
                  ("allocated_bytes", "requested_bytes", "reserved_bytes")]
    assert (timeline[categories].sum(axis=1) == timeline["allocated_bytes"]).all()
    for _, row in replaced.iterrows():
        made, settles = int(row["seq_alloc"]), int(row["category_from_seq"])
        during = live_at(trace, 0, made).set_index("alloc_id")
        after = live_at(trace, 0, settles).set_index("alloc_id")
        assert during.loc[row["alloc_id"], "category"] == "temporary"
        assert after.loc[row["alloc_id"], "category"] == "optimizer_state"
        assert by_category(during)["optimizer_state"] == sum(SIZES)   # the old K, not both
        assert timeline.loc[made, "optimizer_state_bytes"] == sum(SIZES)
        assert timeline.loc[made, "temporary_bytes"] - timeline.loc[made - 1, "temporary_bytes"] == row["allocated_bytes"]
        assert timeline.loc[settles, "optimizer_state_bytes"] == sum(SIZES)


def test_a_tag_on_the_new_value_wins_and_holds_for_its_whole_life() -> None:
    """A `tensor::` mark is the user's word: the row takes its role for its whole life, no `category_from_seq`."""
    rec = _estimator_recording(replace_at_once=True)
    new_k = [e for e in rec.entries if e["action"] == "alloc" and e["frames"]
             and e["frames"][0]["name"] == "update_K"][0]
    with rec.range(f"tensor::parameter::k::{new_k['addr']:#x}"):
        pass
    got = labels(rec)
    row = got[got["addr"] == new_k["addr"]].iloc[-1]
    assert str(row["category"]) == "parameter" and "category=tag:tensor" in str(row["label_source"])
    assert pd.isna(row["category_from_seq"])


def test_a_tensor_made_long_before_the_state_is_freed_is_not_its_new_value() -> None:
    a = _estimator_update(replace_at_once=False)
    kept = a[a["t_alloc_us"].notna() & a["t_free_us"].isna() & ~a["requested_bytes"].isin([8 * MiB, MiB])]
    assert by_category(kept) == {"parameter": 2 * sum(SIZES)}


WORKSPACE = 8 * MiB + 128 * 1024   # torch's default cuBLAS workspace (32 MiB on sm90)
BLAS = ("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)",
        "at::cuda::getNewWorkspace()", "at::cuda::getCurrentCUDABlasHandle()",
        "at::native::structured_bmm_out_cuda::impl(at::Tensor const&, at::Tensor const&, at::Tensor const&)")
GEMM = ("at::native::structured_bmm_out_cuda::impl(at::Tensor const&, at::Tensor const&, at::Tensor const&)",)


SM90_WORKSPACE = 32 * MiB


@pytest.mark.parametrize("native, size, made, twin, signals", [
    (BLAS, SM90_WORKSPACE, "other", "other", ("frames:blas-workspace", "structure:blas-workspace-size")),
    (GEMM, SM90_WORKSPACE, "gradient", "parameter", None),
    (GEMM, WORKSPACE, "other", "other", ("structure:blas-workspace-size", "structure:blas-workspace-size")),
])
def test_a_blas_workspace_is_other_and_so_is_its_frameless_twin_from_before_the_recording(native, size, made, twin,
                                                                                          signals):
    """The main thread's cuBLAS workspace was made before the recording (a frameless block kept to the end, of
    the workspace's size); the autograd thread makes its own at its first matmul, in backward, and keeps it: the
    C++ frames show the handle pool making it. Where they show only the matmul, a 32 MiB kept backward tensor is
    a gradient and the block from before is the parameter that has it; the default 8,519,680 B is a workspace by
    its size alone (jaspersolt's)."""
    rec = Recording()
    rec.alloc(size, with_frames=False)
    rec.forget_history()
    with rec.phase("forward"):
        rec.free(rec.alloc(8 * MiB, MODEL, name="forward"))
    with rec.phase("backward"):
        rec.alloc(size, with_frames=False, native=native)
    with rec.phase("optimizer"):
        rec.free(rec.alloc(1 * MiB, OPTIM, name="step"))
    got = labels(rec)
    workspace = got["requested_bytes"] == size
    pre = pre_recording(got)
    assert got.loc[workspace & ~pre, "category"].astype(str).tolist() == [made]
    assert got.loc[workspace & pre, "category"].astype(str).tolist() == [twin]
    if signals:
        for rows, signal in zip((workspace & ~pre, workspace & pre), signals, strict=True):
            assert got.loc[rows, "label_source"].astype(str).str.contains(f"category={signal};").all()


def _python_only_workspaces(kept: int = 1, freed: int = 0, loading: bool = False) -> pd.DataFrame:
    """A forward whose first matmul makes the default-size workspace (Python frames only) and keeps it; `kept`
    such tensors, `freed` more of that size made and freed, made while loading if `loading`."""
    rec = Recording()
    with rec.phase("load" if loading else "forward"):
        for _ in range(kept):
            rec.alloc(WORKSPACE, MODEL, name="forward")
        for _ in range(freed):
            rec.free(rec.alloc(WORKSPACE, MODEL, name="forward"))
        rec.free(rec.alloc(8 * MiB, MODEL, name="forward"))
    got = labels(rec)
    return got[got["requested_bytes"] == WORKSPACE]


def test_a_kept_tensor_of_the_default_workspace_size_is_a_workspace_by_its_size() -> None:
    for kept in (1, 2):
        got = _python_only_workspaces(kept)
        assert got["category"].astype(str).tolist() == ["other"] * kept
        assert got["label_source"].astype(str).str.contains("category=structure:blas-workspace-size;").all()


@pytest.mark.parametrize("why, kwargs", [("more than a thread each", {"kept": 3}),
                                         ("the size also came and went", {"freed": 1}),
                                         ("made while loading", {"loading": True})])
def test_the_default_size_alone_is_not_enough_when_the_rows_of_it_look_like_tensors(why, kwargs) -> None:
    assert "other" not in set(_python_only_workspaces(**kwargs)["category"].astype(str)), why
