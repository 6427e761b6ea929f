"""When a Megatron-style job does not fit: the cheapest layouts that do, over the levers Megatron has (the
distributed optimizer, sequence parallelism, selective then full recompute, TP inside a node, PP, CP for long
sequences (from 8192 tokens), EP for a mixture of experts, a smaller micro-batch at the same global batch), and, when no layout of the GPUs given fits, the fewest GPUs (doubling)
at which one does.

Cost is a rough order of what each lever takes from throughput, as practitioners rank them: the distributed
optimizer and sequence parallelism are nearly free (0.5 each), selective recompute costs a few percent (1), TP
adds all-reduces inside a node (1 + log2 TP), PP adds a bubble (2 + log2 PP), full recompute a forward pass (4),
CP exchanges keys and values (2 + log2 CP), EP all-to-alls the tokens (1 + log2 EP), each halving of the
micro-batch smaller matmuls (1). The cheapest fitting layout is the plan; ties go to the
lower per-GPU bytes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from analyzer.errors import AnalyzerError
from analyzer.estimate.config import TrainingConfig
from analyzer.estimate.device import Device
from analyzer.estimate.result import training_estimate

NODE_GPUS = 8
COSTS = {"distributed_optimizer": 0.5, "sequence_parallel": 0.5, "selective": 1.0, "full": 4.0, "micro_batch": 1.0}
ALTERNATIVES = 3
MAX_SCALE = 64          # search up to 64 × the GPUs given
LONG_SEQUENCE = 8192    # context parallelism is searched from this sequence length


@dataclass(frozen=True)
class Layout:
    config: TrainingConfig
    cost: float
    needed: int
    changes: tuple[str, ...]

    def json(self) -> dict[str, Any]:
        c = self.config
        return {"changes": list(self.changes), "cost": self.cost, "device_bytes_needed": self.needed,
                "gpus": c.gpus, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "dp": c.dp,
                "sequence_parallel": c.sequence_parallel,
                "distributed_optimizer": c.distributed_optimizer, "recompute": c.recompute,
                "micro_batch": c.micro_batch}


def _degrees(limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= limit]


def layouts(base: TrainingConfig, gpus: int, device: Device) -> list[Layout]:
    """Every valid layout of `gpus` GPUs reachable with the levers, with its cost and bytes."""
    found = []
    micro = sorted({max(base.micro_batch // 2**k, 1) for k in range(0, int(math.log2(base.micro_batch)) + 1)},
                   reverse=True)
    global_batch = base.global_batch or base.micro_batch * base.dp
    contexts = _degrees(gpus) if base.seq >= LONG_SEQUENCE else [base.cp]
    experts = _degrees(min(gpus, base.moe.experts)) if base.moe is not None else [base.ep]
    for tp, pp, cp, ep in itertools.product(_degrees(min(NODE_GPUS, gpus)), _degrees(gpus), contexts, experts):
        if gpus % (tp * pp * cp):
            continue
        for optimizer, sp, recompute, b in itertools.product(
                sorted({base.distributed_optimizer, True}), sorted({base.sequence_parallel, tp > 1}),
                dict.fromkeys((base.recompute, "selective", "full")), micro):
            config = replace(base, gpus=gpus, tp=tp, pp=pp, cp=cp, ep=ep, vp=1, distributed_optimizer=optimizer,
                             sequence_parallel=sp, recompute=recompute, micro_batch=b,
                             global_batch=global_batch, first_stage_layers=None, last_stage_layers=None)
            try:
                config.check()
            except AnalyzerError:
                continue
            if optimizer and not base.distributed_optimizer and config.dp * config.cp == 1 and config.expert_dp == 1:
                continue                    # nothing to shard over: the same layout, dearer
            changes, cost = _changes(base, config)
            found.append(Layout(config, cost, training_estimate(config, device)["device_bytes_needed"], changes))
    return found


def _changes(base: TrainingConfig, c: TrainingConfig) -> tuple[tuple[str, ...], float]:
    changes, cost = [], 0.0
    if c.distributed_optimizer and not base.distributed_optimizer:
        changes.append("distributed optimizer")
        cost += COSTS["distributed_optimizer"]
    if c.tp != base.tp:
        changes.append(f"TP {c.tp}")
        cost += 1 + math.log2(c.tp) if c.tp > 1 else 0.0
    if c.sequence_parallel and not base.sequence_parallel:
        changes.append("sequence parallel")
        cost += COSTS["sequence_parallel"]
    if c.pp != base.pp:
        changes.append(f"PP {c.pp}")
        cost += 2 + math.log2(c.pp) if c.pp > 1 else 0.0
    if c.cp != base.cp:
        changes.append(f"CP {c.cp}")
        cost += 2 + math.log2(c.cp) if c.cp > 1 else 0.0
    if c.ep != base.ep:
        changes.append(f"EP {c.ep}")
        cost += 1 + math.log2(c.ep) if c.ep > 1 else 0.0
    if c.recompute != base.recompute:
        changes.append(f"{c.recompute} recompute")
        cost += COSTS[c.recompute]
    if c.micro_batch != base.micro_batch:
        changes.append(f"micro-batch {c.micro_batch}")
        cost += COSTS["micro_batch"] * math.log2(base.micro_batch / c.micro_batch)
    if c.gpus != base.gpus:
        changes.insert(0, f"{c.gpus} GPUs")
    return tuple(changes), cost


def plan(base: TrainingConfig, device: Device) -> dict[str, Any]:
    """The cheapest fitting layouts on the GPUs given, else on the fewest GPUs that hold one."""
    assert device.memory is not None
    gpus = base.gpus
    while gpus <= base.gpus * MAX_SCALE:
        fitting = sorted((lay for lay in layouts(base, gpus, device) if lay.needed <= device.memory),
                         key=lambda lay: (lay.cost, lay.needed))
        if fitting:
            best = fitting[0]
            others = [f for f in fitting[1:] if not set(best.changes) <= set(f.changes)]   # not the plan plus more
            return {"fits": True, "gpus": gpus, "more_gpus": gpus != base.gpus,
                    "layout": best.json(), "alternatives": [f.json() for f in others[:ALTERNATIVES]]}
        gpus *= 2
    return {"fits": False, "gpus": None, "more_gpus": True, "layout": None, "alternatives": []}
