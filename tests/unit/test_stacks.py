"""The allocating site and the op of a stack (analyzer.core.stacks), on hand-made frames shaped like real ones:
snapshots recorded with stacks="all" interleave C++ frames ('??', '', 'Foo.cpp', 'thread48.o', the interpreter's
own .c files) with the CPython frames; only a Python frame of the user's code is a site."""
from __future__ import annotations

import time

import pytest

from analyzer.core.stacks import Frame, is_python_frame, is_user_frame, stack_op, top_user_frame
from analyzer.ingest.snapshot import snapshot_to_trace

UNWIND = [("??", 0, "torch::unwind::unwind()"), ("??", 0, "torch::CapturedTraceback::gather(bool, bool, bool)"),
          ("memory_snapshot.cpp", 0, "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
          ("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc("
                                          "signed char, unsigned long, CUstream_st*)"),
          ("", 0, "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)")]
EXP = [("??", 0, "at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)"),
       ("RegisterCUDA.cpp", 0, "at::(anonymous namespace)::wrapper_CUDA_exp(at::Tensor const&)"),
       ("??", 0, "at::_ops::exp::redispatch(c10::DispatchKeySet, at::Tensor const&)"),
       ("VariableType_2.cpp", 0, "torch::autograd::VariableType::(anonymous namespace)::exp(c10::DispatchKeySet, "
                                 "at::Tensor const&)"),
       ("??", 0, "at::_ops::exp::call(at::Tensor const&)"),
       ("python_torch_functions_2.cpp", 0, "torch::autograd::THPVariable_exp(_object*, _object*, _object*)")]
CPYTHON = [("/usr/local/src/conda/python-3.12.3/Objects/methodobject.c", 537, "cfunction_call"),
           ("/usr/local/src/conda/python-3.12.3/Objects/call.c", 240, "_PyObject_MakeTpCall"),
           ("/usr/local/src/conda/python-3.12.3/Objects/descrobject.c", 365, "method_vectorcall_VARARGS_KEYWORDS")]
SITE_PACKAGES = "/root/a2/.venv/lib/python3.12/site-packages"
SOFTMAX = ("/root/a2/cs336_systems/modules/softmax.py", 14, "forward")
CALLERS = [("/croot/python-split_1715024085344/work/build-static/Python/bytecodes.c", 2706, "_PyEval_EvalFrameDefault"),
           (f"{SITE_PACKAGES}/torch/nn/modules/module.py", 1750, "_call_impl"),
           ("/root/a2/cs336_systems/benchmark.py", 108, "run_benchmark"), ("??", 0, "__libc_start_main"),
           ("??", 0, "_start")]
ENGINE = [("??", 0, "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
                    "torch::autograd::Node*, torch::autograd::InputBuffer&)"),
          ("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
          ("thread48.o", 0, "execute_native_thread_routine"), ("??", 0, "clone")]


def stack(*parts: list[Frame] | Frame) -> tuple[Frame, ...]:
    return tuple(f for part in parts for f in (part if isinstance(part, list) else [part]))


# ---- the site ------------------------------------------------------------------------------------------------
def test_c_frames_innermost_and_a_python_frame_further_out_give_the_python_frame():
    frames = stack(UNWIND, EXP, CPYTHON, SOFTMAX, CALLERS)
    assert top_user_frame(frames) == "/root/a2/cs336_systems/modules/softmax.py:14 forward"


def test_a_stack_of_c_frames_only_has_no_site_but_names_its_op():
    frames = stack(UNWIND, EXP[:2], ("??", 0, "at::_ops::sum_dim_IntList::call(at::Tensor const&)"), ENGINE)
    assert top_user_frame(frames) is None
    assert stack_op(frames) == "aten::sum_dim_IntList"


@pytest.mark.parametrize("frame", [("??", 0, "x"), ("", 0, "at::native::mm(...)"), ("Foo.cpp", 0, "f"),
                                   ("x.c", 12, "f"), ("thread48.o", 0, "execute_native_thread_routine"),
                                   ("./nptl/pthread_create.c", 442, "start_thread"), ("eval_frame.c", 0, "shim"),
                                   ("kernel.cu", 3, "k"), ("<built-in>", 0, "<built-in method einsum>")])
def test_c_frames_are_neither_python_nor_user_frames(frame):
    assert not is_python_frame(frame) and not is_user_frame(frame)


@pytest.mark.parametrize("filename", ["<ipython-input-3-8f2c1d>", "/tmp/ipykernel_137282/1784485557.py", "<stdin>",
                                      "train.py", "C:\\research\\DeComFL\\cezo_fl\\adam_forward.py",
                                      f"{SITE_PACKAGES}/transformers/models/qwen3/modeling_qwen3.py",
                                      f"{SITE_PACKAGES}/einops/_backends.py", "/mnt/mcx/select_n/lib/select_n.py",
                                      "D:\\Dev\\a2\\.venv\\Lib\\site-packages\\einops\\_backends.py"])
def test_user_code_notebook_cells_and_libraries_are_user_frames(filename):
    assert is_python_frame((filename, 1, "f")) and is_user_frame((filename, 1, "f"))


@pytest.mark.parametrize("filename", [f"{SITE_PACKAGES}/torch/nn/modules/module.py", "torch/nn/modules/module.py",
                                      f"{SITE_PACKAGES}/triton/testing.py", f"{SITE_PACKAGES}/functorch/__init__.py",
                                      "/tmp/torchinductor_kait/kb/ckbfydn2m64lvgma55.py",
                                      "/usr/lib/python3.10/threading.py", "/opt/conda/lib/python3.11/copy.py",
                                      "C:\\Users\\Z\\AppData\\Roaming\\uv\\python\\cpython-3.10.19-windows-x86_64-none"
                                      "\\lib\\copy.py", "C:\\Python310\\Lib\\contextlib.py",
                                      "<eval_with_key>.7", "<string>", "<frozen importlib._bootstrap>"])
def test_torch_generated_code_and_the_stdlib_are_python_but_not_user_frames(filename):
    assert is_python_frame((filename, 1, "f")) and not is_user_frame((filename, 1, "f"))


def test_torch_and_stdlib_frames_are_passed_over_for_the_callers_line():
    frames = stack(UNWIND, (f"{SITE_PACKAGES}/torch/functional.py", 407, "einsum"),
                   ("/opt/conda/lib/python3.12/copy.py", 153, "deepcopy"), CPYTHON, SOFTMAX)
    assert top_user_frame(frames) == "/root/a2/cs336_systems/modules/softmax.py:14 forward"


def test_compiled_code_gives_the_source_line_it_was_compiled_from():
    """Inductor's generated `call` is torch's; the frames recorded outside it name the user's source lines."""
    frames = stack(UNWIND[:3], ("guards.cpp", 0, "torch::dynamo::_empty_strided_device(_object*, _object*)"),
                   ("/tmp/torchinductor_kait/kb/ckbfydn2.py", 4214, "call"),
                   ("/home/k/cs336_basics/transformer.py", 142, "softmax"),
                   ("/home/k/cs336_basics/transformer.py", 153, "scaled_dot_product_attention"))
    assert top_user_frame(frames) == "/home/k/cs336_basics/transformer.py:142 softmax"


def test_a_stack_of_torch_frames_only_has_no_site():
    assert top_user_frame(stack(UNWIND, (f"{SITE_PACKAGES}/torch/cuda/memory.py", 218, "empty_cache"))) is None
    assert top_user_frame(()) is None


# ---- the op --------------------------------------------------------------------------------------------------
def test_op_is_the_innermost_aten_operator():
    assert stack_op(stack(UNWIND, EXP, CPYTHON, SOFTMAX)) == "aten::exp"


def test_op_passes_over_the_empty_that_allocates_another_ops_output():
    """`aten::empty_strided` inside `_to_copy` (an autocast cast) is the copy's output."""
    frames = stack(UNWIND, ("??", 0, "at::native::empty_strided_cuda(c10::ArrayRef<long>, c10::ArrayRef<long>)"),
                   ("??", 0, "at::_ops::empty_strided::call(c10::ArrayRef<c10::SymInt>, c10::ArrayRef<c10::SymInt>)"),
                   ("??", 0, "at::native::_to_copy(at::Tensor const&, std::optional<c10::ScalarType>)"),
                   ("??", 0, "at::_ops::_to_copy::call(at::Tensor const&, std::optional<c10::ScalarType>)"),
                   ("??", 0, "at::_ops::einsum::call(std::basic_string_view<char>, c10::ArrayRef<at::Tensor>)"),
                   CPYTHON, SOFTMAX)
    assert stack_op(frames) == "aten::_to_copy"


def test_op_of_allocations_only_is_the_outermost_one():
    """AccumulateGrad's clone: new_empty_strided calling empty_strided."""
    frames = stack(UNWIND, ("??", 0, "at::_ops::empty_strided::redispatch(c10::DispatchKeySet)"),
                   ("??", 0, "at::_ops::empty_strided::call(c10::ArrayRef<c10::SymInt>)"),
                   ("??", 0, "at::_ops::new_empty_strided::call(at::Tensor const&, c10::ArrayRef<c10::SymInt>)"),
                   ("", 0, "torch::autograd::utils::clone_obey_contract(at::Tensor const&, at::Tensor const&)"),
                   ENGINE)
    assert stack_op(frames) == "aten::new_empty_strided"


def test_op_is_read_below_the_innermost_python_frame_only():
    frames = stack(UNWIND, ("??", 0, "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)"), CPYTHON,
                   (f"{SITE_PACKAGES}/torch/_ops.py", 723, "__call__"), ("??", 0, "at::_ops::full::call(...)"))
    assert stack_op(frames) == "aten::empty_memory_format"


def test_op_falls_back_to_a_native_kernel_and_is_none_without_cpp_frames():
    assert stack_op(stack(UNWIND, ("??", 0, "at::native::cudnn_convolution(at::Tensor const&)"))) == \
        "aten::cudnn_convolution"
    assert stack_op(stack(SOFTMAX, CALLERS[1:3])) is None
    assert stack_op(()) is None


def test_hostile_names_take_linear_time():
    long = ("a" * 200_000, 0, "at::_ops::" + "x" * 200_000)
    spaced = ("y.py" + " " * 100_000, 1, "at::_ops::" + "x " * 100_000 + "::call(")
    start = time.perf_counter()
    for frame in (long, spaced, ("<" * 100_000, 0, "f"), ("/lib/python3.1" + "/" * 100_000, 0, "f")):
        is_user_frame(frame)
        stack_op((frame,))
        top_user_frame((frame,))
    assert time.perf_counter() - start < 1.0


# ---- the readers fill the stacks table -----------------------------------------------------------------------
def test_snapshot_reader_fills_site_and_op_per_stack():
    def as_dicts(frames: tuple[Frame, ...]) -> list[dict]:
        return [{"filename": f, "line": line, "name": name} for f, line, name in frames]
    python_site, c_only = stack(UNWIND, EXP, CPYTHON, SOFTMAX, CALLERS), stack(UNWIND, EXP[:3], ENGINE)
    base, size = 0x7F0000000000, 1 << 20
    trace = [{"action": "segment_alloc", "addr": base, "size": 2 * size, "stream": 0, "time_us": 1, "frames": []}]
    trace += [{"action": "alloc", "addr": base + i * size, "size": size, "stream": 0, "time_us": 2 + i,
               "frames": as_dicts(f)} for i, f in enumerate((python_site, c_only))]
    blocks = [{"address": base + i * size, "size": size, "requested_size": size, "state": "active_allocated",
               "frames": as_dicts(f)} for i, f in enumerate((python_site, c_only))]
    segment = {"device": 0, "address": base, "total_size": 2 * size, "stream": 0, "segment_type": "large",
               "blocks": blocks}
    stacks = snapshot_to_trace({"segments": [segment], "device_traces": [trace]}, "hand-written").stacks
    by_frames = {frames: (site, op) for frames, site, op in zip(stacks["frames"], stacks["top_user_frame"],
                                                                 stacks["op"], strict=True)}
    assert by_frames[python_site] == ("/root/a2/cs336_systems/modules/softmax.py:14 forward", "aten::exp")
    assert by_frames[c_only] == (None, "aten::exp")
