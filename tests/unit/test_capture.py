"""analyzer.recording and `analyze run`: real recordings on the CPU, and the CUDA calls checked at the torch boundary.

No GPU here: the CUDA path runs against recorders put in place of torch.cuda.is_available, the allocator's OOM
observer hook and torch.cuda.memory's history, snapshot and metadata functions, which assert the
exact calls, their arguments and their order.
"""
from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import analyzer
from analyzer.commands.run import child_command
from analyzer.ingest import load
from analyzer.recording import oom, phases, session
from analyzer.recording.modules import tag_modules
from analyzer.recording.session import MAX_OOM_DUMPS, Capture, CaptureWarning

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "scripts" / "capture_example.py"
REAL_RECORD = torch.cuda.memory._record_memory_history
BASE = 0x7F0000000000


def fake_snapshot() -> dict:
    """What `_snapshot()` returns on a GPU, reduced to one allocation inside one annotated phase."""
    frames = [{"filename": "train.py", "line": 3, "name": "forward"}]
    block = {"address": BASE, "size": 512, "requested_size": 500, "state": "active_allocated", "frames": frames}
    return {
        "segments": [{"device": 0, "address": BASE, "total_size": 2 << 20, "allocated_size": 512, "active_size": 512,
                      "requested_size": 500, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
                      "is_expandable": False, "frames": [], "blocks": [block]}],
        "device_traces": [[{"action": "alloc", "addr": BASE, "size": 500, "stream": 0, "time_us": 2,
                            "frames": frames}]],
        "external_annotations": [{"device": 0, "name": "phase::forward", "stage": "START", "time_us": 1},
                                 {"device": 0, "name": "phase::forward", "stage": "END", "time_us": 3}],
    }


class FakeCuda:
    """Recorders in place of the CUDA calls; `calls` keeps (name, args, kwargs) in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, signature: inspect.Signature) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.observers: list = []
        self.metadata: list[tuple[str, int]] = []
        record = self.recorder("record_memory_history")
        record.__signature__ = signature
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self.attach, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.recorder("snapshot", fake_snapshot))
        monkeypatch.setattr(torch.cuda.memory, "_set_memory_metadata",
                            lambda label: self.metadata.append((label, threading.get_ident())))
        monkeypatch.setattr(oom, "_OBSERVER_ATTACHED", False)

    def recorder(self, name: str, result=lambda: None):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return result()
        return call

    def attach(self, observer) -> None:
        self.calls.append(("attach_oom_observer", (observer,), {}))
        self.observers.append(observer)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return FakeCuda(monkeypatch, inspect.signature(REAL_RECORD))


SAFE_DEFAULTS = {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 100_000,
                 "global_record_annotations": True}


# ---- the CUDA path at the torch boundary ----------------------------------------------------------------
def test_records_with_safe_defaults_dumps_at_steps_and_at_exit(cuda: FakeCuda, tmp_path: Path) -> None:
    with analyzer.capture(tmp_path, dump_at_steps=(1, 3)) as cap:
        written = [cap.step() for _ in range(4)]
    assert cuda.calls[:2] == [("attach_oom_observer", (session._on_allocator_oom,), {}),
                              ("record_memory_history", (), SAFE_DEFAULTS)]
    assert cuda.names()[2:] == ["snapshot", "snapshot", "snapshot", "record_memory_history"]
    assert cuda.calls[-1] == ("record_memory_history", (), {"enabled": None})
    assert written == [tmp_path / "rank0_step1.pickle", None, tmp_path / "rank0_step3.pickle", None]
    assert cap.files == [tmp_path / "rank0_step1.pickle", tmp_path / "rank0_step3.pickle",
                         tmp_path / "rank0_step4_exit.pickle"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in cap.files)  # no partial files


def test_dumps_are_protocol_4_pickles_the_analyzer_reads(cuda: FakeCuda, tmp_path: Path) -> None:
    with Capture(tmp_path, dump_at_steps=()):
        pass
    path = tmp_path / "rank0_step0_exit.pickle"
    assert path.read_bytes()[:2] == b"\x80\x04"
    assert pickle.loads(path.read_bytes()) == fake_snapshot()
    trace = load(path)
    assert trace.annotations["name"].tolist() == ["phase::forward"]
    assert trace.allocations["requested_bytes"].tolist() == [500]


def test_rank_comes_from_torchrun_environment(cuda: FakeCuda, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "9")
    with Capture(tmp_path, dump_at_steps=(1,)) as cap:
        cap.step()
    assert [p.name for p in cap.files] == ["rank9_step1.pickle", "rank9_step1_exit.pickle"]


def test_older_torch_gets_only_the_options_it_has_and_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    def torch_2_1(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None):
        """The signature of torch 2.1's _record_memory_history."""
    fake = FakeCuda(monkeypatch, inspect.signature(torch_2_1))
    with pytest.warns(CaptureWarning, match="global_record_annotations"):
        with Capture(tmp_path, max_entries=5000, stacks="all", context="alloc"):
            pass
    assert fake.calls[1] == ("record_memory_history", (),
                             {"enabled": "all", "context": "alloc", "stacks": "all", "max_entries": 5000})


def test_torch_without_oom_observer_says_so(cuda: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_cuda_attach_out_of_memory_observer")
    with pytest.warns(CaptureWarning, match="no allocator OOM observer"):
        with Capture(tmp_path):
            pass
    assert "attach_oom_observer" not in cuda.names()


def _oom() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _wrapped_by_cause() -> None:
    raise RuntimeError("step failed") from _oom()


def _wrapped_by_context() -> None:
    try:
        raise _oom()
    except torch.cuda.OutOfMemoryError:
        raise ValueError("a framework re-raised something else while handling it")  # noqa: B904


@pytest.mark.parametrize("raise_error", [_wrapped_by_cause, _wrapped_by_context])
def test_wrapped_oom_is_dumped_before_history_is_switched_off_and_re_raised(cuda: FakeCuda, tmp_path: Path,
                                                                            raise_error) -> None:
    with pytest.raises((RuntimeError, ValueError)) as raised:
        with Capture(tmp_path, dump_at_steps=()) as cap:
            cap.step()
            raise_error()
    assert oom.find_oom(raised.value) is not None
    assert cuda.names()[2:] == ["snapshot", "record_memory_history"]  # dump first, then history off
    assert cuda.calls[-1][2] == {"enabled": None}
    assert cap.files == [tmp_path / "rank0_step1_oom1.pickle"]  # the OOM dump stands for the exit dump


def test_other_errors_get_the_exit_dump(cuda: FakeCuda, tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with Capture(tmp_path) as cap:
            raise KeyError("not memory")
    assert cap.files == [tmp_path / "rank0_step0_exit.pickle"]


def test_allocator_observer_dumps_while_history_is_on(cuda: FakeCuda, tmp_path: Path) -> None:
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with Capture(tmp_path) as cap:
            observer = cuda.observers[0]
            observer(0, 2 << 30, 80 << 30, 1 << 20)  # what the allocator does before raising
            assert cuda.names()[-1] == "snapshot"
            raise _oom()
    assert cuda.names()[2:] == ["snapshot", "record_memory_history"]  # not dumped a second time on the way out
    assert cap.files == [tmp_path / "rank0_step0_oom1.pickle"]


def test_a_swallowed_oom_is_still_dumped_and_dumps_are_bounded(cuda: FakeCuda, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    with Capture(tmp_path) as cap:
        for _ in range(MAX_OOM_DUMPS + 2):  # e.g. a batch-size finder catching OOMs and retrying
            cuda.observers[0](0, 2 << 30, 80 << 30, 1 << 20)
            cap.step()
    oom_files = [p.name for p in cap.files if "_oom" in p.name]
    assert oom_files == [f"rank0_step{k}_oom{k + 1}.pickle" for k in range(MAX_OOM_DUMPS)]
    assert "out of memory; snapshot written to" in capsys.readouterr().err


def test_observer_attached_once_per_process(cuda: FakeCuda, tmp_path: Path) -> None:
    for _ in range(2):
        with Capture(tmp_path):
            pass
    assert cuda.names().count("attach_oom_observer") == 1


def test_decorator_form(cuda: FakeCuda, tmp_path: Path) -> None:
    @analyzer.capture(tmp_path, dump_at_steps=())
    def train() -> str:
        return "done"

    assert train() == "done"
    assert (tmp_path / "rank0_step0_exit.pickle").exists()
    assert cuda.calls[-1] == ("record_memory_history", (), {"enabled": None})


def test_a_second_capture_joins_the_running_one(cuda: FakeCuda, tmp_path: Path) -> None:
    with Capture(tmp_path / "outer", dump_at_steps=(2,), count_optimizer_steps=True) as outer:
        with Capture(tmp_path / "inner", dump_at_steps=(1,)) as inner:
            inner.step()
            inner.step()
    assert outer.steps == 2 and outer._optimizer_hook is None
    assert [p.name for p in outer.files] == ["rank0_step2.pickle", "rank0_step2_exit.pickle"]
    assert not (tmp_path / "inner").exists()
    assert cuda.names().count("record_memory_history") == 2


def test_optimizer_steps_counted_when_asked(cuda: FakeCuda, tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with Capture(tmp_path, dump_at_steps=(2,), count_optimizer_steps=True) as cap:
        for _ in range(3):
            weight.sum().backward()
            optimizer.step()
    assert cap.steps == 3
    assert (tmp_path / "rank0_step2.pickle").exists()
    optimizer.step()
    assert cap.steps == 3  # the hook goes with the capture


# ---- module labels --------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(ids)).sum()


def test_tag_modules_sets_user_metadata_on_the_thread_that_runs_the_module(cuda: FakeCuda) -> None:
    model = Net()
    tags = tag_modules(model)
    loss = model(torch.tensor([1, 2, 3]))
    forward = [label for label, _ in cuda.metadata]
    assert forward == ["module::forward::", "module::forward::embed", "module::forward::", "module::forward::block",
                       "module::forward::block.0", "module::forward::block", "module::forward::block.1",
                       "module::forward::block", "module::forward::block.2", "module::forward::block",
                       "module::forward::", ""]
    cuda.metadata.clear()
    backward_thread = threading.Thread(target=loss.backward)  # as autograd's device threads run it on a GPU
    backward_thread.start()
    backward_thread.join()
    labels = [label for label, _ in cuda.metadata]
    assert {thread for _, thread in cuda.metadata} == {backward_thread.ident}
    assert labels[-1] == ""
    # the innermost module running: leaves in reverse order of the forward, the root before them; the in-place
    # ReLU's range closes as it opens (its input is its output), so its backward counts in `block`
    assert list(dict.fromkeys(labels)) == ["module::backward::", "module::backward::block.2",
                                           "module::backward::block.1", "module::backward::block",
                                           "module::backward::block.0", "module::backward::embed", ""]
    tags.remove()
    cuda.metadata.clear()
    model(torch.tensor([1]))
    assert cuda.metadata == []


def test_tag_modules_without_metadata_api_uses_annotations_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch.cuda.memory, "_set_memory_metadata")
    model = Net()
    tag_modules(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        model(torch.tensor([1, 2])).backward()
    names = {event.name for event in profiler.events()}
    assert {"module::forward::block.1", "module::backward::block.1", "module::backward::"} <= names


def test_phase_opens_a_profiler_range_and_an_nvtx_range(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list = []

    class FakeNvtx:
        @staticmethod
        def start_range(message: str):
            opened.append(("start", message))
            return (7, 7)

        @staticmethod
        def end_range(range_id) -> None:
            opened.append(("end", range_id))

    monkeypatch.setattr(phases, "_nvtx", lambda: FakeNvtx)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        with analyzer.phase("forward"):
            torch.ones(4).sum()
    assert opened == [("start", "phase::forward"), ("end", (7, 7))]
    assert "phase::forward" in {event.name for event in profiler.events()}


def test_missing_nvtx_is_said_once_and_phases_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` raises ImportError
    phases._nvtx.cache_clear()
    try:
        with pytest.warns(CaptureWarning, match="nvtx package is not installed"):
            with analyzer.phase("forward"), analyzer.phase("inner"):
                pass
    finally:
        phases._nvtx.cache_clear()


def test_find_oom_walks_causes_and_contexts() -> None:
    assert oom.find_oom(None) is None
    assert oom.find_oom(KeyError("x")) is None
    error = _oom()
    outer = RuntimeError("outer")
    outer.__context__ = ValueError("middle")
    outer.__context__.__cause__ = error
    assert oom.find_oom(outer) is error


# ---- real recordings on the CPU -------------------------------------------------------------------------
def _spans(trace, prefix: str) -> dict[str, list[tuple[int, int]]]:
    rows = trace.annotations[trace.annotations["name"].str.startswith(prefix)]
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, start, end in zip(rows["name"], rows["start_us"], rows["end_us"], strict=True):
        spans.setdefault(name, []).append((int(start), int(end)))
    return spans


def _inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(start <= span[0] and span[1] <= end for start, end in spans)


@pytest.fixture(scope="module")
def example_trace(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("example")
    done = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out), "--steps", "3"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "CUDA is not available: recording host (CPU) memory" in done.stderr
    return load(out / "rank0_trace.json.gz")


def test_example_records_phases_the_analyzer_reads(example_trace) -> None:
    phases = _spans(example_trace, "phase::")
    assert {name: len(spans) for name, spans in phases.items()} == {
        "phase::forward": 3, "phase::backward": 3, "phase::optimizer": 3}
    assert len(example_trace.allocations) > 0  # host memory events were recorded too


def test_example_records_module_ranges_inside_their_phase(example_trace) -> None:
    phases = _spans(example_trace, "phase::")
    modules = _spans(example_trace, "module::")
    for fqn in ("", "embed", "layers.0", "layers.1.mlp", "layers.1.mlp.0", "head"):
        for direction, phase in (("forward", "phase::forward"), ("backward", "phase::backward")):
            spans = modules[f"module::{direction}::{fqn}"]
            assert len(spans) == 3
            assert all(_inside(span, phases[phase]) for span in spans), (direction, fqn)
    for span in modules["module::forward::layers.1.mlp.0"]:  # forward ranges nest
        assert _inside(span, modules["module::forward::layers.1.mlp"])


def test_analyze_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "analyzer", "run", "--out", str(out), "--",
                           sys.executable, str(EXAMPLE), "--steps", "2"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"== analyze {out / 'rank0_trace.json.gz'}" in done.stdout
    assert (out / "rank0_trace.analysis.html").exists()
    assert not (tmp_path / "memory_capture").exists()  # the script's own capture joined analyze run's
    names = set(load(out / "rank0_trace.json.gz").annotations["name"])
    assert {"phase::forward", "module::backward::layers.0.mlp", "ProfilerStep#1"} <= names


def test_analyze_run_without_a_command_is_bad_input() -> None:
    done = subprocess.run([sys.executable, "-m", "analyzer", "run", "--"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("analyze: error: no command to run. "
                                   "Usage: analyze run [--out DIR] -- python train.py ARGS")


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "train.py", "--lr", "1"], ["python", "-m", "analyzer.recording.run", "train.py", "--lr", "1"]),
    (["python3.11", "-u", "-X", "dev", "train.py"],
     ["python3.11", "-u", "-X", "dev", "-m", "analyzer.recording.run", "train.py"]),
    (["/usr/bin/python", "-m", "pkg.train", "-m", "x"],
     ["/usr/bin/python", "-m", "analyzer.recording.run", "-m", "pkg.train", "-m", "x"]),
    (["python", "-c", "print(1)"], ["python", "-c", "print(1)"]),
    (["torchrun", "--nproc-per-node", "2", "train.py"], ["torchrun", "--nproc-per-node", "2", "train.py"]),
])
def test_child_command(command: list[str], expected: list[str]) -> None:
    assert child_command(command) == expected


def test_importing_analyzer_and_its_capture_helpers_does_not_import_torch() -> None:
    code = ("import sys, analyzer, analyzer.recording.run, analyzer.commands.run; "
            "analyzer.capture, analyzer.phase, analyzer.tag_modules; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_analyzer_capture_is_the_capture_class() -> None:
    assert analyzer.capture is analyzer.recording.capture is Capture
    assert isinstance(analyzer.capture("unused"), Capture)


def test_a_name_torch_left_unescaped_is_escaped_in_the_trace_we_write() -> None:
    """torch 2.13's Chrome trace export sometimes writes a Python frame's name with bare quotes (seen in this
    suite: `torch/profiler/_cupti_monitor.py(0):` followed by a docstring's three quotes), which makes the whole
    file invalid JSON; the trace the capture writes escapes them, and leaves every valid line as it was."""
    import json

    from analyzer.recording.session import _json_line

    broken = '    "name": "torch/profiler/_cupti_monitor.py(0):     """",\n'
    assert json.loads("{" + _json_line(broken).strip().rstrip(",") + "}")["name"] == \
        'torch/profiler/_cupti_monitor.py(0):     """'
    for valid in ('    "name": "a \\"quoted\\" word",\n', '    "name": "aten::mm",\n', '    "ph": "X",\n'):
        assert _json_line(valid) == valid
