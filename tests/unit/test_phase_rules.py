"""What the frames of a stack say about the phase (analyzer.attribute.frames), one rule at a time, on hand-made
frame tuples shaped like the real ones (torch.compile's from kkaitlyn111-cs336-a2/memory_ctx512_forward.pickle,
stacks="all" from nothanmin-cs336-a2). Frames are innermost first."""
from __future__ import annotations

import time

import pytest

from analyzer.attribute.frames import _PHASE_RULES, stack_facts
from analyzer.core.stacks import Frame

SP = "/venv/lib/python3.13/site-packages"
T = f"{SP}/torch"
USER_FORWARD = ("/home/k/cs336_basics/transformer.py", 292, "forward")
CALL_IMPL = [(f"{T}/nn/modules/module.py", 1750, "_call_impl"), (f"{T}/nn/modules/module.py", 1739, "_wrapped_call_impl")]
TRAIN = [("/home/k/benchmark.py", 298, "profile_model_memory"), ("/home/k/benchmark.py", 426, "<module>")]
GENERATED = ("/tmp/torchinductor_k/kb/ckbfydn2m64lvgma55vodrvsjlhakooozavr3a3hzladpnb3e2jl.py", 4214, "call")
SOURCE = [("/home/k/cs336_basics/transformer.py", 142, "softmax"), ("/home/k/cs336_basics/transformer.py", 208, "forward")]
RUNTIME = [(f"{T}/_inductor/utils.py", 2128, "run"), (f"{T}/_inductor/output_code.py", 466, "__call__"),
           (f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 672, "inner_fn"),
           (f"{T}/_functorch/_aot_autograd/utils.py", 126, "call_func_at_runtime_with_args"),
           (f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 1585, "forward"),
           (f"{T}/autograd/function.py", 575, "apply"), (f"{T}/_functorch/_aot_autograd/utils.py", 100, "g"),
           (f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 310, "runtime_wrapper"),
           (f"{T}/_functorch/aot_autograd.py", 1184, "forward"), (f"{T}/_dynamo/eval_frame.py", 745, "_fn")]
COMPILING = [(f"{T}/_inductor/fx_passes/joint_graph.py", 287, "_deduce_value"),
             (f"{T}/_inductor/constant_folding.py", 222, "run_node"), (f"{T}/fx/interpreter.py", 167, "run"),
             (f"{T}/_inductor/compile_fx.py", 1779, "partition_fn"),
             (f"{T}/_functorch/_aot_autograd/jit_compile_runtime_wrappers.py", 449, "aot_dispatch_autograd"),
             (f"{T}/_functorch/aot_autograd.py", 1155, "aot_module_simplified"),
             (f"{T}/_dynamo/output_graph.py", 1432, "call_user_compiler"),
             (f"{T}/_dynamo/convert_frame.py", 986, "_compile"), (f"{T}/_dynamo/eval_frame.py", 574, "_fn")]
ENGINE = [("??", 0, "torch::autograd::PyNode::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)"),
          ("??", 0, "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
                    "torch::autograd::Node*, torch::autograd::InputBuffer&)"),
          ("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
          ("thread48.o", 0, "execute_native_thread_routine"), ("??", 0, "clone")]
CPP_OP = [("??", 0, "torch::unwind::unwind()"), ("??", 0, "at::_ops::bmm_out::call(at::Tensor const&)"),
          ("VariableType_3.cpp", 0, "torch::autograd::VariableType::(anonymous namespace)::bmm_out_out()"),
          ("/usr/src/python-3.12.3/Objects/methodobject.c", 537, "cfunction_call")]


def stack(*parts: list[Frame] | Frame) -> tuple[Frame, ...]:
    return tuple(f for part in parts for f in (part if isinstance(part, list) else [part]))


def said(*parts: list[Frame] | Frame) -> tuple[str | None, str | None]:
    facts = stack_facts(stack(*parts))
    return facts.phase, facts.phase_signal


# ---- torch.compile -------------------------------------------------------------------------------------------
def test_running_the_compiled_graph_is_forward():
    assert said(CPP_OP, GENERATED, SOURCE, RUNTIME, USER_FORWARD, CALL_IMPL, RUNTIME[-1], CALL_IMPL, TRAIN) == \
        ("forward", "frames:compiled-graph")


def test_the_compiled_backward_is_backward():
    """CompiledFunction.backward, called by the engine; with stacks="all" the Python frames come after the
    engine's C++ frames."""
    backward = [(f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 2065, "_backward_impl"),
                (f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 1700, "impl_fn"),
                (f"{T}/_functorch/_aot_autograd/runtime_wrappers.py", 1710, "backward"),
                (f"{T}/autograd/function.py", 307, "apply")]
    assert said(CPP_OP, GENERATED, SOURCE, RUNTIME[:2], backward) == ("backward", "frames:compiled-backward")
    assert said(CPP_OP, GENERATED, SOURCE, RUNTIME[:2], ENGINE) == ("backward", "frames:compiled-backward")
    assert said(GENERATED, RUNTIME[:2], (f"{T}/autograd/function.py", 307, "apply")) == \
        ("backward", "frames:compiled-backward")


def test_compiling_is_compile():
    assert said(CPP_OP[:2], (f"{T}/_ops.py", 723, "__call__"), COMPILING, USER_FORWARD, CALL_IMPL, TRAIN) == \
        ("compile", "frames:torch.compile")


@pytest.mark.parametrize("autotune", [
    [(f"{SP}/triton/backends/nvidia/driver.py", 481, "get_empty_cache_for_benchmark"),
     (f"{SP}/triton/testing.py", 117, "do_bench"), (f"{T}/_inductor/runtime/benchmarking.py", 66, "benchmark_gpu"),
     (f"{T}/_inductor/runtime/triton_heuristics.py", 855, "bench"),
     (f"{T}/_inductor/runtime/triton_heuristics.py", 890, "benchmark_all_configs"),
     (f"{T}/_inductor/runtime/triton_heuristics.py", 920, "autotune_to_one_config"),
     (f"{T}/_inductor/runtime/triton_heuristics.py", 1000, "run")],
    [(f"{T}/_inductor/select_algorithm.py", 1900, "benchmark_example_value")],
    [(f"{T}/_inductor/autotune_process.py", 600, "benchmark")]], ids=["lazy-triton", "select-algorithm", "process"])
def test_autotuning_is_compile_even_on_the_compiled_graphs_first_call(autotune):
    assert said(autotune, GENERATED, SOURCE, RUNTIME, USER_FORWARD, CALL_IMPL, TRAIN) == \
        ("compile", "frames:compile-autotune")


def test_generated_code_run_by_the_autotuner_or_the_compiler_is_compile():
    benchmark_module = ("/tmp/torchinductor_k/ab/cabc1234.py", 40, "call")
    assert said(benchmark_module, (f"{T}/_inductor/select_algorithm.py", 1900, "benchmark_example_value"),
                COMPILING) == ("compile", "frames:compile-autotune")
    assert said(("/tmp/torchinductor_k/ab/cabc1234.py", 3, "<module>"), (f"{T}/_inductor/codecache.py", 2900, "load"),
                COMPILING) == ("compile", "frames:torch.compile")


def test_a_compiled_optimizer_step_is_the_optimizer():
    assert said(GENERATED, RUNTIME[-1], (f"{T}/optim/adam.py", 200, "step"), (f"{T}/optim/optimizer.py", 480,
                                                                             "wrapper"), TRAIN) == \
        ("optimizer", "frames:torch.optim")


def test_eager_code_between_graph_breaks_is_forward():
    assert said(USER_FORWARD, (f"{T}/_dynamo/eval_frame.py", 745, "_fn"), CALL_IMPL, TRAIN) == \
        ("forward", "frames:module.forward")


# ---- autograd ------------------------------------------------------------------------------------------------
def test_autograd_entry_points_are_backward():
    for entry in [(f"{T}/_tensor.py", 600, "backward"), (f"{T}/autograd/__init__.py", 340, "backward"),
                  (f"{T}/autograd/graph.py", 800, "_engine_run_backward"), ("torch/autograd/__init__.py", 400, "grad")]:
        assert said(("/home/u/hooks.py", 3, "hook"), entry, TRAIN) == ("backward", "frames:torch.autograd")


def test_the_engines_cpp_frames_are_backward_without_any_python_frame():
    facts = stack_facts(stack(CPP_OP[:3], ENGINE))
    assert (facts.phase, facts.phase_signal, facts.has_python) == ("backward", "frames:autograd-engine", False)


def test_a_custom_functions_apply_is_its_forward_when_python_calls_it():
    """DataParallel's Broadcast.apply replicating parameters (constructor-sun) is forward work."""
    broadcast = [(f"{T}/nn/parallel/comm.py", 66, "broadcast_coalesced"), (f"{T}/nn/parallel/_functions.py", 23,
                                                                             "forward"),
                 (f"{T}/autograd/function.py", 576, "apply"), (f"{T}/nn/parallel/replicate.py", 126, "replicate")]
    assert said(broadcast, CALL_IMPL, TRAIN) == ("forward", "frames:module.forward")
    assert said(("/home/u/ops.py", 9, "forward"), (f"{T}/autograd/function.py", 575, "apply"), TRAIN)[0] != "backward"


def test_a_custom_functions_apply_called_by_the_engine_is_backward():
    assert said(("/home/u/ops.py", 20, "backward"), (f"{T}/autograd/function.py", 307, "apply")) == \
        ("backward", "frames:torch.autograd")
    assert said(("/home/u/ops.py", 20, "backward"), (f"{T}/autograd/function.py", 307, "apply"), ENGINE) == \
        ("backward", "frames:torch.autograd")


# ---- activation checkpointing --------------------------------------------------------------------------------
def test_checkpoint_recomputation_is_backward_but_the_checkpointed_forward_is_forward():
    block = [USER_FORWARD, *CALL_IMPL]
    recompute = [(f"{T}/utils/checkpoint.py", 1500, "recompute_fn"), (f"{T}/utils/checkpoint.py", 1111, "unpack_hook")]
    assert said(block, recompute, ENGINE) == ("backward", "frames:activation-checkpoint-recompute")
    assert said(block, (f"{T}/utils/checkpoint.py", 300, "backward"), (f"{T}/autograd/function.py", 307, "apply")) == \
        ("backward", "frames:activation-checkpoint-recompute")
    assert said(block, (f"{T}/utils/checkpoint.py", 343, "checkpoint"), USER_FORWARD, CALL_IMPL, TRAIN) == \
        ("forward", "frames:module.forward")


# ---- the other torch rules, each on its own ------------------------------------------------------------------
@pytest.mark.parametrize("frame, phase, signal", [
    ((f"{T}/optim/adamw.py", 120, "_multi_tensor_adamw"), "optimizer", "frames:torch.optim"),
    ((f"{T}/serialization.py", 900, "_save"), "checkpoint_save", "frames:torch.save"),
    ((f"{T}/distributed/checkpoint/state_dict_saver.py", 60, "save"), "checkpoint_save", "frames:torch.save"),
    ((f"{T}/nn/modules/module.py", 2200, "state_dict"), "checkpoint_save", "frames:state_dict"),
    ((f"{T}/serialization.py", 1400, "load"), "load", "frames:load_state_dict"),
    ((f"{T}/nn/modules/module.py", 2500, "load_state_dict"), "load", "frames:load_state_dict"),
    ((f"{T}/nn/modules/module.py", 900, "_apply"), "load", "frames:module.to"),
    ((f"{T}/nn/modules/linear.py", 105, "__init__"), "load", "frames:module-init"),
    (("torch/nn/init.py", 459, "kaiming_uniform_"), "load", "frames:module-init"),
    ((f"{T}/nn/modules/module.py", 1750, "_call_impl"), "forward", "frames:module.forward"),
    (("/home/u/train.py", 80, "save_checkpoint"), "checkpoint_save", "frames:user-function-name"),
    (("/home/u/model.py", 12, "__init__"), "load", "frames:model-construction"),
    (("/home/u/model.py", 40, "init_weights"), "load", "frames:model-construction"),
    (("/home/u/model.py", 54, "forward"), "forward", "frames:user-forward"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("frames:") else "")
def test_each_rule_on_its_own(frame, phase, signal):
    assert said(("??", 0, "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"), frame, TRAIN) == (phase, signal)


def test_a_forward_stands_against_the_optimizer_but_not_against_autograd():
    """Innermost decides (LBFGS's closure runs the model's forward inside optimizer.step), except that a
    backward, a recomputation or a compile further out overrules a forward seen from inside."""
    closure = [USER_FORWARD, *CALL_IMPL, ("/home/u/train.py", 30, "closure"), (f"{T}/optim/lbfgs.py", 320, "step")]
    assert said(closure) == ("forward", "frames:module.forward")
    assert said(("/home/u/model.py", 12, "__init__"), (f"{T}/_tensor.py", 600, "backward")) == \
        ("backward", "frames:torch.autograd")


def test_nothing_said_is_none():
    assert said(("/home/u/data.py", 5, "collate"), TRAIN) == (None, None)
    assert said() == (None, None)


def test_has_python_means_a_python_source_frame():
    assert stack_facts(stack(CPP_OP, ("<ipython-input-3-ab12>", 2, "<module>"))).has_python
    assert stack_facts(stack(CPP_OP, (f"{T}/_ops.py", 723, "__call__"))).has_python
    assert not stack_facts(stack(CPP_OP, ENGINE, ("eval_frame.c", 0, "dynamo_custom_eval_frame_shim"))).has_python


def test_each_signal_names_one_phase():
    """Honest labels: a signal name says one thing (`frames:compiled-graph` is forward, `frames:compile-autotune`
    compile ...), and the torch.compile rules have names of their own."""
    phases: dict[str, set[str]] = {}
    for rule in _PHASE_RULES:
        phases.setdefault(rule.signal, set()).add(rule.phase)
        if rule.in_compiled and rule.in_compiled != rule.signal:
            phases.setdefault(rule.in_compiled, set()).add(rule.phase)
    assert all(len(p) == 1 for p in phases.values()), phases
    assert {"frames:compiled-graph", "frames:compiled-backward", "frames:compile-autotune", "frames:torch.compile",
            "frames:autograd-engine"} <= set(phases)


def test_hostile_names_take_linear_time():
    start = time.perf_counter()
    for name in ("a" * 200_000, "save " * 40_000, "_" * 100_000 + "(", "torch::autograd::" * 10_000):
        for filename in (f"{T}/_inductor/x.py", f"{T}/utils/checkpoint.py", "/home/u/x.py", "??"):
            stack_facts(((filename, 0, name), (filename + "/" * 50_000, 0, name)))
    assert time.perf_counter() - start < 2.0


def test_aot_eagers_graph_running_is_forward_work_not_compile() -> None:
    """torch.compile(backend="aot_eager"): the graph runs under dynamo's debugging backend's `run`."""
    from analyzer.attribute.frames import stack_facts

    frames = (("/venv/lib/python3.11/site-packages/torch/_ops.py", 875, "__call__"),
              ("/venv/lib/python3.11/site-packages/torch/_dynamo/backends/debugging.py", 340, "run"),
              ("/venv/lib/python3.11/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py", 3462, "forward"),
              ("/src/train.py", 20, "train_step"))
    facts = stack_facts(frames)
    assert (facts.phase, facts.phase_signal) == ("forward", "frames:compiled-graph")
    compiling = (("/venv/lib/python3.11/site-packages/torch/_dynamo/backends/debugging.py", 120, "aot_eager"),
                 ("/src/train.py", 20, "train_step"))
    assert stack_facts(compiling).phase == "compile"
