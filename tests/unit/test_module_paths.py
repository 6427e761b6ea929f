"""Module call paths (issue 16): classes read from source files written to tmp_path, the longest-suffix lookup
of frames recorded elsewhere (--source-root), which frames are module levels, the order numbers of a repeated
block, the backward's mirror of the forward and the parameters' order, hostile file names, the module tree of
call paths, and the simulated fixtures scored by class."""
from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analyzer.attribute import attribute, module_paths
from analyzer.attribute.module_paths import MAX_SOURCE_BYTES, SEPARATOR, Level, SourceIndex, call_path, path_label
from analyzer.attribute.modules import call_path_labels, without_order
from analyzer.core.module_tree import module_label, module_tree
from analyzer.ingest.snapshot import snapshot_to_trace

SIM = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "sim"
MiB = 1 << 20

MODEL = '''\
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)  # @mlp.init
        self.proj = nn.Linear(4, 4)  # @mlp.init2

    def forward(self, x):
        h = self.fc(x)  # @mlp.fc
        return h * 2  # @mlp.out


class Block(nn.Module):
    def forward(self, x):
        x = x + 1  # @block.add
        return self.mlp(x)  # @block.mlp


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))  # @model.init

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)  # @model.loop
        return x

    def helper(self):
        return 1  # @model.helper


class Wide(MLP):
    def forward(self, x):
        return super().forward(x)  # @wide.super


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2  # @double.forward


class Trainer:
    def __init__(self):
        self.model = Model()  # @trainer.init
'''
LINEAR = '''\
class Linear(Module):
    def __init__(self, a, b):
        self.weight = Parameter(empty(a, b))  # @linear.init

    def forward(self, x):
        return linear(x, self.weight)  # @linear.forward
'''
CALL = ("/env/lib/python3.11/site-packages/torch/nn/modules/module.py", 1750, "_call_impl")
WRAPPED = ("/env/lib/python3.11/site-packages/torch/nn/modules/module.py", 1739, "_wrapped_call_impl")
MAIN = ("/home/lin/train.py", 20, "main")


def lines(text: str) -> dict[str, int]:
    """`# @name` marker -> its line number."""
    return {line.split("# @")[1]: i for i, line in enumerate(text.splitlines(), 1) if "# @" in line}


L, LL = lines(MODEL), lines(LINEAR)


@pytest.fixture(autouse=True)
def sources_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' frames name files written under tmp_path: the folder a user would name with --source-root
    (nothing is read without one)."""
    monkeypatch.setattr(module_paths, "default_index", lambda: SourceIndex([tmp_path]))


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return str(path)


def through(*frames: tuple[str, int, str]) -> list[tuple[str, int, str]]:
    """Innermost first, each forward called through torch's module plumbing, from train.py."""
    out: list[tuple[str, int, str]] = []
    for f in frames:
        out += [f, CALL, WRAPPED]
    return out + [MAIN]


def labels_of(frames, sources=None) -> list[str]:
    return [lv.label for lv in call_path(tuple(frames), sources)]


# ---- classes from the source ------------------------------------------------------------------------------------
def test_call_path_reads_classes_outermost_first(model):
    frames = through((model, L["mlp.fc"], "forward"), (model, L["block.mlp"], "forward"),
                     (model, L["model.loop"], "forward"))
    path = call_path(tuple(frames))
    assert [lv.label for lv in path] == ["Model", "Block", "MLP"]
    assert path_label(path) == f"Model{SEPARATOR}Block{SEPARATOR}MLP" == "Model \u203a Block \u203a MLP"
    assert [lv.line for lv in path] == [L["model.loop"], L["block.mlp"], L["mlp.fc"]]


def test_a_single_forward_frame_is_its_class(model):
    assert labels_of(through((model, L["mlp.fc"], "forward"))) == ["MLP"]


def test_a_level_whose_class_is_not_known_keeps_its_file_line(model):
    """No file here, or a file of another version (the line is not in a function called `forward`)."""
    missing = ("/elsewhere/missing.py", 12, "forward")
    other_version = (model, L["model.helper"], "forward")
    got = labels_of(through(missing, other_version, (model, L["model.loop"], "forward")))
    assert got == ["Model", f"{model}:{L['model.helper']} forward", "/elsewhere/missing.py:12 forward"]


def test_no_forward_frame_no_path(model):
    assert call_path(((model, L["model.helper"], "helper"), MAIN)) == ()
    assert call_path(()) == ()


# ---- which frames are module levels ------------------------------------------------------------------------------
def test_a_super_forward_call_is_the_callers_module(model):
    frames = through((model, L["mlp.fc"], "forward"))
    frames = [frames[0], (model, L["wide.super"], "forward"), *frames[1:]]   # Wide.forward -> super().forward
    assert labels_of(frames) == ["Wide"]


def test_autograd_functions_are_not_modules(model):
    static = [(model, L["double.forward"], "forward"),
              ("/env/site-packages/torch/autograd/function.py", 575, "apply"), *through((model, L["mlp.out"], "forward"))]
    assert labels_of(static) == ["MLP"]
    unreadable = [("/elsewhere/ops.py", 9, "forward"), ("/env/site-packages/torch/autograd/function.py", 575, "apply"),
                  *through((model, L["mlp.out"], "forward"))]
    assert labels_of(unreadable) == ["MLP"]
    functorch = [("/env/site-packages/torch/_functorch/aot_autograd.py", 1200, "forward"), *through((model, L["mlp.out"], "forward"))]
    assert labels_of(functorch) == ["MLP"]


def test_torch_nn_modules_are_levels_and_constructors_build_paths(model, tmp_path):
    site = tmp_path / "site"
    (site / "torch" / "nn" / "modules").mkdir(parents=True)
    (site / "torch" / "nn" / "modules" / "linear.py").write_text(LINEAR)
    sources = SourceIndex([site, tmp_path])
    recorded = "/opt/conda/lib/python3.10/site-packages/torch/nn/modules/linear.py"
    forward = through((recorded, LL["linear.forward"], "forward"), (model, L["mlp.fc"], "forward"))
    assert labels_of(forward, sources) == ["MLP", "Linear"]
    # a parameter made in Linear.__init__ inside MLP.__init__, inside Model.__init__ via ModuleList, from a Trainer
    init = [(recorded, LL["linear.init"], "__init__"), (model, L["mlp.init"], "__init__"),
            ("/opt/conda/lib/python3.10/site-packages/torch/nn/modules/container.py", 300, "__init__"),
            (model, L["model.init"], "<genexpr>"), (model, L["model.init"], "__init__"),
            (model, L["trainer.init"], "__init__"), MAIN]
    assert labels_of(init, sources) == ["Model", "MLP", "Linear"]     # not the Trainer, not the ModuleList
    # an unreadable constructor may be anything's: no level
    assert labels_of([("/elsewhere/x.py", 3, "__init__"), MAIN], sources) == []


# ---- finding a frame's file here -----------------------------------------------------------------------------------
def write(root: Path, relative: str, cls: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MODEL.replace("class MLP(", f"class {cls}("))
    return path


def test_source_root_longest_suffix_wins(tmp_path):
    short = write(tmp_path / "a", "pkg/model.py", "Short")
    long = write(tmp_path / "b", "proj/pkg/model.py", "Long")
    sources = SourceIndex([tmp_path / "a", tmp_path / "b"])
    recorded = "/home/lin/proj/pkg/model.py"
    assert sources.locate(recorded) == str(long)
    assert labels_of(through((recorded, L["mlp.fc"], "forward")), sources) == ["Long"]
    assert SourceIndex([tmp_path / "a"]).locate(recorded) == str(short)
    # a Windows path, and a relative one (Kineto's), find the same file
    assert sources.locate("C:\\Users\\lin\\proj\\pkg\\model.py") == str(long)
    assert sources.locate("pkg/model.py") in (str(short), str(long))
    assert sources.locate("/home/lin/../proj/pkg/model.py") is None    # no climbing out of a root


def test_one_component_is_enough_under_a_source_root(tmp_path):
    write(tmp_path / "root", "model.py", "Mine")
    assert SourceIndex([tmp_path / "root"]).locate("/x/y/model.py") == str(tmp_path / "root" / "model.py")
    write(tmp_path / "root", "y/model.py", "Lib")
    assert SourceIndex([tmp_path / "root"]).locate("/x/y/model.py") == str(tmp_path / "root" / "y" / "model.py")


def test_the_recorded_file_itself_comes_first_under_a_source_root(model, tmp_path):
    write(tmp_path / "root", Path(model).name, "Other")
    assert SourceIndex([tmp_path / "root", tmp_path]).locate(model) == model
    assert SourceIndex([tmp_path / "root"]).locate(model) == str(tmp_path / "root" / "model.py")


def test_nothing_is_read_without_a_source_root(model):
    """Results must not depend on the analysing machine: without --source-root neither the recorded file at its
    path here nor the environment's own copy of a library (numpy's, installed here) is read."""
    import numpy

    assert SourceIndex().locate(model) is None and SourceIndex().locate(numpy.__file__) is None
    frames = through((model, L["mlp.fc"], "forward"))
    assert labels_of(frames, SourceIndex()) == [f"{model}:{L['mlp.fc']} forward"]
    assert labels_of(frames, SourceIndex(["/"])) == ["MLP"]     # `--source-root /`: the recorded paths as they are here


# ---- hostile file names ---------------------------------------------------------------------------------------------
def test_fifo_device_huge_and_directory_paths_are_safe(tmp_path):
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    device = tmp_path / "zero.py"
    device.symlink_to("/dev/zero")
    huge = tmp_path / "huge.py"
    huge.write_bytes(b"class Huge:\n    def forward(self):\n        pass\n" + b"#" * (MAX_SOURCE_BYTES + 1))
    folder = tmp_path / "folder.py"
    folder.mkdir()
    binary = tmp_path / "binary.py"
    binary.write_bytes(bytes(range(256)) * 10)
    start = time.monotonic()
    for path in (fifo, device, huge, folder, binary):
        frame = (str(path), 2, "forward")
        for sources in (None, SourceIndex([tmp_path])):
            assert labels_of(through(frame), sources) == [f"{path}:2 forward"]
    assert time.monotonic() - start < 5


# ---- order numbers ----------------------------------------------------------------------------------------------------
def level(identity: str, line: int) -> Level:
    return Level(identity, identity, line, True)


def test_repeated_calls_from_one_line_are_numbered_by_order():
    """Three calls of Block from Model's loop line, each with two allocations (the MLP inside, then Block's own):
    the stacks repeat, the order tells the calls apart; within one call MLP is not repeated."""
    paths = [(level("Model", 7), level("Block", 3), level("MLP", 11)), (level("Model", 7), level("Block", 4))]
    stacks = np.asarray([0, 1] * 3 + [0])
    times = np.arange(7, dtype=np.float64)
    steps = np.asarray([1] * 6 + [2])
    got, numbered = call_path_labels(times, stacks, paths, steps)
    assert list(got) == ["Model › Block[0] › MLP", "Model › Block[0]", "Model › Block[1] › MLP", "Model › Block[1]",
                         "Model › Block[2] › MLP", "Model › Block[2]", "Model › Block[0] › MLP"]  # a new step: 0 again
    assert numbered.all()


def test_steps_that_run_the_same_stacks_make_the_same_calls_and_the_most_calls_of_any_step_number_all():
    """Steps 1, 2, 1 again (each a fresh run of calls), rows given newest first: the third step runs step 1's stacks
    and is labelled as it is; step 2 calls Block twice only in its third row, and is numbered because step 1 shows
    two calls of Block from that line."""
    paths = [(level("Model", 7), level("Block", 3)), (level("Model", 7), level("Block", 4))]
    first = [0, 0, 1, 0, 1]
    stacks = np.asarray(first + [0, 1, 0] + first)[::-1]
    steps = np.asarray([1] * 5 + [2] * 3 + [1] * 5)[::-1]
    times = np.arange(13, dtype=np.float64)[::-1]
    got, numbered = call_path_labels(times, stacks, paths, steps)
    once = ["Model › Block[0]"] * 3 + ["Model › Block[1]"] * 2
    assert list(got[::-1]) == once + ["Model › Block[0]", "Model › Block[0]", "Model › Block[1]"] + once
    assert numbered.all()


def test_a_run_without_steps_begins_its_calls_afresh_at_each_new_call_of_the_outermost_level():
    """A forward-only run (one step) of three passes of Model, each a new call (its line goes back from the head's
    9 to the loop's 7): the second repeats the first's stacks and is labelled as it is; the third runs Block three
    times, numbered 0-2, its third call continuing the same Model call (the line stays at 7, it does not go back)."""
    paths = [(level("Model", 7), level("Block", 3), level("MLP", 11)), (level("Model", 7), level("Block", 4)),
             (level("Model", 9), level("Head", 2))]
    passes = [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2], [0, 1, 0, 1, 0, 1, 2]]
    stacks = np.asarray([s for run in passes for s in run])
    got, numbered = call_path_labels(np.arange(len(stacks), dtype=np.float64), stacks, paths, np.ones(len(stacks), dtype=int))
    two = ["Model › Block[0] › MLP", "Model › Block[0]", "Model › Block[1] › MLP", "Model › Block[1]", "Model › Head"]
    assert list(got) == two + two + two[:4] + ["Model › Block[2] › MLP", "Model › Block[2]", "Model › Head"]
    assert list(numbered) == [True] * 4 + [False] + [True] * 4 + [False] + [True] * 6 + [False]


def test_a_loop_inside_a_call_numbers_the_child_not_the_parent():
    """Experts called in a loop from one line of one MoE call: the experts are numbered, the MoE is one call."""
    paths = [(level("MoE", 5), level("Expert", 2)), (level("MoE", 5), level("Expert", 3))]
    got, _ = call_path_labels(np.arange(4, dtype=np.float64), np.asarray([0, 1, 0, 1]), paths, np.ones(4, dtype=int))
    assert list(got) == ["MoE › Expert[0]", "MoE › Expert[0]", "MoE › Expert[1]", "MoE › Expert[1]"]


def test_calls_from_different_lines_are_different_children_not_numbered():
    paths = [(level("Model", 5), level("Block", 2)), (level("Model", 6), level("Block", 2))]
    got, numbered = call_path_labels(np.arange(2, dtype=np.float64), np.asarray([0, 1]), paths, np.ones(2, dtype=int))
    assert list(got) == ["Model › Block", "Model › Block"] and not numbered.any()


def test_untimed_allocations_are_not_numbered():
    paths = [(level("Model", 5), level("Block", 2))]
    got, numbered = call_path_labels(np.full(2, np.nan), np.asarray([0, -1]), paths, np.ones(2, dtype=int))
    assert list(got) == ["Model › Block", None] and not numbered.any()


def test_without_order():
    assert without_order("Model › Block[3] › MLP") == "Model › Block › MLP"
    assert without_order("/a/b.py:3 forward[2] › Linear") == "/a/b.py:3 forward › Linear"


# ---- end to end on a hand-made snapshot ------------------------------------------------------------------------------
def frame_dicts(frames) -> list[dict]:
    return [{"filename": f, "line": ln, "name": n} for f, ln, n in frames]


def recording(allocs: list[tuple[int | None, int | None, list, int]], annotations=()) -> pd.DataFrame:
    """Attribute (start tick or None, end tick or None, frames, size) allocations; rows in the order given."""
    base, events = 0x7F0000000000, []
    for i, (start, end, _, _) in enumerate(allocs):
        if start is not None:   # None: a block allocated before the recording began (no event of it)
            events.append((start, 0, "alloc", i))
        if end is not None:
            events += [(end, 1, "free_requested", i), (end, 2, "free_completed", i)]
    slot = 64 * MiB
    trace = [{"action": "segment_alloc", "addr": base, "size": len(allocs) * slot, "stream": 0, "time_us": 0,
              "frames": []}]
    trace += [{"action": action, "addr": base + i * slot, "size": allocs[i][3], "stream": 0, "time_us": 10 * t,
               "frames": frame_dicts(allocs[i][2])} for t, _, action, i in sorted(events)]
    blocks = [{"address": base + i * slot, "size": slot, "requested_size": size if end is None else 0,
               "state": "inactive" if end is not None else "active_allocated", "frames": frame_dicts(frames)}
              for i, (_, end, frames, size) in enumerate(allocs)]
    segment = {"device": 0, "address": base, "total_size": len(allocs) * slot, "stream": 0, "segment_type": "large",
               "blocks": blocks}
    marks = [{"device": 0, "name": name, "stage": stage, "time_us": 10 * t + (-5 if stage == "START" else 5)}
             for name, start, end in annotations for stage, t in (("START", start), ("END", end))]
    snapshot = {"segments": [segment], "device_traces": [trace],
                "external_annotations": sorted(marks, key=lambda m: m["time_us"])}
    trace = attribute(snapshot_to_trace(snapshot, "hand-made"), source_roots=module_paths.default_index().roots)
    return trace.allocations.sort_values("addr").reset_index(drop=True)


def test_repeated_blocks_end_to_end_with_a_lower_confidence(model):
    block = through((model, L["block.add"], "forward"), (model, L["model.loop"], "forward"))
    mlp = through((model, L["mlp.fc"], "forward"), (model, L["block.mlp"], "forward"), (model, L["model.loop"], "forward"))
    allocs = [(1 + 2 * i + j, 20, stack, MiB) for i in range(3) for j, stack in enumerate((block, mlp))]
    got = recording(allocs + [(30, None, [MAIN], MiB)])
    assert list(got["module"][:6].astype(str)) == [f"Model › Block[{i}]{tail}" for i in range(3) for tail in ("", " › MLP")]
    assert got["label_source"][:6].astype(str).str.endswith("module=frames:call-path+order").all()
    assert (got["confidence"][:6] == 0.75).all()


def test_a_frameless_backward_allocation_takes_the_module_of_the_forward_tensor_it_mirrors(model):
    """Forward tensors of two modules, kept for backward; in backward (no Python frames, autograd's thread) a
    gradient is made just before the tensor of its size is released."""
    mlp = through((model, L["mlp.fc"], "forward"))
    block = through((model, L["block.add"], "forward"))
    autograd = [("/env/site-packages/torch/autograd/graph.py", 800, "_engine_run_backward"),
                ("/env/site-packages/torch/_tensor.py", 600, "backward"), MAIN]
    got = recording([
        (1, 12, block, 2 * MiB), (2, 9, mlp, 3 * MiB), (3, 4, mlp, 5 * MiB),  # forward (the last a temporary)
        (6, None, autograd, 4 * MiB),                                     # the loss's gradient seed, main thread
        (8, 10, [], 3 * MiB), (11, 13, [], 2 * MiB), (11, 13, [], 7 * MiB)])
    assert list(got["module"].astype(str)) == ["Block", "MLP", "MLP", "unattributed", "MLP", "Block", "unattributed"]
    assert got["label_source"][4].endswith("module=size-match:forward-release")


def test_optimizer_state_follows_the_parameters_order(model, tmp_path):
    """Three MLPs' parameters (two Linears each) of one size, made in order by their constructors; Adam's two
    moments per parameter, made in the same order, take each parameter's MLP. Without the order they would only
    say some MLP (the shared path)."""
    site = tmp_path / "site"
    (site / "torch" / "nn" / "modules").mkdir(parents=True)
    (site / "torch" / "nn" / "modules" / "linear.py").write_text(LINEAR)
    # the file as recorded is found under the source root given to the analysis: here, the recording's own path
    linear = str(site / "torch" / "nn" / "modules" / "linear.py")
    params = [[(linear, LL["linear.init"], "__init__"), (model, L[at], "__init__"), (model, L["model.init"], "__init__"),
               MAIN] for _ in range(3) for at in ("mlp.init", "mlp.init2")]
    forward = through((model, L["mlp.fc"], "forward"))
    optimizer = [("/env/site-packages/torch/optim/adam.py", 111, "_init_group"),
                 ("/env/site-packages/torch/optim/adam.py", 157, "step"), MAIN]
    allocs = [(1 + i, None, p, MiB) for i, p in enumerate(params)] + [(8, 9, forward, 8 * MiB)]
    allocs += [(11 + i, None, optimizer, MiB) for i in range(12)]
    got = recording(allocs, [("Optimizer.step#Adam.step", 11, 22)])
    assert list(got["category"][:6].astype(str)) == ["parameter"] * 6
    assert list(got["module"][:6].astype(str)) == [f"Model › MLP[{i // 2}] › Linear" for i in range(6)]
    states = got.iloc[7:]
    assert list(states["category"].astype(str)) == ["optimizer_state"] * 12
    assert list(states["module"].astype(str)) == [f"Model › MLP[{i // 4}] › Linear" for i in range(12)]
    assert states["label_source"].astype(str).str.endswith("module=size-match:parameter-order").all()


# ---- the module tree --------------------------------------------------------------------------------------------------
def test_call_paths_nest_by_level_in_the_module_tree():
    live = pd.DataFrame({"module": ["Model › Block[0] › MLP", "Model › Block[0]", "Model › Block[1] › MLP",
                                    "layers.0.attn", "layers.1.attn", "/very/long/path/to/train.py:12 forward › Linear"],
                         "allocated_bytes": [4, 2, 4, 3, 3, 1]})
    roots = {n.label: n for n in module_tree(live, min_share=0)}
    model = roots["Model"]
    assert model.bytes == 10 and model.path == "Model"
    kids = {n.label: n for n in model.children}
    assert kids["Block[0]"].path == "Model › Block[0]" and kids["Block[0]"].bytes == 6
    assert kids["Block[1] › MLP"].path == "Model › Block[1] › MLP"       # a chain reads as one name
    assert {n.label for n in kids["Block[0]"].children} == {"MLP", "(own allocations)"}
    assert roots["layers"].children[0].label == "0.attn"
    assert "…/path/to/train.py:12 forward › Linear" in roots


def test_module_label_shortens_each_level():
    assert module_label("/very/long/path/to/train.py:12 forward › Linear[2]") == "…/path/to/train.py:12 forward › Linear[2]"
    assert module_label("encoder.layers.3") == "encoder.layers.3" and module_label("LlamaMLP") == "LlamaMLP"


# ---- the simulated fixtures, by class ---------------------------------------------------------------------------------
MODULE_CLASS_WITHOUT_TAGS = 0.95   # 100% of the peak's bytes on every fixture today


@pytest.mark.parametrize("name", sorted(p.stem for p in SIM.glob("*.pickle")))
def test_simulated_fixtures_get_the_right_module_class_without_tags(name):
    pytest.importorskip("torch")
    from analyzer.evaluate.accuracy import simulator_sources
    from analyzer.evaluate.module_classes import module_class_agreement, simulator_classes

    scores = module_class_agreement(SIM / f"{name}.pickle", simulator_classes(),
                                    source_roots=simulator_sources())
    assert scores["module_class"] >= MODULE_CLASS_WITHOUT_TAGS, scores


# ---- the command line ---------------------------------------------------------------------------------------------------
def test_source_root_option_reads_classes_of_frames_recorded_elsewhere(tmp_path, capsys):
    from analyzer.commands import main

    write(tmp_path / "checkout", "proj/model.py", "Remote")
    recorded = "/home/someone/proj/model.py"
    stack = frame_dicts(through((recorded, L["mlp.fc"], "forward")))
    base = 0x7F0000000000
    snapshot = {"segments": [{"device": 0, "address": base, "total_size": 2 * MiB, "stream": 0, "segment_type": "large",
                              "blocks": [{"address": base, "size": 2 * MiB, "requested_size": 2 * MiB,
                                          "state": "active_allocated", "frames": stack}]}],
                "device_traces": [[{"action": "alloc", "addr": base, "size": 2 * MiB, "stream": 0, "time_us": 10,
                                    "frames": stack}]]}
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))

    def modules(*extra: str) -> list[str]:
        assert main([str(path), "--format", "json", *extra]) == 0
        return list(json.loads(capsys.readouterr().out)["devices"][0]["peak"]["by_module"])

    assert modules() == [f"{recorded}:{L['mlp.fc']} forward"]
    assert modules("--source-root", str(tmp_path / "checkout")) == ["Remote"]


COMPILED = [("/tmp/torchinductor_lin/ab/cabc123.py", 40, "call"),
            ("/env/site-packages/torch/_inductor/output_code.py", 460, "__call__"), CALL, WRAPPED, MAIN]


def test_a_compiled_graph_takes_the_recordings_one_root_module(model):
    """Dynamo runs the graph in place of Model.forward: no level is left, but every call path of the recording
    starts with Model (its layers were built and run eagerly before the model was compiled)."""
    eager = through((model, L["block.add"], "forward"), (model, L["model.loop"], "forward"))
    got = recording([(1, None, eager, MiB), (2, 3, COMPILED, 2 * MiB)])
    assert list(got["module"].astype(str)) == ["Model › Block", "Model"]
    assert got["label_source"][1].endswith("module=structure:compiled-root")
    assert got["confidence"][1] == pytest.approx(0.6)


def test_a_compiled_graph_stays_unattributed_when_the_recording_has_two_roots(model):
    mlp_alone = through((model, L["mlp.fc"], "forward"))
    eager = through((model, L["block.add"], "forward"), (model, L["model.loop"], "forward"))
    got = recording([(1, None, eager, MiB), (2, None, mlp_alone, MiB), (3, 4, COMPILED, 2 * MiB)])
    assert list(got["module"].astype(str)) == ["Model › Block", "MLP", "unattributed"]


def test_a_file_of_another_version_is_not_read_at_all(model):
    """One frame of the file whose line is not in a function of its recorded name: the local copy is another
    version, and its other lines (which may fall in another class's forward) are not read either; a recording
    whose every frame agrees with the file reads its classes."""
    agreeing = through((model, L["mlp.fc"], "forward"), (model, L["block.mlp"], "forward"))
    sources = SourceIndex([Path(model).parent])
    sources.check(agreeing)
    assert labels_of(agreeing, sources) == ["Block", "MLP"]
    other = SourceIndex([Path(model).parent])
    other.check([*agreeing, (model, L["model.helper"], "forward")])
    assert labels_of(agreeing, other) == [f"{model}:{L['block.mlp']} forward", f"{model}:{L['mlp.fc']} forward"]


def test_one_agreeing_line_is_enough_under_a_source_root(tmp_path):
    (tmp_path / "site" / "pkg").mkdir(parents=True)
    (tmp_path / "site" / "pkg" / "model.py").write_text(MODEL)
    one = through(("/remote/env/site-packages/pkg/model.py", L["mlp.fc"], "forward"))
    rooted = SourceIndex([tmp_path / "site"])
    rooted.check(one)
    assert labels_of(one, rooted) == ["MLP"]


def test_a_folder_beside_a_source_root_is_not_under_it(tmp_path):
    """`--source-root /x/site` does not vouch for a copy found in `/x/site-packages` (a name that begins alike)."""
    (tmp_path / "site-packages" / "pkg").mkdir(parents=True)
    (tmp_path / "site-packages" / "pkg" / "model.py").write_text(MODEL)
    recorded = str(tmp_path / "site-packages" / "pkg" / "model.py")
    one = through((recorded, L["mlp.fc"], "forward"))
    sources = SourceIndex([tmp_path / "site"])
    sources.check(one)
    assert labels_of(one, sources) == [f"{recorded}:{L['mlp.fc']} forward"]


# ---- what the frames say when no module's call path does (issue 16) --------------------------------------------------
TOP = ("/home/lin/train.py", 60, "<module>")
MODULE_PY = "/env/site-packages/torch/nn/modules/module.py"


@pytest.mark.parametrize("stack, outside", [
    ([("/home/lin/train.py", 31, "loss_fn"), ("/home/lin/train.py", 50, "main"), TOP], True),
    ([("??", 0, "at::native::empty_cuda"), ("Objects/call.c", 0, "_PyObject_Call"), ("/home/lin/train.py", 50, "main"), TOP],
     True),                                                                 # stacks="all": C++ frames between
    ([("/env/site-packages/torch/optim/adam.py", 400, "_single_tensor_adam"), ("/home/lin/train.py", 55, "main"), TOP],
     True),                                                                 # an optimizer's temporaries
    ([("/home/lin/model.py", 12, "forward"), (MODULE_PY, 1750, "_call_impl"), TOP], False),
    ([("/home/lin/hooks.py", 5, "pre_hook"), (MODULE_PY, 1790, "_call_impl"), TOP], False),   # a module's hook
    ([("/home/lin/train.py", 31, "loss_fn"), ("/home/lin/train.py", 50, "main")], False),     # not up to the top
    ([("/env/site-packages/torch/_tensor.py", 600, "backward"), ("/home/lin/train.py", 52, "main"), TOP], False),
    ([("/home/lin/data.py", 9, "__init__"), TOP], False),                    # a constructor: maybe a module's
    ([("/tmp/torchinductor_lin/ab/cab.py", 88, "call"), TOP], False),        # a compiled graph runs a module
    ([("??", 0, "at::native::empty_cuda")], False),                          # no Python frames: nothing shown
])
def test_a_stack_shows_no_module_ran_only_when_it_reaches_the_top_without_one(stack, outside):
    from analyzer.attribute.frames import ran_no_module
    assert ran_no_module(tuple(stack)) is outside


@pytest.mark.parametrize("stack, moved", [
    ([(MODULE_PY, 1357, "convert"), (MODULE_PY, 957, "_apply"), (MODULE_PY, 930, "_apply"), (MODULE_PY, 1371, "to"),
      ("/env/site-packages/transformers/modeling_utils.py", 4343, "to"), ("/home/lin/client.py", 176, "reset_model"), TOP],
     "/home/lin/client.py:176 reset_model (Module.to)"),                    # transformers' `to` wrapper skipped
    ([(MODULE_PY, 1050, "<lambda>"), (MODULE_PY, 927, "_apply"), (MODULE_PY, 1050, "cuda"),
      ("/home/lin/entrance.py", 67, "compress_model"), TOP], "/home/lin/entrance.py:67 compress_model (Module.cuda)"),
    ([("/home/lin/train.py", 40, "main"), TOP], None),                       # a tensor's own .to(): no _apply
    ([(MODULE_PY, 957, "_apply"), (MODULE_PY, 1371, "to")], None),           # no user code called it
])
def test_a_parameter_copied_by_module_to_is_named_by_the_line_that_moved_its_model(stack, moved):
    from analyzer.attribute.frames import moved_model
    assert moved_model(tuple(stack)) == moved


def test_no_module_and_moved_model_end_to_end(model):
    """A model's parameters moved by `.to()`, its forward, the loss the script computes on the output, and a
    backward: the loss is made outside every module and the parameters are the moved model's; what runs under
    `loss.backward()` or shows no frame stays unattributed (the borrowing by optimizer state is tested on
    zidongliu's real snapshot)."""
    moving = [(MODULE_PY, 1357, "convert"), (MODULE_PY, 957, "_apply"), (MODULE_PY, 1371, "to"),
              ("/home/lin/train.py", 12, "main"), TOP]
    forward = through((model, L["mlp.fc"], "forward"))
    loss = [("/home/lin/train.py", 31, "loss_fn"), ("/home/lin/train.py", 50, "main"), TOP]
    autograd = [("/env/site-packages/torch/autograd/graph.py", 800, "_engine_run_backward"),
                ("/env/site-packages/torch/_tensor.py", 600, "backward"), ("/home/lin/train.py", 51, "main"), TOP]
    got = recording([(1, None, moving, 3 * MiB), (2, None, moving, 5 * MiB),      # parameters
                     (4, 9, forward + [TOP], 2 * MiB), (5, 7, loss, 7 * MiB),       # forward, the loss's temporary
                     (8, None, autograd, 6 * MiB), (10, None, [], 3 * MiB)])        # backward, main thread and not
    moved = "/home/lin/train.py:12 main (Module.to)"
    assert list(got["category"].astype(str))[:2] == ["parameter", "parameter"]
    assert list(got["module"].astype(str))[:2] == [moved, moved]
    assert got["label_source"][0].endswith("module=frames:module.to")
    assert got["module"][3] == "(no module)" and got["category"][3] in ("temporary", "activation")
    assert got["label_source"][3].endswith("module=frames:no-module")
    assert got["module"][4] == "unattributed"                                   # under loss.backward(): a backward
    assert got["module"][5] == "unattributed"                                   # no frames, no forward tensor its size


@pytest.mark.parametrize("stack, built", [
    ([("/src/flexgen/pytorch_backend.py", 190, "allocate"), ("/src/flexgen/flex_opt.py", 125, "init_weight_list"),
      ("/src/flexgen/flex_opt.py", 171, "init_weight"), ("/src/flexgen/flex_opt.py", 813, "init_all_weights"),
      ("/src/flexgen/flex_opt.py", 650, "__init__"), ("/src/flexgen/flex_opt.py", 1231, "run_flexgen"), TOP],
     "/src/flexgen/flex_opt.py:1231 run_flexgen (__init__)"),               # the outermost constructor's caller
    ([("/env/site-packages/transformers/modeling_utils.py", 4000, "_load_pretrained_model"),
      ("/env/site-packages/transformers/modeling_utils.py", 3900, "from_pretrained"), ("/home/lin/train.py", 9, "main"),
      TOP], "/home/lin/train.py:9 main (from_pretrained)"),
    ([("/env/site-packages/torch/nn/modules/linear.py", 99, "__init__"), TOP], None),   # torch's: a call-path level
    ([("/home/lin/train.py", 40, "main"), TOP], None),                       # nothing built it
])
def test_a_parameter_a_constructor_made_is_named_by_the_line_that_built_its_model(stack, built):
    from analyzer.attribute.frames import built_model
    assert built_model(tuple(stack)) == built


def test_model_sites_end_to_end(model):
    """A parameter made by an unreadable constructor is the model its line built; one `.to()` copied is the moved
    model's, named by the line that called `.to()` (here inside a trainer's constructor)."""
    built = [("/home/lin/net.py", 14, "__init__"), ("/home/lin/train.py", 8, "main"), TOP]
    moving = [(MODULE_PY, 1357, "convert"), (MODULE_PY, 957, "_apply"), (MODULE_PY, 1371, "to"),
              ("/home/lin/trainer.py", 30, "__init__"), ("/home/lin/train.py", 9, "main"), TOP]
    forward = through((model, L["mlp.fc"], "forward")) + [TOP]
    got = recording([(1, None, built, 3 * MiB), (2, None, moving, 5 * MiB), (4, 5, forward, 2 * MiB)])
    assert list(got["category"].astype(str)[:2]) == ["parameter", "parameter"]
    assert got["module"][0] == "/home/lin/train.py:8 main (__init__)"
    assert got["label_source"][0].endswith("module=frames:model-construction")
    assert got["module"][1] == "/home/lin/trainer.py:30 __init__ (Module.to)"     # the line that called .to()


@pytest.mark.parametrize("forward_file, model_label", [(None, "Model"), ("/home/lin/net.py", "/home/lin/net.py (model)")])
def test_a_parameter_from_before_the_recording_is_the_one_model_the_recording_ran(model, forward_file, model_label):
    """Blocks alive since before the recording, kept to its end, with no frames: parameters (structure). Every
    call path of the forward starts with one root: they are that model's, by its class where it is read, else by
    its file; which of its modules, nothing says."""
    root = (forward_file, 8, "forward") if forward_file else (model, L["model.loop"], "forward")
    block = (forward_file, 30, "forward") if forward_file else (model, L["block.add"], "forward")
    forward = through(block, root) + [TOP]
    got = recording([(None, None, [], 3 * MiB), (None, None, [], 5 * MiB), (1, 2, forward, 2 * MiB),
                     (3, 4, through(root) + [TOP], 2 * MiB)])
    assert list(got["category"].astype(str)[:2]) == ["parameter", "parameter"]
    assert list(got["module"].astype(str)[:2]) == [model_label, model_label]
    assert got["label_source"][0].endswith("module=structure:sole-model")   # a structural guess, said as one


@pytest.mark.parametrize("case", ["two roots", "framed parameter", "a moved model"])
def test_a_parameter_from_before_the_recording_stays_unattributed_without_one_model(model, case):
    """Two roots (an MLP called outside the model: which one owns the block?), a parameter whose frames name no
    model (the script made it), or another model the frames name (moved by a line): no sole model to give."""
    forward = through((model, L["block.add"], "forward"), (model, L["model.loop"], "forward")) + [TOP]
    allocs = [(None, None, [], 3 * MiB), (1, 2, forward, 2 * MiB)]
    if case == "two roots":
        allocs.append((3, 4, through((model, L["mlp.fc"], "forward")) + [TOP], 2 * MiB))
    elif case == "framed parameter":
        allocs[0] = (None, None, [("/home/lin/train.py", 40, "main"), TOP], 3 * MiB)
    else:
        moving = [(MODULE_PY, 1357, "convert"), (MODULE_PY, 957, "_apply"), (MODULE_PY, 1371, "to"),
                  ("/home/lin/train.py", 12, "main"), TOP]
        allocs.insert(1, (None, None, moving, 5 * MiB))
    got = recording(allocs)
    assert got["category"][0] == "parameter"
    assert got["module"][0] == "unattributed"


@pytest.mark.parametrize("parameter_of_its_size, owner", [(False, "(no module)"), (True, "Model › MLP")])
def test_an_optimised_input_owns_the_state_of_its_size_only_where_no_parameter_has_it(parameter_of_its_size, owner):
    """`Adam([x_prime])` on an input made outside every module: its moments (6 MiB, no parameter of that size)
    are as much outside every module as it is; where a parameter has the size, the parameter owns them."""
    from analyzer.attribute.modules import _match_parameters
    from analyzer.core.vocabulary import Category

    sizes = [4 * MiB, 6 * MiB if parameter_of_its_size else 5 * MiB, 6 * MiB, 6 * MiB, 6 * MiB]
    a = pd.DataFrame({"requested_bytes": sizes, "t_free_us": pd.array([None] * 5, dtype="Int64")})
    category = np.asarray([Category.PARAMETER, Category.PARAMETER, Category.INPUT, Category.OPTIMIZER_STATE,
                           Category.OPTIMIZER_STATE], dtype=object)
    module = np.asarray(["Model › MLP", "Model › MLP", "(no module)", None, None], dtype=object)
    source = np.full(5, None, dtype=object)
    _match_parameters(a, module, source, category, exact=True)
    assert list(module[3:]) == [owner, owner] and list(source[3:]) == ["size-match:parameter"] * 2
