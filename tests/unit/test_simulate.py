"""Simulated snapshots: valid torch layouts, consistent with their ground truth, and showing what each scenario
was built to show, measured from the files with the analyzer's own reader."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import analyzer
from analyzer.core.timeline import find_peak
from support.paths import FIXTURES, ROOT

SIM = FIXTURES / "sim"
SCENARIOS = ["gpt_activation_peak", "adam_first_step", "checkpoint_gather", "fragmentation", "capacity_oom",
             "expandable", "leak", "healthy", "activation_cache"]
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
ENTRY_KEYS = {"action", "size", "stream", "time_us", "compile_context", "user_metadata", "frames"}


def _raw(name: str) -> dict:
    with open(SIM / f"{name}.pickle", "rb") as f:
        return pickle.load(f)


def _truth(name: str) -> dict:
    return json.loads((SIM / f"{name}.truth.json").read_text())


@pytest.fixture(scope="module")
def traces() -> dict[str, analyzer.MemoryTrace]:
    return {name: analyzer.load(SIM / f"{name}.pickle") for name in SCENARIOS}


# ---- every file: torch's layout, internal consistency, ground truth ------------------------------------
@pytest.mark.parametrize("name", SCENARIOS)
def test_layout_is_torch_2_13(name):
    raw_bytes = (SIM / f"{name}.pickle").read_bytes()
    assert raw_bytes[:2] == b"\x80\x04" and len(raw_bytes) < 2 << 20       # pickle protocol 4, under 2 MiB
    data = _raw(name)
    assert set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert all(set(s) == SEGMENT_KEYS for s in data["segments"])
    for entry in data["device_traces"][0]:
        assert ENTRY_KEYS <= set(entry)
        assert ("device_free" in entry) == (entry["action"] == "oom") and ("addr" in entry) != (entry["action"] == "oom")
    times = [e["time_us"] for e in data["device_traces"][0]]
    assert times == sorted(times)


@pytest.mark.parametrize("name", SCENARIOS)
def test_blocks_tile_segments_and_sums_hold(name):
    for segment in _raw(name)["segments"]:
        cursor = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == cursor
            cursor += block["size"]
        assert cursor - segment["address"] == segment["total_size"]
        active = [b for b in segment["blocks"] if b["state"] == "active_allocated"]
        assert segment["allocated_size"] == segment["active_size"] == sum(b["size"] for b in active)
        assert segment["requested_size"] == sum(b["requested_size"] for b in active)


@pytest.mark.parametrize("name", SCENARIOS)
def test_replaying_the_trace_reproduces_the_final_state(name, traces):
    trace = traces[name]
    assert not trace.warnings and not trace.devices[0].history_truncated
    end, last = trace.end_state(0), trace.timeline.iloc[-1]
    assert end["allocated_bytes"] == last["allocated_bytes"]
    assert end["requested_bytes"] == last["requested_bytes"]
    assert end["reserved_bytes"] == last["reserved_bytes"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_ground_truth_covers_every_alloc_and_sums_to_the_trace(name):
    truth, entries = _truth(name), _raw(name)["device_traces"][0]
    allocs = {i: e for i, e in enumerate(entries) if e["action"] == "alloc"}
    assert set(map(int, truth["allocations"])) == set(allocs)
    assert sum(a["bytes"] for a in truth["allocations"].values()) == sum(e["size"] for e in allocs.values())
    categories = {a["category"] for a in truth["allocations"].values()}
    assert categories <= {"parameter", "buffer", "gradient", "optimizer_state", "activation", "temporary", "input", "other"}
    assert {"parameter", "buffer", "activation", "input"} <= categories
    modules = {a["module"] for a in truth["allocations"].values()}
    assert {"embed", "lm_head", "layers.0.attn"} <= modules


# ---- each scenario shows what it was built to show ---------------------------------------------------
def _windows(trace, name: str) -> list[tuple[int, int]]:
    a = trace.annotations
    rows = a[a["name"] == name]
    return list(zip(rows["start_us"].astype("int64"), rows["end_us"].astype("int64"), strict=True))


def _allocated_between(trace, start: int, end: int) -> np.ndarray:
    tl = trace.timeline
    return tl.loc[(tl["t_us"] >= start) & (tl["t_us"] <= end), "allocated_bytes"].to_numpy()


def test_capacity_oom_is_in_the_forward_pass(traces):
    trace = traces["capacity_oom"]
    (oom,) = trace.ooms.itertuples()
    frames = trace.stack_frames(oom.stack_id)
    assert any(f[0].endswith("gpt.py") and f[2] == "forward" for f in frames)   # raised inside a module's forward
    assert not _windows(trace, "Optimizer.step#Adam.step")                        # before any optimizer step
    assert _truth("capacity_oom")["oom"]["phase"] == "forward"


def test_fragmentation_oom_with_enough_free_memory_in_pieces(traces):
    trace = traces["fragmentation"]
    (oom,) = trace.ooms.itertuples()
    at_oom = trace.timeline.set_index("seq").loc[oom.seq]
    cached = int(at_oom["reserved_bytes"] - at_oom["allocated_bytes"])
    largest = trace.end_state(0)["largest_free_block_bytes"]
    print(f"request {oom.requested_bytes}, device free {oom.device_free_bytes}, cached {cached}, largest {largest}")
    assert oom.device_free_bytes + cached >= oom.requested_bytes
    assert largest < oom.requested_bytes and oom.device_free_bytes < oom.requested_bytes


def test_expandable_segments_map_and_unmap_instead_of_oom(traces):
    actions = set(traces["expandable"].events["action"])
    assert {"segment_map", "segment_unmap"} <= actions
    assert "segment_alloc" not in actions and traces["expandable"].ooms.empty


def test_adam_first_step_spikes_and_later_steps_do_not(traces):
    trace = traces["adam_first_step"]
    spikes, peaks = [], []
    for start, end in _windows(trace, "Optimizer.step#Adam.step"):
        inside = _allocated_between(trace, start, end)
        spikes.append(int(inside.max() - inside[0]))
        peaks.append(int(inside.max()))
    print("optimizer-step spikes", spikes, "peaks", peaks)
    assert len(spikes) == 3 and spikes[0] > 2 * max(spikes[1:])
    assert peaks[0] >= max(peaks[1:]) and find_peak(trace, 0).time_us <= _windows(trace, "Optimizer.step#Adam.step")[0][1]


def test_checkpoint_gather_peaks_above_training(traces):
    trace = traces["checkpoint_gather"]
    last_step_end = _windows(trace, "ProfilerStep#3")[0][1]
    tl = trace.timeline
    training = int(tl.loc[tl["t_us"] <= last_step_end, "allocated_bytes"].max())
    saving = int(tl.loc[tl["t_us"] > last_step_end, "allocated_bytes"].max())
    print(f"training peak {training}, save peak {saving}")
    assert saving > training * 1.1


def test_activations_dominate_the_activation_peak(traces):
    trace = traces["gpt_activation_peak"]
    peak = find_peak(trace, 0)
    labels = _truth("gpt_activation_peak")["allocations"]
    by_category: dict[str, int] = {}
    for row in peak.live.itertuples():
        category = labels[str(int(row.seq_alloc))]["category"]
        by_category[category] = by_category.get(category, 0) + row.allocated_bytes
    share = by_category["activation"] / peak.allocated_bytes
    print(f"activation share of the peak {share:.0%}")
    assert share > 0.6 and by_category["activation"] == max(by_category.values())


def _step_peaks(trace) -> list[int]:
    return [int(_allocated_between(trace, *_windows(trace, f"ProfilerStep#{n}")[0]).max()) for n in (1, 2, 3)]


def test_leak_grows_every_step_and_healthy_does_not(traces):
    leak, healthy = _step_peaks(traces["leak"]), _step_peaks(traces["healthy"])
    print("leak", leak, "healthy", healthy)
    assert leak[0] < leak[1] < leak[2] and leak[2] - leak[1] > 100 << 20
    assert healthy[1] == healthy[2]


# ---- the user-facing API on real (small) tensors --------------------------------------------------------
USER_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
            self.head = nn.Linear(256, 8)

        def forward(self, x):
            return self.head(self.body(x))

    def model_fn():
        return Net()

    def batch_fn(step):
        return torch.randn(32, 64), torch.randint(0, 8, (32,))

    def optimizer_fn(params):
        return torch.optim.Adam(params)

    def loss_fn(output, targets):
        return nn.functional.cross_entropy(output, targets)
""")


def test_run_traces_a_users_step_with_labels(tmp_path):
    from analyzer.simulate import run

    namespace: dict = {}
    exec(USER_FILE, namespace)
    out = tmp_path / "user.pickle"
    simulation = run(namespace["model_fn"], namespace["batch_fn"], namespace["optimizer_fn"],
                     loss_fn=namespace["loss_fn"], gpu_memory=1 << 30, out=out, steps=2)
    assert simulation.oom is None
    truth = json.loads((tmp_path / "user.truth.json").read_text())
    labels = list(truth["allocations"].values())
    assert {"parameter", "gradient", "optimizer_state", "activation", "input"} <= {a["category"] for a in labels}
    assert {"body.0", "head"} <= {a["module"] for a in labels if a["category"] == "parameter"}
    entries = pickle.loads(out.read_bytes())["device_traces"][0]
    by_phase = {a["phase"]: bool(entries[int(i)]["frames"]) for i, a in truth["allocations"].items()}
    assert by_phase["forward"] and not by_phase["backward"]   # autograd's thread records no Python frames


def test_simulate_command_on_a_user_file(tmp_path, capsys):
    from analyzer.commands import main

    source = tmp_path / "train_fns.py"
    source.write_text(USER_FILE)
    out = tmp_path / "tiny.pickle"
    assert main(["simulate", str(source), "--gpu-memory", "1MiB", "-o", str(out), "--steps", "2"]) == 0
    assert "out of memory" in capsys.readouterr().out and not analyzer.load(out).ooms.empty
    assert main(["simulate", "--scenario", "no_such_thing"]) == 2


def test_analysing_a_simulated_file_never_imports_torch():
    code = ("import sys, analyzer, analyzer.simulate.replay; analyzer.load(sys.argv[1]).timeline; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(SIM / "leak.pickle")], check=True, cwd=ROOT)


def test_fixtures_are_what_the_generator_makes(tmp_path):
    from analyzer.simulate.scenarios import generate

    generate("capacity_oom", tmp_path / "capacity_oom.pickle")
    strip = lambda d: [{k: v for k, v in e.items() if k != "frames"} for e in d["device_traces"][0]]  # noqa: E731
    fresh = pickle.loads((tmp_path / "capacity_oom.pickle").read_bytes())
    assert strip(fresh) == strip(_raw("capacity_oom"))


def test_a_zero_optimizers_truth_keeps_parameters_and_finds_its_wrapped_state(tmp_path):
    """ShardedAdam (ZeRO-1, rank 0 of 4) holds views of the parameters and an Adam over them: the truth keeps the
    views parameters and counts the wrapped Adam's moments as optimizer state, a quarter of plain Adam's."""
    from analyzer.evaluate.estimator_fidelity import measure_simulated
    from analyzer.simulate.gpt import GPTConfig
    from analyzer.simulate.remedy_runs import REMEDY_RUNS, RemedySetup, simulate

    base = RemedySetup("d256 L2 s64 b2", GPTConfig(vocab=512, d_model=256, layers=2, heads=4, max_seq=64), 2, 64)
    truths = {}
    for variant, setup in [("as is", base), ("zero1", REMEDY_RUNS["zero1"](base))]:
        simulate(setup, tmp_path / f"{variant}.pickle")
        truths[variant] = measure_simulated(tmp_path / f"{variant}.pickle")[0]
    plain, zero1 = truths["as is"], truths["zero1"]
    assert zero1["parameter"] == plain["parameter"] > 0
    assert zero1["optimizer_state"] == pytest.approx(plain["optimizer_state"] / 4, rel=0.05)
