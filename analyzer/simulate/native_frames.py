"""The C++ and CPython frames of a `stacks="all"` recording, built from what the tracer sees at each allocation.

`torch.cuda.memory._record_memory_history(stacks="all")` unwinds the native stack at every malloc and free
(torch/csrc/profiler/combined_traceback.cpp) and interleaves the Python frames with it: each CPython
interpreter frame (`_PyEval_EvalFrameDefault`) is preceded by the next Python frame, innermost first, and
Python frames left over when the native stack ends (on Python 3.11+ one interpreter frame runs every Python
function that another calls directly, so there are fewer of them than Python frames) are appended after
`_start`. On autograd's device thread the stack has no Python frames unless the engine calls back into Python
(a custom Function's backward, a saved-tensor unpack hook), and ends in `Engine::thread_main` and `__clone`.

Nothing here is copied from a recording: the native frames are generated from the dispatch the tracer sees
(the aten operator and its schema, whether it is a pointwise TensorIterator op or a factory, the autograd node
running it, autocast), and the CPython glue between two Python frames from the bytecode of the call (a plain
call is inlined; `f(*args)`, a call of an object with `__call__`, an operator, a `with` statement go through C).
The caching allocator's frames are torch's own (CUDACachingAllocator.cpp) as a CUDA build of 2.13 names them.
"""
from __future__ import annotations

import dis
import re
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from types import CodeType, FrameType
from typing import Any

import torch

Frame = tuple[str, str]              # (filename, name); native frames have line 0
Entry = tuple[str, int, str] | dict[str, Any]     # a native frame (filename, 0, name) or a Python frame's dict

_ALLOC = "c10::cuda::CUDACachingAllocator::Native::"
ALLOC_PREFIX: tuple[Frame, ...] = (
    ("??", "torch::unwind::unwind()"),
    ("??", "torch::CapturedTraceback::gather(bool, bool, bool)"),
    ("memory_snapshot.cpp", "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
    ("CUDACachingAllocator.cpp", f"{_ALLOC}DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)"),
    ("", f"{_ALLOC}NativeCachingAllocator::malloc(void**, signed char, unsigned long, CUstream_st*)"),
    ("", f"{_ALLOC}NativeCachingAllocator::allocate(unsigned long)"),
)
FREE_PREFIX: tuple[Frame, ...] = (
    *ALLOC_PREFIX[:3],
    ("CUDACachingAllocator.cpp", f"{_ALLOC}DeviceCachingAllocator::free({_ALLOC}Block*)"),
    ("", f"{_ALLOC}NativeCachingAllocator::free(void*)"),
    ("", "c10::StorageImpl::~StorageImpl()"),
    ("", "c10::intrusive_ptr<c10::StorageImpl, c10::detail::intrusive_target_default_null_type<c10::StorageImpl> >"
         "::reset_()"),
    ("TensorImpl.cpp", "c10::TensorImpl::~TensorImpl()"),
)
_EMPTY_CUDA: tuple[Frame, ...] = (
    ("??", "at::detail::empty_generic(c10::ArrayRef<long>, c10::Allocator*, c10::DispatchKeySet, c10::ScalarType, "
           "std::optional<c10::MemoryFormat>)"),
    ("??", "at::detail::empty_cuda(c10::ArrayRef<long>, c10::ScalarType, std::optional<c10::Device>, "
           "std::optional<c10::MemoryFormat>)"),
    ("??", "at::detail::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, "
           "std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)"),
)
_TENSOR_ITERATOR: tuple[Frame, ...] = (
    ("??", "at::TensorIteratorBase::allocate_or_resize_outputs()"),
    ("??", "at::TensorIteratorBase::build(at::TensorIteratorConfig&)"),
)
_VECTOR = "std::vector<at::Tensor, std::allocator<at::Tensor> >"
_ENGINE_TAIL: tuple[Frame, ...] = (
    ("", f"torch::autograd::Node::operator()({_VECTOR}&&)"),
    ("??", "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
           "torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::ReadyQueue> const&)"),
    ("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
    ("??", "torch::autograd::Engine::thread_init(int, std::shared_ptr<torch::autograd::ReadyQueue> const&, bool)"),
    ("", "torch::autograd::python::PythonEngine::thread_init(int, std::shared_ptr<torch::autograd::ReadyQueue> const&, "
         "bool)"),
    ("thread.cc", "execute_native_thread_routine"),
    ("pthread_create.c", "start_thread"),
    ("??", "__clone3"),
)

# ---- CPython, as a symbolised conda build of the running interpreter names its frames -------------------------
_PY_SRC = "/usr/local/src/conda/python-{}.{}.{}/".format(*sys.version_info[:3])
_CPYTHON_FILES = {
    "_PyEval_EvalFrameDefault": "Python/ceval.c", "PyEval_EvalCode": "Python/ceval.c",
    "_PyFunction_Vectorcall": "Objects/call.c", "PyObject_Call": "Objects/call.c",
    "_PyObject_MakeTpCall": "Objects/call.c", "_PyObject_Call_Prepend": "Objects/call.c",
    "_PyObject_FastCallDictTstate": "Objects/call.c", "PyObject_CallOneArg": "Objects/call.c",
    "method_vectorcall": "Objects/classobject.c", "slot_tp_call": "Objects/typeobject.c",
    "slot_tp_init": "Objects/typeobject.c", "type_call": "Objects/typeobject.c",
    "slot_tp_descr_get": "Objects/typeobject.c", "slot_tp_iternext": "Objects/typeobject.c",
    "method_vectorcall_VARARGS_KEYWORDS": "Objects/descrobject.c", "cfunction_call": "Objects/methodobject.c",
    "binary_op1": "Objects/abstract.c", "binary_iop1": "Objects/abstract.c", "PyObject_GetItem": "Objects/abstract.c",
    "PyObject_SetItem": "Objects/abstract.c", "_PyObject_GenericGetAttrWithDict": "Objects/object.c",
    "_Py_Dealloc": "Objects/object.c", "frame_dealloc": "Objects/frameobject.c",
    "run_eval_code_obj": "Python/pythonrun.c", "run_mod": "Python/pythonrun.c", "pyrun_file": "Python/pythonrun.c",
    "_PyRun_SimpleFileObject": "Python/pythonrun.c", "_PyRun_AnyFileObject": "Python/pythonrun.c",
    "pymain_run_file_obj": "Modules/main.c", "pymain_run_file": "Modules/main.c", "Py_RunMain": "Modules/main.c",
    "Py_BytesMain": "Modules/main.c",
}
for _name in ("Add", "Subtract", "Multiply", "TrueDivide", "MatrixMultiply", "Power", "InPlaceAdd",
              "InPlaceMultiply", "InPlaceSubtract", "InPlaceTrueDivide"):
    _CPYTHON_FILES[f"PyNumber_{_name}"] = "Objects/abstract.c"


def _c(name: str) -> Frame:
    return (_PY_SRC + _CPYTHON_FILES[name], name) if name in _CPYTHON_FILES else ("??", name)


EVAL = _c("_PyEval_EvalFrameDefault")
_PROCESS_BOTTOM: tuple[Frame, ...] = (
    *map(_c, ("PyEval_EvalCode", "run_eval_code_obj", "run_mod", "pyrun_file", "_PyRun_SimpleFileObject",
              "_PyRun_AnyFileObject", "pymain_run_file_obj", "pymain_run_file", "Py_RunMain", "Py_BytesMain")),
    ("./csu/../sysdeps/nptl/libc_start_call_main.h", "__libc_start_call_main"),
    ("./csu/../csu/libc-start.c", "__libc_start_main_impl"),
    ("??", "_start"),
)
# how a Python function was entered from its caller, as the C frames between the two interpreter frames
_ENTRY_GLUE: dict[str, tuple[Frame, ...]] = {
    "method_ex": (_c("method_vectorcall"),),                                         # self.f(*args, **kwargs)
    "function_ex": (_c("_PyFunction_Vectorcall"), _c("PyObject_Call")),             # f(*args, **kwargs)
    "call_object": (_c("_PyObject_Call_Prepend"), _c("slot_tp_call"), _c("_PyObject_MakeTpCall")),  # module(x)
    "init": (_c("_PyObject_Call_Prepend"), _c("slot_tp_init"), _c("type_call"), _c("_PyObject_MakeTpCall")),
    "operator": (_c("_PyFunction_Vectorcall"), _c("binary_op1")),                    # __add__ of a Python class
    "getattr": (_c("_PyFunction_Vectorcall"), _c("slot_tp_descr_get"), _c("_PyObject_GenericGetAttrWithDict")),
    "c_call": (_c("_PyFunction_Vectorcall"), _c("PyObject_Call")),                  # called back from C
}
_BINARY_OPS = {"+": ("add", "Add"), "-": ("sub", "Subtract"), "*": ("mul", "Multiply"), "/": ("div", "TrueDivide"),
               "@": ("matmul", "MatrixMultiply"), "**": ("pow", "Power"), "+=": ("add_", "InPlaceAdd"),
               "-=": ("sub_", "InPlaceSubtract"), "*=": ("mul_", "InPlaceMultiply"),
               "/=": ("div_", "InPlaceTrueDivide")}
_INPLACE_CALLS = {"__iadd__", "__isub__", "__imul__", "__itruediv__"}


# ---- the C++ spelling of an operator's schema ---------------------------------------------------------------
_TYPES = {"Tensor": "at::Tensor const&", "Tensor?": "std::optional<at::Tensor> const&",
          "Tensor[]": "c10::ArrayRef<at::Tensor>", "Tensor?[]": "c10::List<std::optional<at::Tensor> > const&",
          "int": "long", "int?": "std::optional<long>", "SymInt": "c10::SymInt", "SymInt?": "std::optional<c10::SymInt>",
          "int[]": "c10::ArrayRef<long>", "int[]?": "c10::OptionalArrayRef<long>", "SymInt[]": "c10::ArrayRef<c10::SymInt>",
          "SymInt[]?": "c10::OptionalArrayRef<c10::SymInt>", "float": "double", "float?": "std::optional<double>",
          "bool": "bool", "bool?": "std::optional<bool>", "Scalar": "c10::Scalar const&",
          "Scalar?": "std::optional<c10::Scalar> const&", "ScalarType": "c10::ScalarType",
          "ScalarType?": "std::optional<c10::ScalarType>", "Layout?": "std::optional<c10::Layout>",
          "Device?": "std::optional<c10::Device>", "MemoryFormat?": "std::optional<c10::MemoryFormat>",
          "str": "c10::basic_string_view<char>", "str?": "std::optional<c10::basic_string_view<char> >",
          "Generator?": "std::optional<at::Generator>", "Scalar[]": "c10::ArrayRef<c10::Scalar>",
          "bool[]": "c10::ArrayRef<bool>", "float[]?": "std::optional<c10::ArrayRef<double> >"}


def _cpp_type(declared: str) -> str:
    mutable = "!" in declared
    base = re.sub(r"\([^)]*\)", "", declared)         # Tensor(a!) -> Tensor
    base = re.sub(r"\[\d+\]", "[]", base)              # int[2] -> int[]
    if mutable and base == "Tensor":
        return "at::Tensor&"
    return _TYPES.get(base, "at::Tensor const&" if base.startswith("Tensor") else "long")


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([" and 1 or (char in ")]" and -1 or 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in [*parts, current] if p.strip() and p.strip() != "*"]


@dataclass(frozen=True)
class OpSpelling:
    """An aten operator as its C++ symbols name it: `sub_Tensor`, `(at::Tensor const&, ...)`, `at::Tensor`."""

    name: str          # sub
    ops_name: str      # sub_Tensor
    signature: str     # at::Tensor const&, at::Tensor const&, c10::Scalar const&
    returns: str       # at::Tensor
    pointwise: bool
    factory: bool


@lru_cache(maxsize=None)
def spell(op: Any) -> OpSpelling:
    schema = op._schema
    text = str(schema)
    arguments, _, returns = text[text.index("(") + 1:].rpartition(") -> ")
    types = [_cpp_type(a.rsplit(" ", 1)[0] if " " in a else a) for a in _split_top(arguments)]
    rets = _split_top(returns.strip("()")) if returns.startswith("(") else ([returns] if returns != "()" else [])
    cpp_rets = [_cpp_type(r.split(" ")[0]).replace(" const&", "") for r in rets]
    ret = ("void" if not cpp_rets else cpp_rets[0] if len(cpp_rets) == 1
           else f"std::tuple<{', '.join(cpp_rets)}>")
    ret = ret.replace("c10::ArrayRef<at::Tensor>", _VECTOR)
    name = schema.name.split("::")[-1]
    ops_name = f"{name}_{schema.overload_name}" if schema.overload_name else name
    factory = not any(a.type.isSubtypeOf(torch._C.TensorType.get()) for a in schema.arguments)
    return OpSpelling(name, ops_name, ", ".join(types), ret, torch.Tag.pointwise in op.tags,
                      factory or name.endswith("_like") or name.startswith("new_"))


# operators with a structured CUDA kernel (meta function + set_output) among those a training step runs; pointwise
# operators (torch.Tag.pointwise) are structured TensorIterator kernels too
_STRUCTURED = frozenset({"mm", "addmm", "bmm", "baddbmm", "_softmax", "_log_softmax", "_softmax_backward_data",
                         "_log_softmax_backward_data", "mean", "sum", "amax", "amin", "index", "gelu", "gelu_backward",
                         "silu", "silu_backward", "cat", "topk", "sort", "nll_loss_forward", "nll_loss_backward",
                         "cumsum", "triu", "tril", "scatter", "scatter_add", "gather", "index_add", "norm", "max", "min",
                         "argmax", "prod", "tanh_backward", "threshold_backward", "pow", "rsqrt", "sqrt", "mul", "add",
                         "sub", "div"})


def _functor(kernel: str, op: OpSpelling, dispatch_keyset: bool = False) -> str:
    sig = f"c10::DispatchKeySet, {op.signature}" if dispatch_keyset else op.signature
    fn = f"{op.returns} ({sig})"
    return (f"c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<"
            f"c10::CompileTimeFunctionPointer<{fn}, &{kernel}>, {op.returns}, c10::guts::typelist::typelist<{sig}> >, "
            f"{fn}>::call(c10::OperatorKernel*, c10::DispatchKeySet, {op.signature})")


def _variable_type_file(op: OpSpelling) -> str:
    return f"VariableType_{zlib.crc32(op.name.encode()) % 5}.cpp"


def _empty_memory_format() -> OpSpelling:
    return spell(torch.ops.aten.empty.memory_format)


def kernel_frames(op: Any, autocast: bool = False, binding: str | None = None) -> list[Frame]:
    """The frames from the allocator's caller up to `at::_ops::<op>::call`, innermost first: the CUDA kernel's
    output allocation (a factory's `empty`, a TensorIterator's `allocate_or_resize_outputs`, a structured
    kernel's `set_output_raw_strided`), its registration wrapper, autograd's VariableType kernel, and autocast's
    wrapper when the op is cast (the `_to_copy` of a cast input made by `cached_cast`)."""
    spelling = spell(op)
    frames: list[Frame] = list(_EMPTY_CUDA)
    if spelling.factory:
        empty = _empty_memory_format()
        kernel = "at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA_memory_format_empty"
        frames += [("??", f"at::native::empty_cuda({empty.signature.replace('c10::SymInt', 'long')})"),
                   ("RegisterCUDA_0.cpp", f"{kernel}({empty.signature})"),
                   ("RegisterCUDA_0.cpp", _functor(kernel, empty)),
                   ("??", f"at::_ops::empty_memory_format::redispatch(c10::DispatchKeySet, {empty.signature})"),
                   ("RegisterBackendSelect.cpp", _functor("at::(anonymous namespace)::empty_memory_format", empty)),
                   ("??", f"at::_ops::empty_memory_format::call({empty.signature})")]
        if spelling.name != "empty":
            kernel = f"at::(anonymous namespace)::(anonymous namespace)::wrapper_CompositeExplicitAutograd__{spelling.name}"
            frames += [("??", f"at::native::{spelling.name}({spelling.signature})"),
                       ("RegisterCompositeExplicitAutograd_0.cpp", _functor(kernel, spelling)),
                       ("??", f"at::_ops::{spelling.ops_name}::redispatch(c10::DispatchKeySet, {spelling.signature})")]
    elif spelling.name.startswith("_foreach_"):
        frames += [("??", "at::native::empty_like(at::Tensor const&, std::optional<c10::ScalarType>, "
                          "std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, "
                          "std::optional<c10::MemoryFormat>)"),
                   ("??", f"at::native::foreach_tensor_{spelling.name[9:]}_{spelling.ops_name.rsplit('_', 1)[-1].lower()}"
                          f"_kernel_cuda({spelling.signature})"),
                   ("RegisterCUDA_0.cpp", f"at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA_"
                                          f"{spelling.ops_name}({spelling.signature})"),
                   ("??", f"at::_ops::{spelling.ops_name}::redispatch(c10::DispatchKeySet, {spelling.signature})")]
    elif not (spelling.pointwise or spelling.name in _STRUCTURED):
        kernel = f"at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA__{spelling.ops_name}"
        frames += [("??", "at::empty(c10::ArrayRef<long>, c10::TensorOptions, std::optional<c10::MemoryFormat>)"),
                   ("??", f"at::native::{spelling.name}_cuda({spelling.signature})"),
                   ("RegisterCUDA_0.cpp", f"{kernel}({spelling.signature})"),
                   ("RegisterCUDA_0.cpp", _functor(kernel, spelling)),
                   ("??", f"at::_ops::{spelling.ops_name}::redispatch(c10::DispatchKeySet, {spelling.signature})")]
    else:
        frames += [("??", "at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)"),
                   ("RegisterCUDA_0.cpp", "at::(anonymous namespace)::create_out(c10::ArrayRef<long>, "
                                          "c10::ArrayRef<long>, c10::TensorOptions const&)"),
                   ("RegisterCUDA_0.cpp", f"at::(anonymous namespace)::structured_{spelling.ops_name}_out_functional::"
                                          "set_output_raw_strided(long, c10::ArrayRef<long>, c10::ArrayRef<long>, "
                                          "c10::TensorOptions, c10::ArrayRef<at::Dimname>)")]
        if spelling.pointwise:
            frames += _TENSOR_ITERATOR
        kernel = f"at::(anonymous namespace)::wrapper_CUDA_{spelling.ops_name}"
        frames += [("??", f"at::meta::structured_{spelling.ops_name}::meta({spelling.signature})"),
                   ("RegisterCUDA_0.cpp", f"{kernel}({spelling.signature})"),
                   ("RegisterCUDA_0.cpp", _functor(kernel, spelling)),
                   ("??", f"at::_ops::{spelling.ops_name}::redispatch(c10::DispatchKeySet, {spelling.signature})")]
    variable = f"torch::autograd::VariableType::(anonymous namespace)::{spelling.ops_name}"
    frames += [(_variable_type_file(spelling), f"{variable}(c10::DispatchKeySet, {spelling.signature})"),
               (_variable_type_file(spelling), _functor(variable, spelling, dispatch_keyset=True)),
               ("??", f"at::_ops::{spelling.ops_name}::call({spelling.signature})")]
    if autocast and spelling.name == "_to_copy":
        frames += [("??", f"at::native::to({spelling.signature})"),
                   ("??", "at::autocast::cached_cast(c10::ScalarType, at::Tensor const&, c10::DeviceType)")]
        parent = _binding_op(binding)
        if parent is not None:
            frames.append(("", f"at::autocast::WrapFunction_<(at::autocast::CastPolicy)0, (c10::DeviceType)1, "
                               f"{parent.returns} ({parent.signature}), &at::_ops::{parent.ops_name}::call, "
                               f"{parent.returns}, c10::guts::typelist::typelist<{parent.signature}> >"
                               f"::type::call({parent.signature})"))
    return frames


@lru_cache(maxsize=None)
def _binding_op(name: str | None) -> OpSpelling | None:
    """The aten operator a Python binding of that name calls first (None: no such operator)."""
    packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None:
        return None
    overloads = packet.overloads()
    overload = "default" if "default" in overloads else (overloads[0] if overloads else None)
    return spell(getattr(packet, overload)) if overload else None


# ---- the Python side: how each frame was entered, read from the caller's bytecode ------------------------------
@lru_cache(maxsize=4096)
def _instructions(code: CodeType) -> tuple[list[int], list[dis.Instruction], list[int]]:
    """Offsets, instructions and the stack depth before each, walking the code straight through."""
    offsets, instructions, depths = [], [], []
    depth = 0
    for instruction in dis.get_instructions(code):
        offsets.append(instruction.offset)
        instructions.append(instruction)
        depths.append(depth)
        try:
            depth += dis.stack_effect(instruction.opcode, instruction.arg, jump=False) \
                if instruction.opcode >= dis.HAVE_ARGUMENT else dis.stack_effect(instruction.opcode)
        except ValueError:
            pass
    return offsets, instructions, depths


def _at(code: CodeType, lasti: int) -> tuple[int, list[dis.Instruction], list[int]]:
    offsets, instructions, depths = _instructions(code)
    lo, hi = 0, len(offsets) - 1
    while lo < hi:                      # the last instruction starting at or before lasti (3.11 counts its caches)
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= lasti:
            lo = mid
        else:
            hi = mid - 1
    return lo, instructions, depths


@lru_cache(maxsize=65536)
def _callee(code: CodeType, lasti: int) -> tuple[str, str | None, bool]:
    """(opname, the name the call was made through, whether that name was looked up on a module global) of
    the instruction a frame is executing."""
    index, instructions, depths = _at(code, lasti)
    instruction = instructions[index]
    if instruction.opname in ("BINARY_OP", "BINARY_SUBSCR", "STORE_SUBSCR", "CALL_FUNCTION_EX", "BEFORE_WITH"):
        return instruction.opname, instruction.argrepr or None, False
    if instruction.opname != "CALL":
        return instruction.opname, None, False
    nargs = instruction.arg or 0
    start = index - 1
    depth = depths[index]
    if start >= 0 and instructions[start].opname == "PRECALL":   # 3.11: PRECALL's stack effect counts the args
        depth = depths[start]
        start -= 1
    if start >= 0 and instructions[start].opname == "KW_NAMES":
        start -= 1
    target = depth - nargs               # the stack depth once the callable (and its NULL/self) is pushed
    for j in range(start, -1, -1):
        loader = instructions[j]
        if loader.opname in ("LOAD_METHOD", "LOAD_ATTR", "LOAD_GLOBAL", "LOAD_FAST", "LOAD_DEREF", "LOAD_NAME") \
                and j + 1 < len(depths) and depths[j + 1] == target:
            name = str(loader.argval)
            on_module = j > 0 and instructions[j - 1].opname in ("LOAD_GLOBAL", "LOAD_NAME") \
                and loader.opname in ("LOAD_METHOD", "LOAD_ATTR")
            return "CALL", name, on_module
        if depths[j] < target - 2:
            break
    return "CALL", None, False


def _entry(caller: FrameType, callee: CodeType) -> str:
    """How `callee` was entered from `caller`: 'inline' (one interpreter frame runs both) or a _ENTRY_GLUE key."""
    opname, name, _ = _callee(caller.f_code, caller.f_lasti)
    if callee.co_flags & (0x20 | 0x80 | 0x200):          # generator, coroutine, async generator: resumed from C
        return "c_call"
    if opname == "CALL":
        if callee.co_name in ("__call__", "_wrapped_call_impl"):
            return "call_object"
        if callee.co_name == "__init__" and name != "__init__":
            return "init"
        return "inline"
    if opname == "CALL_FUNCTION_EX":
        return "method_ex" if "self" in callee.co_varnames[:1] else "function_ex"
    if opname in ("BINARY_OP", "BINARY_SUBSCR"):
        return "operator"
    if opname in ("LOAD_ATTR", "LOAD_METHOD"):
        return "getattr"
    return "c_call"


_NN = frozenset(dir(torch._C._nn))
_FUNCTIONS = frozenset(dir(torch._C._VariableFunctions))
_METHODS = frozenset(dir(torch._C.TensorBase))


def binding_frames(frame: FrameType, op_name: str) -> tuple[list[Frame], str | None]:
    """The Python binding the innermost Python frame called into (`THPVariable_sub`, `THPVariable_linear` ...)
    and the CPython frames that called it, innermost first; also the binding's name."""
    opname, name, on_module = _callee(frame.f_code, frame.f_lasti)
    if opname == "BINARY_OP" and name in _BINARY_OPS:
        method, number = _BINARY_OPS[name]
        thp = f"torch::autograd::THPVariable_{method}"
        return [("python_variable_methods.cpp", f"{thp}(_object*, _object*, _object*)"),
                ("python_variable_methods.cpp", f"_object* torch::autograd::TypeError_to_NotImplemented_<&{thp}>"
                                                "(_object*, _object*, _object*)"),
                _c("binary_iop1" if method.endswith("_") else "binary_op1"), _c(f"PyNumber_{number}")], method
    if opname == "BINARY_SUBSCR":
        return [("", "torch::autograd::THPVariable_getitem(_object*, _object*)"), _c("PyObject_GetItem")], "index"
    if opname == "STORE_SUBSCR":
        return [("", "torch::autograd::THPVariable_setitem(_object*, _object*, _object*)"),
                _c("PyObject_SetItem")], "index_put_"
    if name is None or name in _INPLACE_CALLS:
        name = op_name
    if name in _NN and (on_module or name not in _METHODS):
        return [("python_nn_functions.cpp", f"torch::autograd::THPVariable_{name}(_object*, _object*, _object*)"),
                _c("cfunction_call")], name
    if name in _FUNCTIONS and (on_module or name not in _METHODS):
        source = f"python_torch_functions_{zlib.crc32(name.encode()) % 3}.cpp"
        return [(source, f"torch::autograd::THPVariable_{name}(_object*, _object*, _object*)"),
                _c("cfunction_call")], name
    return [("python_variable_methods.cpp", f"torch::autograd::THPVariable_{name}(_object*, _object*, _object*)"),
            _c("method_vectorcall_VARARGS_KEYWORDS")], name


def composite_frames(binding: str | None, op_name: str) -> list[Frame]:
    """When the binding's operator is composite (`linear` -> `addmm`), its frames above the operator that ran."""
    if binding is None or binding == op_name or binding.rstrip("_") == op_name.rstrip("_"):
        return []
    parent = _binding_op(binding)
    if parent is None:
        return []
    kernel = f"at::(anonymous namespace)::(anonymous namespace)::wrapper_CompositeImplicitAutograd__{parent.ops_name}"
    return [("??", f"at::native::{parent.name}({parent.signature})"),
            ("RegisterCompositeImplicitAutograd_0.cpp", _functor(kernel, parent)),
            ("??", f"at::_ops::{parent.ops_name}::call({parent.signature})")]


def python_segments(frames: list[tuple[FrameType, bool]]) -> list[tuple[int, str]]:
    """For Python frames innermost first (frame, shown), the index of each interpreter frame's outermost Python
    frame and how it was entered; the outermost frame is entered from the process's main (`'main'`)."""
    segments = []
    for i, (frame, _) in enumerate(frames):
        caller = frames[i + 1][0] if i + 1 < len(frames) else None
        kind = "main" if caller is None else _entry(caller, frame.f_code)
        if kind != "inline":
            segments.append((i, kind))
    return segments


def interleave(native_inner: list[Frame], python: list[dict[str, Any]], kinds: list[str],
               tail: tuple[Frame, ...]) -> list[Entry]:
    """Combine as torch's symbolizer does: walking the native stack, each interpreter frame takes the next
    Python frame before it; the native frames end with `tail`; Python frames left over go at the very end.

    `kinds[k]` is how the k-th interpreter frame was entered (its glue frames follow it), `python` the frame
    dicts innermost first."""
    out: list[Entry] = [(f, 0, n) for f, n in native_inner]
    pending = list(python)
    for kind in kinds:
        if pending:
            out.append(pending.pop(0))
        out.append((EVAL[0], 0, EVAL[1]))
        glue = _ENTRY_GLUE.get(kind, ())
        out += [(f, 0, n) for f, n in glue]
    out += [(f, 0, n) for f, n in tail]
    out += pending
    return out


PROCESS_BOTTOM = _PROCESS_BOTTOM
ENGINE_TAIL = _ENGINE_TAIL


def node_frames(node: Any) -> list[Frame]:
    """The autograd node the engine is evaluating, as its apply() frame(s)."""
    if node is None:
        return []
    name = node.name()
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return [("python_function.cpp", f"torch::autograd::PyNode::apply({_VECTOR}&&)")]
    if "AccumulateGrad" in name:
        return [("", f"torch::autograd::AccumulateGrad::apply({_VECTOR}&&)")]
    cls = name.split("::")[-1]
    return [("Functions.cpp", f"torch::autograd::generated::{cls}::apply({_VECTOR}&&)")]


UNPACK_HOOK: tuple[Frame, ...] = (
    ("python_saved_variable_hooks.cpp", "torch::autograd::PySavedVariableHooks::call_unpack_hook()"),
    ("saved_variable.cpp", "torch::autograd::SavedVariable::unpack(std::shared_ptr<torch::autograd::Node>) const"),
)
PY_FROM_ENGINE: tuple[Frame, ...] = (_c("_PyFunction_Vectorcall"), _c("PyObject_Call"))
DEALLOC: tuple[Frame, ...] = (("python_variable.cpp", "THPVariable_clear(THPVariable*)"),
                              ("python_variable.cpp", "THPVariable_dealloc(_object*)"), _c("_Py_Dealloc"))
RELEASE_VARIABLES: tuple[Frame, ...] = (
    ("", f"{_VECTOR}::~vector()"),
    ("", "torch::autograd::Node::release_variables()"),
)


# ---- whole stacks, interned by the tracer's frame cache ---------------------------------------------------------
def _python_side(stacks: Any, shown: list[FrameType]) -> tuple[list[dict[str, Any]], list[str]]:
    python = stacks.frames_of(shown)
    kinds = [kind for _, kind in python_segments([(f, True) for f in shown])]
    return python, kinds


def _engine_tail(node: Any, python_inside: bool) -> tuple[Frame, ...]:
    """The engine's frames below the node it evaluates; with Python inside, the call into it from C++ (a custom
    Function's backward, or a saved-tensor hook unpacking a checkpointed activation) before them."""
    nodes = tuple(node_frames(node))
    if not python_inside:
        return (*nodes, *ENGINE_TAIL)
    is_py_node = isinstance(node, torch.autograd.function.BackwardCFunction)
    return (*PY_FROM_ENGINE, *(() if is_py_node else UNPACK_HOOK), *nodes, *ENGINE_TAIL)


def _node_key(node: Any) -> tuple[str, bool]:
    return ("", False) if node is None else (node.name(), isinstance(node, torch.autograd.function.BackwardCFunction))


def allocation_stack(stacks: Any, shown: list[FrameType], func: Any, in_backward: bool) -> list[dict[str, Any]]:
    """The frames `stacks="all"` records for an allocation made by operator `func`, innermost first."""
    node = torch._C._current_autograd_node() if in_backward else None
    autocast = torch.is_autocast_enabled("cpu")
    if shown:
        _, callee, _ = _callee(shown[0].f_code, shown[0].f_lasti)
        code_keys = tuple((f.f_code.co_filename, f.f_lineno, f.f_code.co_name, f.f_lasti) for f in shown)
    else:
        callee, code_keys = None, ()
    key = ("alloc", func, code_keys, callee, _node_key(node), in_backward, autocast)

    def build() -> list[Entry]:
        op_name = spell(func).name
        native = [*ALLOC_PREFIX, *kernel_frames(func, autocast, None)]
        if not shown:
            return interleave([*native, *_engine_tail(node, False)], [], [], ())
        glue, binding = binding_frames(shown[0], op_name)
        if autocast and spell(func).name == "_to_copy":
            native = [*ALLOC_PREFIX, *kernel_frames(func, autocast, binding)]
        native += composite_frames(binding, op_name) + glue
        python, kinds = _python_side(stacks, shown)
        tail = _engine_tail(node, True) if in_backward else PROCESS_BOTTOM
        return interleave(native, python, kinds, tail)

    return stacks.intern(key, build)


def free_stack(stacks: Any, shown: list[FrameType], in_backward: bool) -> list[dict[str, Any]]:
    """The frames `stacks="all"` records for a free: the storage's destructor, called from Python's dealloc of
    the last tensor holding it, or from the autograd engine releasing a node's saved tensors."""
    node = torch._C._current_autograd_node() if in_backward else None
    code_keys = tuple((f.f_code.co_filename, f.f_lineno, f.f_code.co_name, f.f_lasti) for f in shown)
    key = ("free", code_keys, _node_key(node), in_backward)

    def build() -> list[Entry]:
        if in_backward and not shown:
            return interleave([*FREE_PREFIX, *RELEASE_VARIABLES, *_engine_tail(node, False)], [], [], ())
        python, kinds = _python_side(stacks, shown)
        tail = _engine_tail(node, True) if in_backward else PROCESS_BOTTOM
        return interleave([*FREE_PREFIX, *DEALLOC], python, kinds, tail)

    return stacks.intern(key, build)
