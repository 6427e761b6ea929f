"""Run a user's training loop under the tracer and write what a GPU run would have recorded.

The loop is the plain one most training scripts have: get a batch, forward (the model returns the loss, or an
object with a `.loss` as transformers models do; or, with a `loss_fn`, the batch is `(inputs, targets)` and the
loss is `loss_fn(model(inputs), targets)`), backward, `optimizer.step()`, `optimizer.zero_grad()`. With
`micro_batches=N` the forward and backward run N times per step on N batches (gradient accumulation, the loss
divided by N); with `autocast` the forward runs under `torch.autocast` of that dtype (on the CPU: CUDA's
autocast keeps a few more operators in fp32 than the CPU's lists do). Each iteration is
wrapped in `ProfilerStep#N`, as torch.profiler does; the optimizer's own `Optimizer.step#...` and
`Optimizer.zero_grad#...` ranges and any `record_function` range of the user's code are recorded as they run.
`save_fn(model, optimizer)`, when given, runs after the last step, in the checkpoint_save phase.

What each storage is, is settled by identity after every backward and every optimizer step: what
`model.parameters()` hold (a new storage after an optimizer replaced `p.data`; tied weights once, for the
first module holding them), their `.grad`, and the optimizer's state: every tensor in `optimizer.state`, and for
an optimizer that keeps its state elsewhere, every tensor its attributes hold (a list aligned with its
parameters, or a dict keyed by them, names the owning module).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from analyzer.simulate.allocator import AllocatorSettings
from analyzer.simulate.events import PROFILER_STEP_PREFIX, Category, Phase, Role, TracedRun
from analyzer.simulate.simulation import Simulation, simulate
from analyzer.simulate.snapshot_writer import write_snapshot
from analyzer.simulate.tracer import Tracer
from analyzer.simulate.truth import truth_dict, truth_path, write_truth

ModelFn = Callable[[], torch.nn.Module]
BatchFn = Callable[[int], Any]
OptimizerFn = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class TrainingLoop:
    """The user's functions; only model_fn, batch_fn and optimizer_fn are required."""

    model_fn: ModelFn
    batch_fn: BatchFn
    optimizer_fn: OptimizerFn
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    save_fn: Callable[[torch.nn.Module, torch.optim.Optimizer], Any] | None = None
    micro_batches: int = 1
    autocast: torch.dtype | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _call_model(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", output)    # a transformers ModelOutput carries its loss
    assert isinstance(loss, torch.Tensor), "the model (or loss_fn) returns the loss"
    return loss


def _autocast(loop: TrainingLoop) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=loop.autocast) if loop.autocast is not None else contextlib.nullcontext()


def _attribute_states(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Tensors an optimizer holds outside `state` (a custom optimizer's `self.m = [...]`), each with the
    parameter it belongs to when the container says so (a list as long as the parameters, a dict keyed by them)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = {id(p) for p in params}
    found: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def walk(value: Any, owner: torch.Tensor | None, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in ids:
                found.append((value, owner))
        elif depth < 3 and isinstance(value, (list, tuple)):
            aligned = len(value) == len(params)
            for i, item in enumerate(value):
                walk(item, params[i] if aligned else owner, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for k, item in value.items():
                walk(item, k if isinstance(k, torch.Tensor) and id(k) in ids else owner, depth + 1)

    for name, value in vars(optimizer).items():
        if name not in ("state", "param_groups", "defaults") and not name.startswith("_"):
            walk(value, None, 0)
    return found


def _wrapped(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers this one wraps (a ZeRO optimizer's Adam over its shards)."""
    return [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)]


def _wrapped_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What wrapped optimizers update: a shard's gradient (ZeRO-2's reduce-scatter) is a gradient too."""
    return [p for inner in _wrapped(optimizer) for group in inner.param_groups for p in group["params"]]


def mark_optimizer_state(tracer: Tracer, optimizer: torch.optim.Optimizer) -> None:
    """Every tensor the optimizer keeps, and those of an optimizer it wraps (a ZeRO optimizer's Adam over its
    shards). A view of a parameter that it holds (its shard) stays the parameter it is."""
    for state_param, state in optimizer.state.items():
        tracer.mark(_tensors(state), Role.OPTIMIZER_STATE.value, tracer.owner(state_param))
    for tensor, owner in _attribute_states(optimizer):
        if tracer.role_of(tensor) not in (Role.OPTIMIZER_STATE, Role.PARAMETER):
            tracer.mark([tensor], Role.OPTIMIZER_STATE.value, tracer.owner(owner) if owner is not None else None)
    for inner in _wrapped(optimizer):
        mark_optimizer_state(tracer, inner)


def _train_step(tracer: Tracer, loop: TrainingLoop, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                step: int) -> None:
    """One iteration: forward and backward per micro-batch, the optimizer step, zero_grad. Its locals (batch,
    output, loss) live as in a loop body: a micro-batch's until the next one rebinds them, the last one's
    through the optimizer step, until the function returns."""
    for _ in range(loop.micro_batches):
        with tracer.in_phase(Phase.OTHER):
            batch = loop.batch_fn(step)
        tracer.mark(_tensors(batch), Category.INPUT.value)
        with tracer.in_phase(Phase.FORWARD), _autocast(loop):
            if loop.loss_fn is None:
                loss = _loss_of(_call_model(model, batch))
            else:
                inputs, targets = batch
                loss = loop.loss_fn(_call_model(model, inputs), targets)
            if loop.micro_batches > 1:
                loss = loss / loop.micro_batches
        with tracer.in_phase(Phase.BACKWARD):
            loss.backward()
        for param in [*model.parameters(), *_wrapped_parameters(optimizer)]:
            if param.grad is not None:
                tracer.mark([param.grad], Role.GRADIENT.value, tracer.owner(param))
    with tracer.in_phase(Phase.OPTIMIZER):
        optimizer.step()
    tracer.mark_parameters(model)
    mark_optimizer_state(tracer, optimizer)
    optimizer.zero_grad(set_to_none=True)


def trace_training(loop: TrainingLoop, steps: int = 3, fake: bool = False, stacks: str = "python") -> TracedRun:
    """Run the loop for `steps` iterations on the CPU and return every allocation, free and annotation;
    `stacks` is what `_record_memory_history(stacks=...)` would record ("python" or "all"). It runs from the top
    level of a script (`python train.py`), which every stack a real recording keeps reaches."""
    tracer = Tracer(fake=fake, stacks=stacks)
    exec(_SCRIPT, {"tracer": tracer, "train": _Training(loop, steps)})   # a constant script, not input
    tracer.run.steps = steps
    return tracer.run


#: the training script's top level: the recorded stacks' outermost frame, `train.py:2 <module>`
_SCRIPT = compile("with tracer:\n    model, optimizer = train(tracer)\n", "train.py", "exec")


@dataclass
class _Training:
    loop: TrainingLoop
    steps: int

    def __call__(self, tracer: Tracer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Load, then train `steps` steps (and save where the loop does), as the script's main code; the model
        and optimizer are returned to the script, which keeps them past the recording as a real one does."""
        loop = self.loop
        with tracer.in_phase(Phase.LOAD):
            model = loop.model_fn()
        tracer.watch_model(model)
        optimizer = loop.optimizer_fn(model.parameters())
        mark_optimizer_state(tracer, optimizer)      # states an optimizer makes eagerly, in its constructor
        for step in range(1, self.steps + 1):
            tracer.step = step
            with torch.autograd.profiler.record_function(f"{PROFILER_STEP_PREFIX}{step}"):
                _train_step(tracer, loop, model, optimizer, step)
        if loop.save_fn is not None:
            with tracer.in_phase(Phase.CHECKPOINT_SAVE):
                gathered = loop.save_fn(model, optimizer)
            del gathered
        return model, optimizer


def simulate_to_files(run: TracedRun, out: Path, gpu_memory: int | None, settings: AllocatorSettings,
                      scenario: str, findings: dict[str, Any] | None = None) -> Simulation:
    """Replay the trace on the device, write `out` (the snapshot pickle) and `<name>.truth.json` beside it."""
    simulation = simulate(run, gpu_memory, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_snapshot(simulation.snapshot(), out)
    write_truth(truth_dict(simulation, scenario=scenario, gpu_memory=gpu_memory, steps=run.steps,
                           findings=findings or {}), truth_path(out))
    return simulation


def run(model_fn: ModelFn, batch_fn: BatchFn, optimizer_fn: OptimizerFn, *, gpu_memory: int | None,
        out: str | Path, steps: int = 3, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        save_fn: Callable[[torch.nn.Module, torch.optim.Optimizer], Any] | None = None,
        expandable_segments: bool = False, max_split_size: int | None = None, fake: bool = False,
        stacks: str = "python") -> Simulation:
    """Trace `steps` training steps of the user's model on the CPU and write the snapshot a GPU with
    `gpu_memory` bytes would have produced (plus its ground-truth sidecar). `fake=True` traces under
    FakeTensorMode: no memory is used, so configurations far larger than the CPU's memory can be simulated.
    `stacks="all"` records C++ and CPython frames interleaved with the Python ones, as torch's default does.
    """
    loop = TrainingLoop(model_fn, batch_fn, optimizer_fn, loss_fn, save_fn)
    settings = AllocatorSettings(expandable_segments=expandable_segments, max_split_size=max_split_size)
    return simulate_to_files(trace_training(loop, steps, fake, stacks), Path(out), gpu_memory, settings,
                             scenario="user")
