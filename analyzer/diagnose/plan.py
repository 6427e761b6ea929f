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
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from analyzer.core.vocabulary import Category
from analyzer.diagnose.counterfactual import Replayer
from analyzer.diagnose.remedies import FIT_HEADROOM, Demand, fits_as_is, gpus_for

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
        throughput, communication, code = PRICE.get(_COST_OF.get(self.id, self.id), ("", "", ""))
        if self.value is not None:
            throughput = throughput.replace("k ", f"{self.value} ").replace(
                "(p-1)/(m+p-1)", f"{self.value - 1}/(m+{self.value - 1})")
        return {"throughput": throughput, "communication": communication, "code": code}


@dataclass(frozen=True)
class Lever:
    name: str
    levels: tuple[Level, ...]   # levels[0] is the run as it is


AS_IS = Level("as_is", "as it is", 0.0)
_COST_OF = {"gradient_accumulation": "micro_batch", "weight_quantization": "bf16"}   # priced as the change it is
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
            "predicted_peak_allocated_bytes": peak, "source": "formula", "extra_cost": round(cost - plan_cost, 2),
            "cost": {level.id: level.price() for level in made}}


# ---- a recording's plan: the levers its offered remedies give, the formula on its breakdown, the replay ----

_BATCH_LEVELS = (2, 4, 8)     # micro-batches per step a batch lever tries
MAX_CANDIDATES = 3            # fitting configurations replayed before the plan is given up
_LEVERS = (("batch", ("gradient_accumulation", "micro_batch")), ("precision", ("bf16",)),
           ("checkpointing", ("activation_checkpointing",)),
           ("optimizer", ("optimizer_8bit", "adafactor", "optimizer_offload")), ("zero", ("zero1", "zero2", "zero3")),
           ("tp", ("tensor_parallel",)), ("weights", ("weight_quantization", "offload")),
           ("layout", ("expandable_segments",)))


def recording_levers(remedies: list[dict[str, Any]]) -> list[Lever]:
    """The levers a recording's offered remedies give, each remedy a level at its place in the cost order."""
    offered = {r["id"]: r for r in remedies}
    levers = []
    for name, ids in _LEVERS:
        levels: list[Level] = []
        for remedy in (i for i in ids if i in offered):
            base = COST.get(_COST_OF.get(remedy, remedy), 10.0)
            if name == "batch":
                word = "micro-batches" if remedy == "gradient_accumulation" else "the batch divided by"
                levels += [Level(remedy, f"{word} {k}" if remedy == "micro_batch" else
                                 f"gradient accumulation: {k} micro-batches of 1/{k} the size", base * (k.bit_length() - 1), k)
                           for k in _BATCH_LEVELS]
                break     # accumulation when training, the batch itself forward-only: one of them
            levels.append(Level(remedy, str(offered[remedy]["title"]), base))
        if levels:
            levers.append(lever(name, levels))
    return levers


def formula_peak(d: Demand, config: Config) -> int:
    """The peak after the configuration's changes, on the breakdown of the run's worst moment: each change
    acts on the categories as its remedy's formula says (analyzer.diagnose.remedies), one after the other."""
    c = {k: float(v) for k, v in d.by_category.items()}
    total = float(d.total)

    def shrink(category: str, factor: float) -> None:
        nonlocal total
        before = c.get(category, 0.0)
        c[category] = before * factor
        total -= before - c[category]

    for level in changes(config):
        k = level.value or 1
        if level.id in ("gradient_accumulation", "micro_batch"):
            for category in ("activation", "input", "temporary"):
                shrink(category, 1 / k)
            if level.id == "gradient_accumulation":
                kept = max(0.0, c.get("parameter", 0.0) * (1 - (d.frozen_share or 0.0)) - c.get("gradient", 0.0))
                c["gradient"] = c.get("gradient", 0.0) + kept
                total += kept
        elif level.id == "bf16":
            act = c.get("activation", 0.0)
            shrink("activation", max(0.0, 1 - max(0.0, act / 2 - c.get("parameter", 0.0) / 2) / act) if act else 1.0)
        elif level.id == "activation_checkpointing":
            act, recorded = c.get("activation", 0.0), float(d.by_category.get("activation", 0) or 1)
            saved = (d.checkpointable if d.checkpointable is not None else recorded / 2) * act / recorded
            shrink("activation", 1 - saved / act if act else 1.0)
        elif level.id in ("optimizer_8bit", "adafactor", "optimizer_offload"):
            shrink("optimizer_state", {"optimizer_8bit": 1 - 0.75 * (8 / 12 if d.mixed_precision else 1.0),
                                       "adafactor": 1 - 0.9 * (8 / 12 if d.mixed_precision else 1.0),
                                       "optimizer_offload": 0.0}[level.id])
        elif level.id in ("zero1", "zero2", "zero3"):
            n = gpus_for(d, d.bytes(Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE))[0]
            sharded = {"zero1": ("optimizer_state",), "zero2": ("optimizer_state", "gradient"),
                       "zero3": ("optimizer_state", "gradient", "parameter")}[level.id]
            for category in sharded:
                shrink(category, 1 / n)
        elif level.id == "tensor_parallel":
            t = min(d.world_size, 8) if d.world_size else 2
            for category in ("optimizer_state", "gradient", "parameter", "activation"):
                shrink(category, 1 / t)
        elif level.id == "weight_quantization":
            shrink("parameter", 0.5)
        elif level.id == "offload":
            shrink("parameter", 0.0)
            if d.workload != "forward_only":
                shrink("activation", 0.5)
    return int(round(total))


def _key(config: Config) -> tuple[tuple[str, Any], ...]:
    return tuple((level.id, level.value) for level in changes(config))


def for_recording(d: Demand, remedies: list[dict[str, Any]], replayer: Replayer | None) -> dict[str, Any] | None:
    """The plan of a run that does not fit on a known device: the cheapest configuration of its offered remedies
    whose formula fits, checked by replaying its changes composed (the formula where a change has no
    transform); the next candidate when the replay says it does not fit, up to MAX_CANDIDATES. Only the
    candidates and the plan's steps are replayed. None for a run that fits, on an unknown device, or a leak."""
    if d.capacity is None or fits_as_is(d) or d.triage == "leak" or not remedies:
        return None
    levers = recording_levers(remedies)
    capacity = d.capacity
    limit = FIT_HEADROOM * capacity
    cache: dict[tuple[tuple[str, Any], ...], tuple[int, int | None, bool, str]] = {}
    for remedy, run in d.replayed.items():     # the remedy list's replays: one change each, k = 2
        if run.get("oom") is not None and (d.world_size or not remedy.startswith("zero")):
            peak, layout = int(run["peak_allocated_bytes"]), remedy == "expandable_segments"
            value = 2 if remedy in ("gradient_accumulation", "micro_batch") else None
            cache[((remedy, value),)] = (peak, int(run["peak_reserved_bytes"]),
                                         peak <= (capacity if layout else limit) and not run["oom"], "replay")

    def predicted(config: Config) -> tuple[int, int | None, bool, str]:
        """(peak allocated, peak reserved or None, fits, source) of a configuration."""
        made = changes(config)
        key = _key(config)
        if key in cache:
            return cache[key]
        replayed = [level for level in made if replayer is not None and replayer.can(level.id, level.value)]
        if not replayed or replayer is None:
            peak = formula_peak(d, config)
            cache[key] = (peak, None, peak <= limit, "formula")
            return cache[key]
        run = replayer.run([(level.id, level.value) for level in replayed])
        only = {name: (level if level in replayed else AS_IS) for name, level in config.items()}
        formula_saving = formula_peak(d, only) - formula_peak(d, config) if len(replayed) < len(made) else 0
        peak = run.peak_allocated_bytes - formula_saving
        layout = any(level.id == "expandable_segments" for level in made)
        fits = (peak <= (capacity if layout else limit)) and not run.oom
        cache[key] = (peak, None if formula_saving else run.peak_reserved_bytes, fits,
                      "replay" if not formula_saving else "formula")
        return cache[key]

    layout_only = {"expandable_segments"}
    fitting = search(levers, lambda c: (formula_peak(d, c), formula_peak(d, c) <= (
        capacity if any(level.id in layout_only for level in changes(c)) else limit)))
    start = {lv.name: lv.levels[0] for lv in levers}
    for cost, _, config in fitting[:MAX_CANDIDATES]:
        if not predicted(config)[2]:
            continue
        out = [step_json(level, *predicted(after)) for level, after in steps(config, start)]
        refuted = {k for k, v in cache.items() if not v[2]}     # the formula said fits, the replay did not
        others = [item for item in distinct([f for f in fitting if _key(f[2]) not in refuted], ALTERNATIVES + 1)
                  if item[2] is not config][:ALTERNATIVES]
        return {"fits": True, "steps": out,
                "alternatives": [alternative_json(c, alt_cost, peak, cost) for alt_cost, peak, c in others],
                "searched": math.prod(len(lv.levels) for lv in levers),
                "replays": replayer.replays if replayer is not None else 0}
    return {"fits": False, "steps": [], "alternatives": [], "searched": math.prod(len(lv.levels) for lv in levers),
            "replays": replayer.replays if replayer is not None else 0}
