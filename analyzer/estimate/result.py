"""A training estimate as `analyze estimate` reports it: every pipeline stage's bytes by part, the most loaded
stage, the stage a measurement comes from, what the card loses outside PyTorch's allocator, and whether it fits.
"""
from __future__ import annotations

from typing import Any

from analyzer.core.units import gib
from analyzer.estimate.config import TrainingConfig
from analyzer.estimate.device import Device, outside_allocator
from analyzer.estimate.training import PARTS, stages, total_parameters


def layout(c: TrainingConfig) -> dict[str, Any]:
    return {"tp": c.tp, "pp": c.pp, "vp": c.vp, "cp": c.cp, "ep": c.ep, "etp": c.expert_tp, "dp": c.dp,
            "sequence_parallel": c.sequence_parallel,
            "distributed_optimizer": c.distributed_optimizer or c.zero >= 1, "zero": c.zero,
            "recompute": c.recompute, "precision": c.precision, "gradient_bytes": c.grad_bytes,
            "micro_batch": c.micro_batch, "micro_batches": c.micro_batches, "seq": c.seq,
            "padded_vocab": c.padded_vocab, "ffn": c.ffn_width, "query_groups": c.groups,
            "experts": c.moe.experts if c.moe else None, "top_k": c.moe.top_k if c.moe else None}


def training_estimate(c: TrainingConfig, device: Device) -> dict[str, Any]:
    """The JSON of a training estimate; `fits` counts what is outside the allocator too."""
    found = stages(c, device)
    busiest = max(found, key=lambda s: s.per_gpu_bytes)
    outside = outside_allocator(c, busiest.per_gpu_bytes)
    needed = busiest.per_gpu_bytes + sum(outside.values())
    return {"model": "megatron", "params": total_parameters(c), "gpus": c.gpus, "layout": layout(c),
            "stages": [s.json() for s in found], "most_loaded_stage": busiest.stage,
            # Megatron's CI logs the last global rank, which is on the last stage
            "measured_stage": found[-1].stage, "per_gpu_bytes": busiest.per_gpu_bytes,
            "outside_allocator": outside, "outside_allocator_bytes": sum(outside.values()),
            "device_bytes_needed": needed, "gpu_memory_bytes": device.memory,
            "fits": None if device.memory is None else needed <= device.memory}


def render_training(result: dict[str, Any]) -> str:
    """The estimate in a few lines: the layout, every stage (the most loaded marked), the outside, the verdict."""
    lay = result["layout"]
    parallel = (f"TP {lay['tp']} × PP {lay['pp']}" + (f" (VP {lay['vp']})" if lay["vp"] > 1 else "")
                + f" × CP {lay['cp']} × DP {lay['dp']}" + (f", EP {lay['ep']} (expert TP {lay['etp']})"
                                                          if lay["experts"] else ""))
    lines = [f"{result['params'] / 1e9:.3g}B parameters on {result['gpus']} GPU(s): {parallel}; "
             f"{lay['precision']}, gradients {lay['gradient_bytes']} bytes, "
             + ("distributed optimizer" if lay["distributed_optimizer"] else "optimizer not sharded")
             + f", recompute {lay['recompute']}, {lay['micro_batches']} micro-batch(es) of {lay['micro_batch']}"]
    for stage in result["stages"]:
        marks = [m for m, on in (("most loaded", stage["stage"] == result["most_loaded_stage"]),
                                 ("what the last rank measures", stage["stage"] == result["measured_stage"]
                                  and len(result["stages"]) > 1)) if on]
        parts = ", ".join(f"{part.replace('_', ' ')} {gib(stage[part])}" for part in PARTS)
        flight = stage["in_flight_micro_batches"]
        lines.append(f"  stage {stage['stage']} ({stage['layers']} layers, {flight:g} "
                     f"micro-batch{'' if flight == 1 else 'es'} in flight): {gib(stage['per_gpu_bytes'])} = {parts}"
                     + (f"  <- {', '.join(marks)}" if marks else ""))
    outside = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in result["outside_allocator"].items())
    lines.append(f"Outside max_memory_allocated (estimated): {gib(result['outside_allocator_bytes'])} = {outside}")
    lines.append(f"Needs {gib(result['device_bytes_needed'])} per GPU on the most loaded stage")
    if result["fits"] is not None:
        lines[-1] += (f": {'fits' if result['fits'] else 'does NOT fit'} in {gib(result['gpu_memory_bytes'])}.")
    if result.get("plan") is not None:
        lines += render_plan(result["plan"])
    return "\n".join(lines)


def render_plan(found: dict[str, Any]) -> list[str]:
    """The cheapest layout that fits, and a few a little dearer."""
    if not found["fits"]:
        return ["No layout fits even on 64 times the GPUs: a smaller model, offload or parameter-efficient "
                "fine-tuning."]
    def line(lay: dict[str, Any]) -> str:
        shape = (f"TP {lay['tp']} × PP {lay['pp']}" + (f" × CP {lay['cp']}" if lay["cp"] > 1 else "")
                 + f" × DP {lay['dp']}" + (f", EP {lay['ep']}" if lay["ep"] > 1 else "")
                 + (", sequence parallel" if lay["sequence_parallel"] else "")
                 + (", distributed optimizer" if lay["distributed_optimizer"] else "")
                 + f", recompute {lay['recompute']}, micro-batch {lay['micro_batch']}")
        return f"{shape}: {gib(lay['device_bytes_needed'])} per GPU (changes: {', '.join(lay['changes']) or 'none'})"
    head = (f"No layout of these GPUs fits; the fewest that hold one: {found['gpus']} GPUs." if found["more_gpus"]
            else "Cheapest layout that fits:")
    return [head, f"  {line(found['layout'])}"] + (["A little dearer:"] if found["alternatives"] else []) + [
        f"  - {line(alt)}" for alt in found["alternatives"]]
