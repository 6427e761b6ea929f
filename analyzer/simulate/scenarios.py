"""Built-in workloads, each built to show one way training runs out of GPU memory (or, for `healthy`, not).

Each is a GPT training loop with a device size and allocator settings; all are traced under FakeTensorMode,
so sizes are those of real training runs while the CPU only does the bookkeeping. `claim` is the finding a
detector should reach from the snapshot alone; the sidecar's `measures` give the numbers behind it.

`ZOO_SCENARIOS` are the zoo's cases (simulate/zoo.py: transformers and PEFT models, custom optimizers, compile,
accumulation, autocast), traced on real small CPU tensors; they need transformers and peft installed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from analyzer.simulate.allocator import AllocatorSettings
from analyzer.simulate.gpt import GPT, Block as GPTBlock, GPTConfig
from analyzer.simulate.runner import TrainingLoop, simulate_to_files, trace_training
from analyzer.simulate.simulation import Simulation

GiB = 1 << 30


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-4, foreach=True)   # foreach: the default on CUDA


def _tokens(config: GPTConfig, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, config.vocab, (batch, seq)), torch.randint(0, config.vocab, (batch, seq))


def gpt_loop(config: GPTConfig, batch: int, seq_lens: list[int],
             model: Callable[[GPTConfig], torch.nn.Module] = GPT, **hooks: Any) -> TrainingLoop:
    """A plain training loop; step N (1-based) uses seq_lens[(N - 1) % len(seq_lens)]."""
    return TrainingLoop(model_fn=lambda: model(config),
                        batch_fn=lambda step: _tokens(config, batch, seq_lens[(step - 1) % len(seq_lens)]),
                        optimizer_fn=_adam, **hooks)


def gather_full_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What an unsharded "consolidate then save" does: a copy of every parameter and optimizer state, on the GPU."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in optimizer.state.values()]}


class LossLogger:
    """The training loss plus a logged metric; `leaky` keeps each metric with its autograd graph in a list."""

    def __init__(self, leaky: bool) -> None:
        self.leaky = leaky
        self.history: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        if self.leaky:
            confidence = logits.softmax(-1).amax(-1).mean()   # forgot .item(): the graph keeps the softmax alive
            self.history.append(confidence)
        else:
            with torch.no_grad():
                self.history = [logits.softmax(-1).amax(-1).mean()]
        return loss


def _keep_output(module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
    _cache_of(module).append(output)   # `self.cache.append(x)`: nothing ever clears the list


def probed_gpt(config: GPTConfig) -> GPT:
    """A GPT whose MLPs keep their hidden activations on the module, as probing and feature-extraction code
    does with a forward hook; every step's activations stay alive after backward has freed the rest."""
    model = GPT(config)
    for block in model.layers:
        assert isinstance(block, GPTBlock)
        # torch's stubs type Module.__setattr__'s value as Tensor | Module; any other value is a plain attribute
        block.mlp.fc.cache = []  # type: ignore[assignment]
        block.mlp.fc.register_forward_hook(_keep_output)
    return model


def _cache_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The list `probed_gpt` hangs on a module (torch's stubs type an undeclared attribute as Tensor | Module)."""
    cache = module.cache
    assert isinstance(cache, list)
    return cache


@dataclass(frozen=True)
class Scenario:
    name: str
    claim: str
    loop: Callable[[], TrainingLoop]
    gpu_memory: int
    settings: AllocatorSettings = field(default_factory=AllocatorSettings)
    steps: int = 3
    fake: bool = True                         # traced under FakeTensorMode (the zoo traces real tensors)
    facts: dict[str, Any] = field(default_factory=dict)   # written into the truth's findings


_SMALL = GPTConfig(d_model=768, layers=6, heads=12, max_seq=2048)
_WIDE = GPTConfig(d_model=2048, layers=8, heads=16, max_seq=512)
_MEDIUM = GPTConfig(d_model=1024, layers=12, heads=16, max_seq=1024)
_FRAGMENTING = GPTConfig(d_model=1024, layers=8, heads=16, max_seq=2048)
_FRAGMENT_LENS = [1024, 640, 1536]

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("gpt_activation_peak", "activations dominate the peak (long sequence, attention scores b·h·s²)",
             lambda: gpt_loop(_SMALL, batch=8, seq_lens=[2048]), gpu_memory=40 * GiB),
    Scenario("adam_first_step", "the first optimizer.step() creates Adam's two fp32 states lazily: a spike at "
             "step 1 that later steps do not repeat", lambda: gpt_loop(_WIDE, batch=4, seq_lens=[256]),
             gpu_memory=40 * GiB),
    Scenario("checkpoint_gather", "gathering the full state dict on the GPU for saving spikes above the training peak",
             lambda: gpt_loop(_WIDE, batch=4, seq_lens=[256], save_fn=gather_full_state_dict), gpu_memory=40 * GiB),
    Scenario("fragmentation", "out of memory although free plus cached memory exceeds the request: variable-length "
             "batches left only blocks smaller than it", lambda: gpt_loop(_FRAGMENTING, batch=8, seq_lens=_FRAGMENT_LENS),
             gpu_memory=22 * GiB),
    Scenario("capacity_oom", "the batch is too large for the device: out of memory in the forward pass",
             lambda: gpt_loop(_MEDIUM, batch=32, seq_lens=[1024]), gpu_memory=24 * GiB),
    Scenario("expandable", "the fragmentation workload with expandable_segments:True: pages are mapped and unmapped, "
             "no out of memory", lambda: gpt_loop(_FRAGMENTING, batch=8, seq_lens=_FRAGMENT_LENS),
             gpu_memory=22 * GiB, settings=AllocatorSettings(expandable_segments=True)),
    Scenario("leak", "memory grows every step: a logged metric is kept with its autograd graph",
             lambda: gpt_loop(_SMALL, batch=8, seq_lens=[512], loss_fn=LossLogger(leaky=True)), gpu_memory=24 * GiB,
             steps=6),
    Scenario("activation_cache", "memory grows every step: each MLP keeps its hidden activation on the module "
             "(`self.cache.append(x)` in a forward hook)",
             lambda: gpt_loop(_SMALL, batch=8, seq_lens=[512], model=probed_gpt), gpu_memory=24 * GiB, steps=6),
    Scenario("healthy", "the leak scenario's loop without the leak: memory is flat from step 2 on",
             lambda: gpt_loop(_SMALL, batch=8, seq_lens=[512], loss_fn=LossLogger(leaky=False)), gpu_memory=24 * GiB,
             steps=6),
]}


def _zoo_scenarios() -> dict[str, Scenario]:
    from analyzer.simulate.zoo import ZOO

    return {name: Scenario(name, case.claim, case.loop, gpu_memory=8 * GiB, steps=case.steps, fake=False,
                           facts={"model": case.model_facts()})
            for name, case in ZOO.items()}


ZOO_SCENARIOS: dict[str, Scenario] = _zoo_scenarios()
ALL_SCENARIOS: dict[str, Scenario] = {**SCENARIOS, **ZOO_SCENARIOS}


def generate(name: str, out: Path, stacks: str = "python") -> Simulation:
    """Trace the scenario and write the snapshot to `out` and its ground truth beside it (`.truth.json`);
    `stacks` as `_record_memory_history(stacks=...)`: "python" or "all" (C++ and CPython frames too)."""
    scenario = ALL_SCENARIOS[name]
    if not scenario.fake:
        from analyzer.simulate.zoo import available

        if not available():
            raise ModuleNotFoundError(f"scenario {name} needs transformers and peft (pip install transformers peft)")
    run = trace_training(scenario.loop(), scenario.steps, fake=scenario.fake, stacks=stacks)
    findings = {"claim": scenario.claim, **scenario.facts}
    if stacks != "python":
        findings["stacks"] = stacks
    return simulate_to_files(run, out, scenario.gpu_memory, scenario.settings, scenario=name, findings=findings)
