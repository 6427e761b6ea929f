"""`analyze estimate`: will this training configuration fit, before renting the GPUs?

    analyze estimate --params 7e9 --gpus 8 --zero 2 --micro-batch 32 --seq 2048 --layers 32 --hidden 4096 \\
        --heads 32 --gpu-memory 80GiB [--checkpointing] [--format json]

With Megatron-LM's layout (a model_config.yaml, a Hugging Face config.json, or any of the parallel flags), the
estimate is analyzer.estimate's, per pipeline stage:

    analyze estimate --megatron-config model_config.yaml --gpus 8 --gpu-memory 80GiB [--tp 2 --pp 4 ...]
    analyze estimate --hf-config config.json --seq 4096 --micro-batch 1 --gpus 8 --tp 8 --distributed-optimizer

Sizes need their unit: 80GiB is 80 × 2^30 bytes (what an "80 GB" A100 or H100 holds), 80GB is 80 × 10^9 bytes
(74.5 GiB); a bare 80 is refused. Without --gpus the job is one GPU and no sharding is listed at that count.

Model states follow the ZeRO paper (16Ψ for Adam, mixed precision or fp32 with --precision), activations
Korthikanti et al. (with dropout unless --no-dropout; the final norm, fp32 log-probabilities and the loss's
backward temporaries when --vocab is given). When the
configuration does not fit, the plan is the cheapest combination of changes that does (analyzer.diagnose.plan:
micro-batch with accumulation, checkpointing selective or full, the optimizer, ZeRO stage, tensor and pipeline
degree, offload), one change a step with the per-GPU bytes after it, and the alternatives a little dearer.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from analyzer.core.units import gib, parse_bytes, parse_count
from analyzer.core.vocabulary import RemedyId
from analyzer.diagnose import plan as lattice
from analyzer.diagnose.plan import BUSY_TOKENS, SMALL_HALVING, Config, Level
from analyzer.diagnose.remedies import BY_ID, REMEDIES
from analyzer.diagnose.theory import PRECISIONS, activation_bytes, loss_backward_bytes, model_states, output_layer_bytes
from analyzer.diagnose.thresholds import Thresholds
from analyzer.errors import AnalyzerError
from analyzer.estimate.config import MoE, TrainingConfig, read_hf_config, read_megatron_config, with_layout
from analyzer.estimate.device import Device
from analyzer.estimate.inference import CACHE_BYTES, DEFAULT_UTILIZATION, inference_estimate, render_inference, serving
from analyzer.estimate.result import render_training, training_estimate
from analyzer.estimate.search import plan as layout_plan

OVERHEAD = 0.10   # CUDA context, workspaces and fragmentation: keep this share of the device free
NODE_GPUS = 8     # tensor parallelism stays inside a node
# the optimizer lever's levels as theory.OPTIMIZERS names them (the bytes each keeps per parameter are there)
OPTIMIZER_KINDS = {"adam": "adam", **{r.id.value: r.estimate_term.optimizer for r in REMEDIES
                                      if r.estimate_term is not None and r.estimate_term.optimizer is not None}}
REGIMES = {"mixed": "mixed-precision Adam", "fp32": "fp32 Adam"}


@dataclass
class Shape:
    """The transformer's shape, when given: what the activation term needs."""

    micro_batch: int
    seq: int
    layers: int
    hidden: int
    heads: int
    flash_attention: bool = True
    dropout: bool = True
    vocab: int | None = None          # the output layer's terms, when known
    bytes_per_value: int = 2          # 4 when training in fp32

    def activations(self, checkpointing: bool, micro_batch: int | None = None, layers: int | None = None) -> float:
        """The layers' activations, and the output layer's when the vocabulary is known."""
        b = micro_batch or self.micro_batch
        kept = activation_bytes(self.layers if layers is None else layers, b, self.seq, self.hidden, self.heads,
                                self.bytes_per_value, checkpointing=checkpointing,
                                flash_attention=self.flash_attention, dropout=self.dropout)
        return kept + (output_layer_bytes(b, self.seq, self.hidden, self.vocab, self.bytes_per_value)
                       if self.vocab else 0.0)

    def loss_temporaries(self, micro_batch: int | None = None) -> float:
        """Cross-entropy's backward temporaries, live with every activation at the start of backward."""
        return loss_backward_bytes(micro_batch or self.micro_batch, self.seq, self.vocab) if self.vocab else 0.0


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
             checkpointing: bool, precision: str = "mixed", thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """The per-GPU memory of a configuration; `gpus` None means one GPU, not given. Every model state counts
    with the activations, gradients too: DDP's buckets and ZeRO's partitions hold them through the step. The
    plan's micro-batch costs follow `thresholds.busy_tokens`."""
    given = gpus is not None
    gpus = gpus or 1
    states_total = model_states(params, precision).total
    per_gpu_states = model_states(params, precision, zero=zero, gpus=gpus).total
    shape_known = shape is not None
    acts = shape.activations(checkpointing) if shape else 0.0
    loss = shape.loss_temporaries() if shape else 0.0
    usable = None if gpu_memory is None else gpu_memory * (1 - OVERHEAD)
    per_gpu = per_gpu_states + acts + loss
    result: dict[str, Any] = {
        "params": params, "gpus": gpus, "gpus_given": given, "zero": zero, "precision": precision,
        "model_states_bytes": int(states_total), "model_states_per_gpu_bytes": int(per_gpu_states),
        "activation_bytes": int(acts), "loss_backward_bytes": int(loss),
        "activations_known": shape_known, "per_gpu_bytes": int(per_gpu), "gpu_memory_bytes": gpu_memory,
        "usable_bytes": None if usable is None else int(usable),
        "fits": None if usable is None else per_gpu <= usable,
    }
    if usable is not None:
        result["options"] = options(params, gpus, zero, acts + loss, usable, shape, checkpointing, given, precision)
        result["plan"] = None if result["fits"] else plan(params, gpus if given else 1, zero, usable, shape,
                                                           checkpointing, precision, thresholds.busy_tokens)
    return result


@dataclass(frozen=True)
class Layout:
    """One configuration of the job, as the formulas need it."""

    micro_batch: int          # per GPU; accumulation keeps the global batch
    accumulation: int
    checkpointing: str        # none | selective | full
    optimizer: str            # adam | optimizer_8bit | adafactor | optimizer_offload
    zero: int
    tp: int
    pp: int
    offload: bool             # parameters (and all model states) on the CPU
    precision: str = "mixed"  # mixed | fp32


def per_gpu_bytes(params: float, gpus: int, shape: Shape | None, job: Layout) -> float:
    """Model states and activations on the busiest GPU (the first pipeline stage). Each tensor-and-pipeline
    shard holds Ψ/(tp·pp) parameters; ZeRO shards its states over the data-parallel degree gpus/(tp·pp): 2Ψ
    16-bit weights (stage 3), 2Ψ gradients (stage 2+), the optimizer's bytes (stage 1+). Offload keeps the
    gathered 16-bit weights of two layers (the one computing and the one prefetched). Activations per layer:
    Korthikanti et al. with the tensor degree (selective checkpointing drops the attention scores, full keeps
    each layer's 2·s·b·h input plus one layer recomputed); under 1F1B the first stage holds min(pp, m) of the
    m micro-batches in flight, each for layers/pp layers; the output layer and the loss's temporaries (with
    the vocabulary) are the last stage's, so counted without pipeline stages only, and under full checkpointing
    they are freed before the first layer is recomputed: the larger of the two counts."""
    dp = max(gpus // (job.tp * job.pp), 1)
    psi = params / (job.tp * job.pp)
    if job.offload:
        assert shape is not None  # offload is offered with a shape only
        states = 2 * PRECISIONS[job.precision][0] * psi * job.pp / shape.layers
    else:
        states = model_states(psi, job.precision, OPTIMIZER_KINDS[job.optimizer], job.zero, dp).total
    if shape is None:
        return states
    layers = shape.layers // job.pp
    in_flight = min(job.pp, job.accumulation)
    bpv = shape.bytes_per_value
    layer = activation_bytes(1, job.micro_batch, shape.seq, shape.hidden, shape.heads, bpv, tensor_parallel=job.tp,
                             flash_attention=shape.flash_attention, dropout=shape.dropout,
                             selective=job.checkpointing == "selective")
    tail = 0.0 if job.pp > 1 else (shape.activations(False, job.micro_batch, layers=0)
                                    + shape.loss_temporaries(job.micro_batch))
    if job.checkpointing == "full":   # the recomputed layer comes after the output layer's memory is freed
        return states + in_flight * layers * shape.seq * job.micro_batch * shape.hidden * bpv + max(layer, tail)
    return states + in_flight * layers * layer + tail


_ZERO = (RemedyId.ZERO1, RemedyId.ZERO2, RemedyId.ZERO3)


def _level(remedy: str, value: int | None = None, extra_cost: float = 0.0, **words: int) -> Level:
    """The remedy as a level of this lattice: its estimate term's words and cost (analyzer.diagnose.remedies),
    at a value (k micro-batches, N GPUs, ZeRO stage), `extra_cost` more."""
    term = BY_ID[remedy].estimate_term
    assert term is not None   # only remedies with an estimate term are levels here
    return Level(str(remedy), term.title.format(k=value, **words), term.cost + extra_cost, value)


def _micro_batch_level(shape: Shape, k: int, busy_tokens: int = BUSY_TOKENS) -> Level:
    """Accumulation over k micro-batches of 1/k the size (the global batch kept): each halving costs the term's
    cost while the micro-batch keeps `busy_tokens` tokens, SMALL_HALVING below, said in words with its tokens."""
    level = _level(RemedyId.MICRO_BATCH, k, b=shape.micro_batch // k)
    free = max(1.0, shape.micro_batch * shape.seq / busy_tokens)     # the division that still keeps busy_tokens
    cost = level.cost * math.log2(min(k, free)) + SMALL_HALVING * math.log2(max(k / free, 1.0))
    tokens = shape.micro_batch // k * shape.seq
    busy = ("keep the matmuls large" if tokens >= busy_tokens
            else f"make smaller matmuls (under {busy_tokens:,}: lower throughput)")
    return replace(level, cost=cost,
                   throughput=f"micro-batches of {tokens:,} tokens {busy}, k accumulation steps per optimizer step (the same global batch)")


def _degrees(n: int, limit: int) -> list[int]:
    return [d for d in (2, 4, 8, 16, 32, 64) if d <= limit and n % d == 0]


def plan(params: float, gpus: int, zero: int, usable: float, shape: Shape | None,
         checkpointing: bool, precision: str = "mixed", busy_tokens: int = BUSY_TOKENS) -> dict[str, Any]:
    """The cheapest combination of changes whose per-GPU bytes fit in `usable`, from the configuration given (a
    micro-batch of `busy_tokens` tokens or more keeps the matmuls large: halving to it is cheap)."""
    as_is = Level("as_is", "as given", 0.0)
    levers = []
    if shape is not None:
        levers.append(lattice.lever("micro_batch", [
            _micro_batch_level(shape, k, busy_tokens) for k in range(2, shape.micro_batch + 1)
            if shape.micro_batch % k == 0], as_is))
        levels = [] if checkpointing else [_level(RemedyId.ACTIVATION_CHECKPOINTING)]
        if not shape.flash_attention and not checkpointing:   # fused attention keeps no scores to drop
            levels.insert(0, _level(RemedyId.SELECTIVE_CHECKPOINTING))
        levers.append(lattice.lever("checkpointing", levels, as_is))
    levers.append(lattice.lever("optimizer", [_level(r) for r in OPTIMIZER_KINDS if r != "adam"], as_is))
    if gpus > 1:
        levers.append(lattice.lever("zero", [_level(z, stage) for stage, z in enumerate(_ZERO, 1) if stage > zero],
                                    as_is))
        heads = shape.heads if shape is not None else NODE_GPUS
        levers.append(lattice.lever("tp", [
            _level(RemedyId.TENSOR_PARALLEL, t, math.log2(t) - 1) for t in _degrees(heads, min(gpus, NODE_GPUS))
            if gpus % t == 0], as_is))
        if shape is not None:
            levers.append(lattice.lever("pp", [
                _level(RemedyId.PIPELINE_PARALLEL, p, math.log2(p) - 1) for p in _degrees(shape.layers, gpus)
                if gpus % p == 0], as_is))
    if shape is not None:
        levers.append(lattice.lever("offload", [_level(RemedyId.OFFLOAD)], as_is))

    def layout(config: Config) -> Layout:
        k = config["micro_batch"].value if "micro_batch" in config and config["micro_batch"].value else 1
        ckpt = {RemedyId.ACTIVATION_CHECKPOINTING.value: "full", RemedyId.SELECTIVE_CHECKPOINTING.value: "selective"}.get(
            config["checkpointing"].id if "checkpointing" in config else "", "full" if checkpointing else "none")
        optimizer = config["optimizer"].id if config["optimizer"].id in OPTIMIZER_KINDS else "adam"
        level = config.get("zero")
        return Layout(micro_batch=(shape.micro_batch // k) if shape else 1, accumulation=k, checkpointing=ckpt,
                      optimizer=optimizer, zero=level.value if level is not None and level.value else zero,
                      tp=(config["tp"].value or 1) if "tp" in config else 1,
                      pp=(config["pp"].value or 1) if "pp" in config else 1,
                      offload=bool("offload" in config and config["offload"].id == RemedyId.OFFLOAD), precision=precision)

    def valid(config: Config) -> bool:
        job = layout(config)
        if job.tp * job.pp > gpus or gpus % (job.tp * job.pp):
            return False
        dp = gpus // (job.tp * job.pp)
        if job.zero > zero and dp == 1:
            return False      # nothing to shard over
        return not job.offload or ((job.zero == 3 or dp == 1) and job.optimizer == "adam")

    def predict(config: Config) -> tuple[int, bool]:
        peak = per_gpu_bytes(params, gpus, shape, layout(config))
        return int(peak), peak <= usable

    fitting = lattice.search(levers, predict, valid)
    searched = math.prod(len(lv.levels) for lv in levers)
    if not fitting:
        return {"fits": False, "steps": [], "alternatives": [], "searched": searched}
    cost, _, best = fitting[0]
    start = {lv.name: lv.levels[0] for lv in levers}
    predicted = [(level, *predict(after)) for level, after in lattice.steps(best, start)]
    return {"fits": True, "steps": [lattice.step_json(level, peak, None, fits, "formula") for level, peak, fits in predicted],
            "alternatives": [lattice.alternative_json(c, alt_cost, peak, cost)
                             for alt_cost, peak, c in lattice.distinct(fitting, lattice.ALTERNATIVES + 1)[1:]],
            "searched": searched}


def options(params: float, gpus: int, zero: int, acts: float, usable: float, shape: Shape | None,
            checkpointing: bool, gpus_given: bool = True, precision: str = "mixed") -> list[dict[str, Any]]:
    """What would fit: ZeRO stages at this GPU count (when more than one was given: ZeRO on one GPU shards
    nothing), then states that shrink, then more GPUs, then the activation term (checkpointing, a smaller
    micro-batch) at the cheapest sharding that leaves room."""
    rows = []
    sharded = gpus_given and gpus > 1
    for stage in (0, 1, 2, 3) if sharded else (0,):
        states = model_states(params, precision, zero=stage, gpus=gpus).total
        rows.append(_option(f"ZeRO-{stage} on {gpus} GPUs" if stage else
                            (f"no sharding ({gpus} GPUs, data parallel)" if sharded else "one GPU, no sharding"),
                            states, acts, usable))
    at = f"ZeRO-3 on {gpus} GPUs" if sharded else "one GPU"
    total = model_states(params, precision).total
    # weights, gradients, the fp32 master (mixed precision) and int8 moments; then the weights and gradients alone
    rows.append(_option(f"8-bit optimizer states, {at}", model_states(params, precision, "adam_8bit").total / gpus,
                        acts, usable))
    rows.append(_option(f"optimizer state offloaded to CPU, {at}", model_states(params, precision, "offloaded").total
                        / gpus, acts, usable))
    rows.append(_option("parameter-efficient fine-tuning (LoRA: frozen 16-bit weights, ~1% trainable)",
                        (2 * params + 16 * 0.01 * params) / gpus, acts, usable))
    room = usable - acts
    if room > 0:
        needed = math.ceil(total / room)
        rows.append({"option": f"ZeRO-3 on {needed} GPUs", "per_gpu_bytes": int(total / needed + acts),
                     "fits": True, "gpus_needed": needed})
    if shape is not None:
        states = model_states(params, precision, zero=zero, gpus=gpus).total
        loss = shape.loss_temporaries()
        if not checkpointing:
            rows.append(_option(f"activation checkpointing, ZeRO-{zero} on {gpus} GPU{'s' if gpus > 1 else ''}", states,
                                shape.activations(True) + loss, usable))
        if shape.micro_batch > 1:
            rows.append(_option(f"micro-batch 1 with gradient accumulation x{shape.micro_batch} and activation "
                                f"checkpointing, ZeRO-{zero} on {gpus} GPU{'s' if gpus > 1 else ''}", states,
                                shape.activations(True, 1) + shape.loss_temporaries(1), usable))
    return rows


def _option(name: str, states: float, acts: float, usable: float) -> dict[str, Any]:
    return {"option": name, "per_gpu_bytes": int(states + acts), "fits": states + acts <= usable}


def render(result: dict[str, Any]) -> str:
    psi = result["params"]
    k = result["model_states_bytes"] / psi
    lines = [f"Model states ({REGIMES[result.get('precision', 'mixed')]}, {k:.0f}Ψ): {k:.0f} × {psi / 1e9:g}B = "
             f"{result['model_states_bytes'] / 1e9:.1f} GB ({gib(result['model_states_bytes'])})",
             (f"Per GPU at ZeRO-{result['zero']} on {result['gpus']} GPU(s): model states " if result.get("gpus_given", True)
              else "On one GPU (no --gpus given): model states ")
             + f"{gib(result['model_states_per_gpu_bytes'])}"
             + (f" + activations {gib(result['activation_bytes'])}" if result["activations_known"] else
                " (activations not estimated: give --micro-batch --seq --layers --hidden --heads)")
             + f" = {gib(result['per_gpu_bytes'])}"]
    if result["fits"] is not None:
        lines.append(f"{'Fits' if result['fits'] else 'Does NOT fit'} in {gib(result['usable_bytes'])} usable of "
                     f"{gib(result['gpu_memory_bytes'])} ({OVERHEAD:.0%} kept for the CUDA context and fragmentation).")
        if result.get("plan") is not None:
            lines += render_plan(result["plan"])
            lines.append("Each change alone:")
        for o in result.get("options", []):
            per_gpu = "" if o["per_gpu_bytes"] is None else f"{gib(o['per_gpu_bytes'])} per GPU, "
            verdict = "" if o["fits"] is None else ("fits" if o["fits"] else "does not fit")
            lines.append(f"  - {o['option']}: {per_gpu}{verdict}".rstrip(", "))
    return "\n".join(lines)


def render_plan(found: dict[str, Any]) -> list[str]:
    """The plan's steps, one change each with the per-GPU bytes after it, then the alternatives and their costs."""
    if not found["fits"]:
        return [f"No combination of the changes searched fits ({found['searched']} configurations): more GPUs, "
                "a smaller model or parameter-efficient fine-tuning."]
    lines = ["Plan, cheapest first (one change a step; stop at the first that fits):"]
    for i, step in enumerate(found["steps"], 1):
        lines.append(f"  {i}. {step['title']}: {gib(step['predicted_peak_allocated_bytes'])} per GPU, "
                     + ("fits" if step["fits"] else "does not fit yet") + f" ({_costs(step['cost'])})")
    if found["alternatives"]:
        lines.append("Also fitting, at least as dear:")
    planned = {step["title"] for step in found["steps"]}
    for alt in found["alternatives"]:
        other = [(title, alt["cost"][remedy]) for remedy, title in zip(alt["remedies"], alt["titles"], strict=True)
                 if title not in planned]
        why = "; ".join(f"{title}: {_costs(price)}" for title, price in other)
        verdict = "as cheap as the plan, with a higher peak" if alt["extra_cost"] <= 0 else "dearer than the plan"
        lines.append(f"  - {' + '.join(alt['titles'])}: {gib(alt['predicted_peak_allocated_bytes'])} per GPU; "
                     f"{verdict}, for {why}")
    return lines


def _costs(price: dict[str, str]) -> str:
    """What a change takes beside memory, in words: throughput and communication (when any)."""
    return price["throughput"] + ("" if price["communication"] == "none" else f", {price['communication']}")


RECOMPUTE = ("none", "selective", "full")
LAYOUT_FLAGS = ("megatron_config", "hf_config", "tp", "pp", "vp", "cp", "ep", "etp", "sequence_parallel",
                "distributed_optimizer", "recompute", "experts", "dtype")


def _megatron_requested(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in LAYOUT_FLAGS)


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The job from a config file, or the flags alone, with the flags given overriding the file."""
    if args.megatron_config is not None:
        base = read_megatron_config(args.megatron_config, args.gpus)
    elif args.hf_config is not None:
        if not (args.seq and args.micro_batch):
            raise AnalyzerError(str(args.hf_config), "a config.json has no sequence length or micro-batch",
                                "Give --seq and --micro-batch with --hf-config.")
        base = read_hf_config(args.hf_config, args.seq, args.micro_batch, args.gpus)
    else:
        named = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads, "--seq": args.seq,
                 "--micro-batch": args.micro_batch, "--vocab": args.vocab}
        missing = [k for k, v in named.items() if not v]
        if missing:
            raise AnalyzerError(None, f"the per-stage estimate needs the model's shape: {', '.join(missing)} missing",
                                "Give them, or a --megatron-config / --hf-config.")
        base = TrainingConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                              micro_batch=args.micro_batch, vocab=args.vocab, gpus=args.gpus or 1)
    moe = base.moe
    if args.experts:
        moe = MoE(experts=args.experts, top_k=args.top_k or 2, ffn=args.moe_ffn, shared_ffn=args.shared_expert_ffn or 0,
                  capacity_factor=args.capacity_factor)
    grad = {"fp32": True, "16bit": False}.get(args.grad_dtype or "")
    zero = args.zero if args.zero else None
    config = with_layout(
        base, gpus=args.gpus, tp=args.tp, pp=args.pp, vp=args.vp, cp=args.cp, ep=args.ep, etp=args.etp,
        global_batch=args.global_batch, query_groups=args.query_groups, ffn=args.ffn, moe=moe,
        sequence_parallel=args.sequence_parallel, distributed_optimizer=args.distributed_optimizer or
        (True if zero else None), zero=zero, recompute=args.recompute, recompute_method=args.recompute_method,
        recompute_layers=args.recompute_layers, swiglu=args.swiglu, untied=args.untied, precision=args.dtype,
        fp8=args.fp8, grad_fp32=grad, micro_batch=args.micro_batch if args.megatron_config else None,
        seq=args.seq if args.megatron_config else None,
        flash_attention=None if args.attention == "flash" else False,
        hidden_dropout=0.0 if args.no_dropout else None, attention_dropout=0.0 if args.no_dropout else None)
    return config.check(str(args.megatron_config or args.hf_config or "") or None)


class EstimateCommand:
    description = __doc__

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--params", type=parse_count, help="parameter count, e.g. 7e9 or 7B (not needed with a "
                                                               "config file or the Megatron flags)")
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
        parser.add_argument("--precision", choices=tuple(REGIMES), default="mixed",
                            help="mixed: 16-bit weights and gradients, fp32 master and Adam (default); fp32: no "
                                 "master, 4-byte activations")
        parser.add_argument("--no-dropout", action="store_true",
                            help="the model trains without dropout (most LLMs): no dropout masks kept")
        parser.add_argument("--vocab", type=int, help="vocabulary size: adds the fp32 log-probabilities and the "
                                                      "loss's backward temporaries (4·s·b·v bytes each)")
        parser.add_argument("--format", choices=("text", "json"), default="text")
        megatron = parser.add_argument_group("Megatron-LM layout (any of these: the per-stage estimate)")
        megatron.add_argument("--megatron-config", type=Path, help="Megatron-LM arguments: a model_config.yaml "
                                                                   "(MODEL_ARGS: --flag: value)")
        megatron.add_argument("--hf-config", type=Path, help="a Hugging Face config.json (give --seq, --micro-batch)")
        for flag, text in (("--tp", "tensor parallel size"), ("--pp", "pipeline parallel size"),
                           ("--vp", "model chunks per pipeline stage (interleaved)"), ("--cp", "context parallel size"),
                           ("--ep", "expert parallel size"), ("--etp", "expert tensor parallel size (default: TP)"),
                           ("--global-batch", "global batch in sequences (micro-batches = it / (micro-batch × DP))"),
                           ("--query-groups", "GQA key/value groups"), ("--ffn", "FFN width"),
                           ("--experts", "MoE experts"), ("--top-k", "experts a token"), ("--moe-ffn", "an expert's FFN"),
                           ("--shared-expert-ffn", "the shared expert's FFN width"),
                           ("--recompute-layers", "layers a full-recompute chunk holds")):
            megatron.add_argument(flag, type=int, help=text)
        megatron.add_argument("--capacity-factor", type=float, help="MoE expert capacity factor (default: dropless)")
        megatron.add_argument("--sequence-parallel", action="store_true", default=None)
        megatron.add_argument("--distributed-optimizer", action="store_true", default=None,
                              help="shard the optimizer state over the data-parallel group (as --zero 1)")
        megatron.add_argument("--recompute", choices=RECOMPUTE, help="activation recompute granularity")
        megatron.add_argument("--recompute-method", choices=("uniform", "block"))
        megatron.add_argument("--swiglu", action="store_true", default=None)
        megatron.add_argument("--untied", action="store_true", default=None, help="untied input and output embeddings")
        megatron.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="training precision (default bf16)")
        megatron.add_argument("--fp8", action="store_true", default=None)
        megatron.add_argument("--grad-dtype", choices=("fp32", "16bit"),
                              help="gradient accumulation buffer (default: fp32 under bf16, as Megatron)")
        megatron.add_argument("--device", choices=("hopper", "ampere"), default="hopper",
                              help="Transformer Engine's workspace is 32 MiB on Hopper and newer, 4 MiB before")
        serve = parser.add_argument_group("Inference (--inference: --micro-batch is the batch, --seq the context)")
        serve.add_argument("--inference", action="store_true", help="serving memory: weights, KV cache, prefill")
        serve.add_argument("--kv-dtype", choices=tuple(CACHE_BYTES), default="bf16", help="the KV cache's dtype")
        serve.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION,
                           help="the share of the GPU a vLLM-style server may take (default 0.9)")
        serve.add_argument("--prefill-tokens", type=int, help="tokens a prefill computes at once (chunked "
                                                              "prefill; default: the whole batch × context)")

    def run(self, args: argparse.Namespace) -> int:
        if args.inference:
            if not 0 < args.gpu_memory_utilization <= 1:
                raise AnalyzerError(None, f"--gpu-memory-utilization {args.gpu_memory_utilization}: not a share",
                                    "Give a number in (0, 1], e.g. 0.9.")
            if args.prefill_tokens is not None and args.prefill_tokens < 1:
                raise AnalyzerError(None, f"--prefill-tokens {args.prefill_tokens}", "Give a positive token count.")
            result = inference_estimate(serving(training_config(args)), Device(device_memory(args.gpu_memory)),
                                        args.kv_dtype, args.gpu_memory_utilization, args.prefill_tokens)
            print(json.dumps(result, indent=2) if args.format == "json" else render_inference(result))
            return 0
        if _megatron_requested(args):
            config = training_config(args)
            device = Device(device_memory(args.gpu_memory), args.device == "hopper")
            result = training_estimate(config, device)
            if result["fits"] is False:
                result["plan"] = layout_plan(config, device)
            print(json.dumps(result, indent=2) if args.format == "json" else render_training(result))
            return 0
        if args.params is None:
            raise AnalyzerError(None, "--params is needed", "Give --params 7B, or a --megatron-config / --hf-config.")
        heads = args.heads or (args.hidden // 128 if args.hidden else None)
        given = (args.micro_batch, args.seq, args.layers, args.hidden, heads)
        named = {"--micro-batch": args.micro_batch, "--seq": args.seq, "--layers": args.layers, "--hidden": args.hidden}
        if any(named.values()) and not all(named.values()):
            missing = ", ".join(k for k, v in named.items() if not v)
            raise AnalyzerError(None, f"activations need the whole shape: {missing} missing",
                                "Give --micro-batch, --seq, --layers and --hidden together (--heads defaults to "
                                "hidden/128), or none of them for model states only.")
        shape = (Shape(args.micro_batch, args.seq, args.layers, args.hidden, heads,
                       flash_attention=args.attention == "flash", dropout=not args.no_dropout, vocab=args.vocab,
                       bytes_per_value=PRECISIONS[args.precision][0])
                 if heads is not None and all(given) else None)
        result = estimate(args.params, args.gpus, args.zero, device_memory(args.gpu_memory), shape, args.checkpointing,
                          args.precision)
        print(json.dumps(result, indent=2) if args.format == "json" else render(result))
        return 0
