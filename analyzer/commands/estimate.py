"""`analyze estimate`: will this training configuration fit, before renting the GPUs?

    analyze estimate --params 7e9 --gpus 8 --zero 2 --micro-batch 32 --seq 2048 --layers 32 --hidden 4096 \\
        --heads 32 --gpu-memory 80GiB [--checkpointing] [--format json]

Sizes need their unit: 80GiB is 80 × 2^30 bytes (what an "80 GB" A100 or H100 holds), 80GB is 80 × 10^9 bytes
(74.5 GiB); a bare 80 is refused. Without --gpus the job is one GPU and no sharding is listed at that count.

Model states follow the ZeRO paper (16Ψ for mixed-precision Adam), activations Korthikanti et al. When the
configuration does not fit, it lists what does, with per-GPU numbers.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from analyzer.core.units import gib, parse_bytes, parse_count
from analyzer.diagnose.theory import activation_bytes, model_states_bytes
from analyzer.errors import AnalyzerError

OVERHEAD = 0.10   # CUDA context, workspaces and fragmentation: keep this share of the device free


@dataclass
class Shape:
    """The transformer's shape, when given: what the activation term needs."""

    micro_batch: int
    seq: int
    layers: int
    hidden: int
    heads: int
    flash_attention: bool = True

    def activations(self, checkpointing: bool, micro_batch: int | None = None) -> float:
        return activation_bytes(self.layers, micro_batch or self.micro_batch, self.seq, self.hidden, self.heads,
                                checkpointing=checkpointing, flash_attention=self.flash_attention)


def device_memory(text: str | None) -> int | None:
    """--gpu-memory as bytes; a bare number is refused, since 80 would be 80 bytes."""
    if text is None:
        return None
    if text.strip().replace(".", "", 1).replace("e", "", 1).isdigit():
        raise AnalyzerError(None, f"--gpu-memory {text}: a size needs its unit",
                            f"Write {text}GiB (binary: an '80 GB' A100 or H100 holds 80 GiB) or {text}GB (decimal, "
                            f"10^9 bytes).")
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise AnalyzerError(None, f"--gpu-memory: {error}") from None


def estimate(params: float, gpus: int | None, zero: int, gpu_memory: int | None, shape: Shape | None,
             checkpointing: bool) -> dict[str, Any]:
    """The per-GPU memory of a configuration; `gpus` None means one GPU, not given."""
    given = gpus is not None
    gpus = gpus or 1
    states_total = model_states_bytes(params)
    per_gpu_states = model_states_bytes(params, zero, gpus)
    shape_known = shape is not None
    acts = shape.activations(checkpointing) if shape else 0.0
    usable = None if gpu_memory is None else gpu_memory * (1 - OVERHEAD)
    per_gpu = per_gpu_states + acts
    result: dict[str, Any] = {
        "params": params, "gpus": gpus, "gpus_given": given, "zero": zero, "model_states_bytes": int(states_total),
        "model_states_per_gpu_bytes": int(per_gpu_states), "activation_bytes": int(acts),
        "activations_known": shape_known, "per_gpu_bytes": int(per_gpu), "gpu_memory_bytes": gpu_memory,
        "usable_bytes": None if usable is None else int(usable),
        "fits": None if usable is None else per_gpu <= usable,
    }
    if usable is not None:
        result["options"] = options(params, gpus, zero, acts, usable, shape, checkpointing, given)
    return result


def options(params: float, gpus: int, zero: int, acts: float, usable: float, shape: Shape | None,
            checkpointing: bool, gpus_given: bool = True) -> list[dict[str, Any]]:
    """What would fit: ZeRO stages at this GPU count (when more than one was given: ZeRO on one GPU shards
    nothing), then states that shrink, then more GPUs, then the activation term (checkpointing, a smaller
    micro-batch) at the cheapest sharding that leaves room."""
    rows = []
    sharded = gpus_given and gpus > 1
    for stage in (0, 1, 2, 3) if sharded else (0,):
        states = model_states_bytes(params, stage, gpus)
        rows.append(_option(f"ZeRO-{stage} on {gpus} GPUs" if stage else
                            (f"no sharding ({gpus} GPUs, data parallel)" if sharded else "one GPU, no sharding"),
                            states, acts, usable))
    at = f"ZeRO-3 on {gpus} GPUs" if sharded else "one GPU"
    states_8bit = 2 * params + 2 * params + 4 * params + 2 * params  # fp16 params, grads, fp32 master, int8 moments
    rows.append(_option(f"8-bit optimizer states, {at}", states_8bit / gpus, acts, usable))
    rows.append(_option(f"optimizer state offloaded to CPU, {at}", 4 * params / gpus, acts, usable))
    rows.append(_option("parameter-efficient fine-tuning (LoRA: frozen 16-bit weights, ~1% trainable)",
                        (2 * params + 16 * 0.01 * params) / gpus, acts, usable))
    room = usable - acts
    if room > 0:
        needed = math.ceil(16 * params / room)
        rows.append({"option": f"ZeRO-3 on {needed} GPUs", "per_gpu_bytes": int(16 * params / needed + acts),
                     "fits": True, "gpus_needed": needed})
    if shape is not None:
        states = model_states_bytes(params, zero, gpus)
        if not checkpointing:
            rows.append(_option(f"activation checkpointing, ZeRO-{zero} on {gpus} GPU{'s' if gpus > 1 else ''}", states,
                                shape.activations(True), usable))
        if shape.micro_batch > 1:
            rows.append(_option(f"micro-batch 1 with gradient accumulation x{shape.micro_batch} and activation "
                                f"checkpointing, ZeRO-{zero} on {gpus} GPU{'s' if gpus > 1 else ''}", states,
                                shape.activations(True, 1), usable))
    return rows


def _option(name: str, states: float, acts: float, usable: float) -> dict[str, Any]:
    return {"option": name, "per_gpu_bytes": int(states + acts), "fits": states + acts <= usable}


def render(result: dict[str, Any]) -> str:
    psi = result["params"]
    lines = [f"Model states (mixed-precision Adam, 16Ψ): 16 × {psi / 1e9:g}B = {result['model_states_bytes'] / 1e9:.1f} GB "
             f"({gib(result['model_states_bytes'])})",
             (f"Per GPU at ZeRO-{result['zero']} on {result['gpus']} GPU(s): model states " if result.get("gpus_given", True)
              else "On one GPU (no --gpus given): model states ")
             + f"{gib(result['model_states_per_gpu_bytes'])}"
             + (f" + activations {gib(result['activation_bytes'])}" if result["activations_known"] else
                " (activations not estimated: give --micro-batch --seq --layers --hidden --heads)")
             + f" = {gib(result['per_gpu_bytes'])}"]
    if result["fits"] is not None:
        lines.append(f"{'Fits' if result['fits'] else 'Does NOT fit'} in {gib(result['usable_bytes'])} usable of "
                     f"{gib(result['gpu_memory_bytes'])} ({OVERHEAD:.0%} kept for the CUDA context and fragmentation).")
        for o in result.get("options", []):
            per_gpu = "" if o["per_gpu_bytes"] is None else f"{gib(o['per_gpu_bytes'])} per GPU, "
            verdict = "" if o["fits"] is None else ("fits" if o["fits"] else "does not fit")
            lines.append(f"  - {o['option']}: {per_gpu}{verdict}".rstrip(", "))
    return "\n".join(lines)


class EstimateCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--params", type=parse_count, required=True, help="parameter count, e.g. 7e9 or 7B")
        parser.add_argument("--gpus", type=int, help="GPUs the job shards over (default: one, and no sharding listed)")
        parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
        parser.add_argument("--gpu-memory", help="memory per GPU with its unit: 80GiB (an '80 GB' card) or 80GB "
                                                 "(10^9 bytes); a bare number is refused")
        parser.add_argument("--micro-batch", type=int)
        parser.add_argument("--seq", type=int)
        parser.add_argument("--layers", type=int)
        parser.add_argument("--hidden", type=int)
        parser.add_argument("--heads", type=int)
        parser.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
        parser.add_argument("--attention", choices=("flash", "eager"), default="flash",
                            help="fused attention keeps no s×s scores (default); eager does")
        parser.add_argument("--format", choices=("text", "json"), default="text")

    def run(self, args: argparse.Namespace) -> int:
        heads = args.heads or (args.hidden // 128 if args.hidden else None)
        given = (args.micro_batch, args.seq, args.layers, args.hidden, heads)
        named = {"--micro-batch": args.micro_batch, "--seq": args.seq, "--layers": args.layers, "--hidden": args.hidden}
        if any(named.values()) and not all(named.values()):
            missing = ", ".join(k for k, v in named.items() if not v)
            raise AnalyzerError(None, f"activations need the whole shape: {missing} missing",
                                "Give --micro-batch, --seq, --layers and --hidden together (--heads defaults to "
                                "hidden/128), or none of them for model states only.")
        shape = (Shape(args.micro_batch, args.seq, args.layers, args.hidden, heads,
                       flash_attention=args.attention == "flash")
                 if heads is not None and all(given) else None)
        result = estimate(args.params, args.gpus, args.zero, device_memory(args.gpu_memory), shape, args.checkpointing)
        print(json.dumps(result, indent=2) if args.format == "json" else render(result))
        return 0
