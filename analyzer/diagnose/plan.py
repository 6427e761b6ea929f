"""The cheapest combination of remedies whose predicted peak fits: a search over the remedy lattice in the
method's cost order (USER-STORIES.md "Fix order"), for when one change is not enough.

A lever is one variable practitioners change (micro-batch with accumulation, precision, checkpointing, the
optimizer, the ZeRO stage, the tensor and pipeline degrees, offload); its levels run cheapest first, the first
being the run as it is (cost 0). A configuration takes one level of each lever and costs the sum of its
levels' costs (`COST`, in the method's order). The lattice is small (thousands of configurations), so every
valid one is predicted by the caller's formula and the cheapest that fits is the plan, ties going to the lower
peak. The plan makes its changes one at a time, cheapest first, each step with the peak predicted after it:
only the last step fits, since a fitting prefix would be a cheaper configuration. The alternatives are the
next cheapest fitting configurations that are not the plan with more changes added, each with what it costs.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALTERNATIVES = 3   # fitting configurations shown after the plan

# the cost of each change in the method's order: the batch first (each halving), precision, checkpointing,
# the optimizer's memory and ZeRO-1, then ZeRO-2/3, tensor and pipeline parallelism, offload last
COST = {"micro_batch": 1.0, "bf16": 1.5, "selective_checkpointing": 2.0, "activation_checkpointing": 3.0,
        "zero1": 4.0, "optimizer_8bit": 4.5, "zero2": 5.0, "adafactor": 5.5, "zero3": 6.0, "optimizer_offload": 7.0,
        "tensor_parallel": 8.0, "pipeline_parallel": 8.5, "expandable_segments": 0.5, "offload": 12.0}
# what each change costs beside memory: (throughput, communication, code)
PRICE = {
    "micro_batch": ("smaller matmuls, k accumulation steps per optimizer step", "none",
                    "divide the batch, accumulate k micro-batches (same global batch)"),
    "bf16": ("faster on tensor cores", "halved gradient traffic", "torch.autocast(dtype=torch.bfloat16)"),
    "selective_checkpointing": ("about 5% more compute (attention recomputed)", "none",
                                "checkpoint the attention core only (Megatron --recompute-granularity selective)"),
    "activation_checkpointing": ("about 20-30% more compute (one more forward)", "none",
                                 "torch.utils.checkpoint around each block"),
    "optimizer_8bit": ("none measurable", "none", "bitsandbytes AdamW8bit (a new dependency)"),
    "adafactor": ("none measurable", "none", "Adafactor (may need learning-rate tuning)"),
    "optimizer_offload": ("optimizer step on the CPU, bounded by PCIe", "gradients and weights over PCIe each step",
                          "DeepSpeed offload_optimizer"),
    "zero1": ("about as data parallel", "as data parallel (reduce-scatter + all-gather)",
              "ZeroRedundancyOptimizer / DeepSpeed stage 1"),
    "zero2": ("about as data parallel", "as data parallel (reduce-scatter + all-gather)",
              "FSDP SHARD_GRAD_OP / DeepSpeed stage 2"),
    "zero3": ("parameters gathered per layer", "1.5x data parallel (all-gather in forward and backward)",
              "FSDP fully_shard / DeepSpeed stage 3"),
    "tensor_parallel": ("smaller matmuls per GPU", "2 all-reduces of activations per layer, forward and backward "
                        "(inside a node)", "model code changes (parallelize_module)"),
    "pipeline_parallel": ("pipeline bubble: (p-1)/(m+p-1) of the step idle with m micro-batches",
                          "activations point to point between stages", "split the model into stages "
                          "(torch.distributed.pipelining)"),
    "expandable_segments": ("none measurable", "none", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    "offload": ("large slowdown, bounded by PCIe", "weights over PCIe every step", "FSDP CPUOffload / ZeRO-Infinity"),
}


@dataclass(frozen=True)
class Level:
    """One level of a lever: the remedy it is (its id), in words, its cost, and its value (k, stage, degree)."""

    id: str
    title: str
    cost: float
    value: Any = None

    def price(self) -> dict[str, str]:
        throughput, communication, code = PRICE.get(self.id, ("", "", ""))
        if self.value is not None:
            throughput = throughput.replace("k ", f"{self.value} ").replace(
                "(p-1)/(m+p-1)", f"{self.value - 1}/(m+{self.value - 1})")
        return {"throughput": throughput, "communication": communication, "code": code}


@dataclass(frozen=True)
class Lever:
    name: str
    levels: tuple[Level, ...]   # levels[0] is the run as it is


AS_IS = Level("as_is", "as it is", 0.0)
Config = dict[str, Level]       # lever name -> the level chosen
Predict = Callable[[Config], tuple[int, bool]]   # (predicted peak bytes, fits)


def lever(name: str, levels: list[Level], as_is: Level = AS_IS) -> Lever:
    return Lever(name, (as_is, *levels))


def changes(config: Config) -> list[Level]:
    """The levels a configuration changes, cheapest first: the order its steps are taken in."""
    return sorted((level for level in config.values() if level.cost > 0), key=lambda level: level.cost)


def search(levers: list[Lever], predict: Predict, valid: Callable[[Config], bool] = lambda c: True,
           ) -> list[tuple[float, int, Config]]:
    """Every valid configuration that fits, as (cost, predicted peak, configuration), cheapest first."""
    fitting = []
    for choice in itertools.product(*(lv.levels for lv in levers)):
        config = {lv.name: level for lv, level in zip(levers, choice)}
        if not valid(config) or not changes(config):
            continue
        peak, fits = predict(config)
        if fits:
            fitting.append((sum(level.cost for level in choice), peak, config))
    fitting.sort(key=lambda item: (item[0], item[1]))
    return fitting


def _more_of(later: Config, earlier: Config) -> bool:
    """`later` is `earlier` with more changes: on every lever `earlier` moves, `later` is there or further."""
    return all(later[name].cost >= level.cost for name, level in earlier.items() if level.cost > 0)


def distinct(fitting: list[tuple[float, int, Config]], limit: int) -> list[tuple[float, int, Config]]:
    """The cheapest fitting configurations none of which is an earlier one with more changes added."""
    out: list[tuple[float, int, Config]] = []
    for item in fitting:
        if any(_more_of(item[2], earlier[2]) for earlier in out):
            continue
        out.append(item)
        if len(out) == limit:
            break
    return out


def steps(config: Config, as_is: Config) -> list[tuple[Level, Config]]:
    """Each change of `config` with the configuration after it, one variable at a time, cheapest first."""
    out, current = [], dict(as_is)
    for level in changes(config):
        name = next(n for n, chosen in config.items() if chosen is level)
        current = {**current, name: level}
        out.append((level, dict(current)))
    return out


def step_json(level: Level, peak: int, reserved: int | None, fits: bool, source: str) -> dict[str, Any]:
    return {"remedy": level.id, "title": level.title, "value": level.value, "predicted_peak_allocated_bytes": peak,
            "predicted_peak_reserved_bytes": reserved, "fits": fits, "source": source, "cost": level.price()}


def alternative_json(config: Config, cost: float, peak: int, plan_cost: float) -> dict[str, Any]:
    made = changes(config)
    return {"remedies": [level.id for level in made], "titles": [level.title for level in made],
            "predicted_peak_allocated_bytes": peak, "extra_cost": round(cost - plan_cost, 2),
            "cost": {level.id: level.price() for level in made}}
