"""How close `analyze estimate`'s formulas come to what a recording shows, category by category.

A `Workload` is what the estimator is told about a run: the model's sizes and how it is trained. For a
simulated run it is read off the training code itself (the model, the batches and the optimizer are built on
the meta device and measured: parameter count, layers, width, heads, vocabulary, micro-batch, sequence,
attention kernel, checkpointing, precision, optimizer), for a real recording from what `shared/real/truth.json`
states about it. `estimate` applies the formulas of `analyzer.diagnose.theory` to it; `compare` puts the
estimate beside the truth at the peak (the simulator's sidecar, or truth.json) and what the analysis of the
recording attributes, and gives the relative error of each category.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analyzer.core.vocabulary import Category, Role
from analyzer.diagnose import theory
from analyzer.pipeline import analyze
from analyzer.result import Analysis

PARAMETER, GRADIENT, OPTIMIZER = Role.PARAMETER.value, Role.GRADIENT.value, Role.OPTIMIZER_STATE.value
ACTIVATION, TOTAL = Category.ACTIVATION.value, "total"
CATEGORIES = (PARAMETER, GRADIENT, OPTIMIZER, ACTIVATION, TOTAL)
#: a category under this share of the peak is judged in bytes (within this share of the peak), not relatively
EMPTY_TOLERANCE = 0.01


@dataclass(frozen=True)
class Shape:
    """A GPT-style transformer's sizes (what the activation terms need)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    flash: bool            # fused attention (scaled_dot_product_attention) rather than written out
    checkpointing: bool    # every layer under full activation checkpointing
    dropout: bool


@dataclass(frozen=True)
class Workload:
    """What the estimator is told: parameter counts, precision regime, optimizer, sharding and, where known,
    the transformer's shape."""

    name: str
    params: float
    trainable: float
    precision: str                 # theory.PRECISIONS
    optimizer: str | None          # theory.OPTIMIZERS; None: one the formulas do not know
    training: bool = True
    foreach: bool = False          # torch.optim's foreach step: a parameter-sized temporary list (sqrt(v))
    zero: int = 0
    gpus: int = 1
    accumulation: int = 1          # micro-batches per optimizer step: gradients live through the next forward
    persistent_gradients: bool = False   # gradients kept between steps (DDP buckets, no set_to_none)
    bytes_per_value: int = 4       # of the activations
    shape: Shape | None = None
    source: str = ""               # where the facts come from


def estimate(w: Workload, output_layer: bool = True, peak: bool = True, inside_layers: bool = True
             ) -> dict[str, float | None]:
    """The estimate of each category at the estimated peak; None where the workload does not say enough.
    Without `output_layer` the terms after the last layer are left out, without `peak` the total is every
    model state plus the activations (as `analyze estimate` sums them), without `inside_layers` the moments
    inside a layer's backward are not considered: the fixes can be measured one by one."""
    optimizer = w.optimizer or "none"
    states = theory.model_states(w.params, w.precision, optimizer if w.training else "none", w.zero, w.gpus,
                                 w.trainable if w.training else 0.0)
    # foreach's temporary is as large as the optimizer's part of the parameters (ZeRO-1 on: its shard)
    shard = w.trainable / (w.gpus if w.zero >= 1 else 1)
    step_temporaries = theory.foreach_step_bytes(shard, w.precision) if w.foreach else 0.0
    s = w.shape
    if s is None or w.optimizer is None:   # no activations: the states as at the optimizer step, all live
        known = w.optimizer is not None or not w.training
        return {PARAMETER: states.parameters, GRADIENT: states.gradients if known else None,
                OPTIMIZER: states.optimizer if known else None, ACTIVATION: None, TOTAL: None}
    activations = theory.activation_bytes(s.layers, s.micro_batch, s.seq, s.hidden, s.heads, w.bytes_per_value,
                                          s.checkpointing, flash_attention=s.flash, dropout=s.dropout)
    recomputing = 0.0
    if s.checkpointing and peak:   # the recomputed layer is live only after the loss's memory is freed
        recomputing = activations
        activations -= theory.layer_activation_bytes(s.micro_batch, s.seq, s.hidden, s.heads, w.bytes_per_value,
                                                     flash=s.flash, dropout=s.dropout)
    loss = 0.0
    if output_layer:
        activations += theory.output_layer_bytes(s.micro_batch, s.seq, s.hidden, s.vocab, w.bytes_per_value)
        loss = theory.loss_backward_bytes(s.micro_batch, s.seq, s.vocab)
    kept = w.persistent_gradients or w.accumulation > 1
    at = (theory.training_peak(states, activations, loss, gradients_kept=kept, step_temporaries=step_temporaries,
                               recomputing=recomputing,
                               others=_layer_backward(w, states, kept) if inside_layers else ()) if peak else
          theory.Peak("sum", states.parameters, states.gradients, states.optimizer, activations, loss))
    return {PARAMETER: at.parameters, GRADIENT: at.gradients, OPTIMIZER: at.optimizer, ACTIVATION: at.activations,
            TOTAL: at.total}


def _layer_backward(w: Workload, states: theory.ModelStates, gradients_kept: bool) -> tuple[theory.Peak, ...]:
    """The moments inside written-out attention's backward: in the last layer (every earlier layer's activations,
    or under checkpointing their inputs, with the gradients of the output layer and of the layer's MLP and
    projection, v·h + 9·h² parameters) and, checkpointed, in the first (every gradient but the first layer's and
    the embeddings'). Fused attention makes no s x s gradients: none."""
    s = w.shape
    if s is None or s.flash:
        return ()
    b, h, bpv = s.micro_batch, s.hidden, w.bytes_per_value
    core, temporaries = theory.attention_backward_bytes(b, s.seq, h, s.heads, bpv)
    per_parameter = states.gradients / w.trainable if w.trainable else 0.0   # gradient bytes (ZeRO-2: a shard)

    def grads(parameters: float) -> float:
        return states.gradients if gradients_kept else per_parameter * max(parameters, 0.0)

    last_layer = s.vocab * h + 9 * h * h
    if not s.checkpointing:
        earlier = (s.layers - 1) * theory.layer_activation_bytes(b, s.seq, h, s.heads, bpv, flash=False,
                                                                  dropout=s.dropout)
        return (theory.Peak("layer backward", states.parameters, grads(last_layer), states.optimizer, earlier + core,
                            temporaries),)
    inputs = s.seq * b * h * bpv
    first_layer = w.trainable - 12 * h * h - (s.vocab + s.seq) * h
    return (theory.Peak("layer backward", states.parameters, grads(last_layer), states.optimizer,
                        (s.layers - 1) * inputs + core, temporaries),
            theory.Peak("layer backward", states.parameters, grads(first_layer), states.optimizer, core, temporaries))


@dataclass
class Row:
    """One recording: the estimate, the truth at the peak and the analysis's attribution, by category."""

    workload: Workload
    truth: dict[str, int | None]
    analysis: dict[str, int | None]
    peak: int | None                          # the true peak (for judging an estimate of an empty category)
    estimate: dict[str, float | None] = field(default_factory=dict)
    modelled: str = ""                        # why the estimator does not model this peak ("" when it does)

    def error(self, category: str) -> float | None:
        """(estimate - truth) / truth; None where either is unknown or the truth is (nearly) empty."""
        est, true = self.estimate.get(category), self.truth.get(category)
        if est is None or true is None or self._small(true):
            return None
        return (est - true) / true

    def empty_miss(self, category: str) -> bool | None:
        """Where the truth is that (almost) nothing of the category is live, under 1% of the peak: is the estimate
        more than 1% of the peak away from it? None where the truth is not that small."""
        est, true = self.estimate.get(category), self.truth.get(category)
        if est is None or true is None or not self._small(true):
            return None
        return abs(est - true) > EMPTY_TOLERANCE * (self.peak or 0)

    def _small(self, true: int) -> bool:
        return true == 0 or true < EMPTY_TOLERANCE * (self.peak or 0)


def compare(workload: Workload, truth: dict[str, int | None], analysis: dict[str, int | None], peak: int | None,
            modelled: str = "", estimator: Callable[[Workload], dict[str, float | None]] = estimate) -> Row:
    return Row(workload, truth, analysis, peak, estimator(workload), modelled)


# ---- simulated runs ---------------------------------------------------------------------------------------
def truth_at_peak(truth: dict[str, Any]) -> dict[str, int | None]:
    """The simulator's truth at the peak, in the estimator's categories (buffers are not parameters here)."""
    at = truth["measures"]["peak_by_category"]
    return {PARAMETER: at.get(PARAMETER, 0), GRADIENT: at.get(GRADIENT, 0), OPTIMIZER: at.get(OPTIMIZER, 0),
            ACTIVATION: at.get(ACTIVATION, 0), TOTAL: truth["measures"]["peak_allocated_bytes"]}


def attributed_at_peak(analysis: Analysis, device: int | None = None) -> dict[str, int | None]:
    """What the analysis puts in each category at the peak (of `device`, else the device with the highest)."""
    devices = analysis.devices
    d = (next(x for x in devices if x.device == device) if device is not None
         else max(devices, key=lambda x: x.peak.allocated_bytes))
    measured = {r["name"]: int(r["bytes"]) for r in d.by_category}
    return {PARAMETER: measured.get(PARAMETER, 0), GRADIENT: measured.get(GRADIENT, 0),
            OPTIMIZER: measured.get(OPTIMIZER, 0), ACTIVATION: measured.get(ACTIVATION, 0),
            TOTAL: d.peak.allocated_bytes}


def measure_simulated(snapshot: Path) -> tuple[dict[str, int | None], dict[str, int | None], int]:
    """Truth and analysis at the peak of a simulated snapshot with its `.truth.json` beside it."""
    truth = json.loads(snapshot.with_name(snapshot.stem + ".truth.json").read_text(encoding="utf-8"))
    analysis = analyze(snapshot)
    assert isinstance(analysis, Analysis)
    return truth_at_peak(truth), attributed_at_peak(analysis, truth["device"]), truth["measures"]["peak_allocated_bytes"]


def unmodelled(truth: dict[str, Any], leaks: bool) -> str:
    """Why a simulated run's peak is not the steady training peak the formulas describe ("" when it is)."""
    if truth.get("oom"):
        return "out of memory before the step ended"
    if truth["measures"]["peak_phase"] == "checkpoint_save":
        return "the peak is a checkpoint save"
    return "memory kept across steps (the scenario's bug)" if leaks else ""


def workload_of(name: str, loop: Any, steps: int, zero: int = 0, gpus: int = 1, source: str = "") -> Workload:
    """The workload of a simulator `TrainingLoop`, read off its objects built on the meta device (nothing is
    allocated, nothing runs): the parameters and which train, the optimizer, the batches; the shape where the
    model is the scenarios' GPT (`analyzer.simulate.gpt`), none for other models (the zoo's transformers)."""
    import torch

    from analyzer.simulate.gpt import GPT, Attention
    from analyzer.simulate.remedy_runs import CheckpointedBlock, FusedAttention

    with torch.device("meta"):
        model = loop.model_fn()
        optimizer = loop.optimizer_fn(model.parameters())
        batches = [loop.batch_fn(step) for step in range(1, steps + 1)]
    params = list(model.parameters())
    inputs = [b["input_ids"] if isinstance(b, dict) else b[0] if isinstance(b, (tuple, list)) else b for b in batches]
    inner = getattr(optimizer, "inner", optimizer)            # ZeRO's sharded Adam wraps torch's
    shape = None
    if isinstance(model, GPT):
        block = model.layers[0]
        assert isinstance(block.attn, Attention)
        shape = Shape(layers=len(model.layers), hidden=model.embed.embedding_dim, heads=block.attn.heads,
                      vocab=model.embed.num_embeddings, seq=max(int(x.shape[1]) for x in inputs),
                      micro_batch=int(inputs[0].shape[0]), flash=isinstance(block.attn, FusedAttention),
                      checkpointing=isinstance(block, CheckpointedBlock),
                      dropout=any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))
    return Workload(name, params=sum(p.numel() for p in params),
                    trainable=sum(p.numel() for p in params if p.requires_grad),
                    precision="fp32" if params[0].dtype == torch.float32 else "bf16",
                    optimizer=_optimizer_kind(optimizer, inner), foreach=inner.defaults.get("foreach") is True,
                    zero=zero, gpus=gpus, accumulation=loop.micro_batches, bytes_per_value=params[0].element_size(),
                    shape=shape, source=source)


def _optimizer_kind(optimizer: Any, inner: Any) -> str | None:
    from analyzer.simulate.remedy_runs import Adam8bit

    name = type(inner).__name__.lower()
    if isinstance(optimizer, Adam8bit):
        return "adam_8bit"
    if "adam" in name:
        return "adam"
    if "sgd" in name:
        return "sgd_momentum" if inner.defaults.get("momentum") else "sgd"
    return None


# ---- real recordings ----------------------------------------------------------------------------------------
#: truth.json's words for an optimizer, first match wins (lower case): (any of these, all of these, the kind);
#: None: one the formulas do not have (a zeroth-order method has no gradients either)
_OPTIMIZER_WORDS: tuple[tuple[tuple[str, ...], tuple[str, ...], str | None], ...] = (
    (("zeroth-order",), (), None), (("never", "not used", "none"), (), "none"), ((), ("sgd", "momentum"), "sgd_momentum"),
    (("adam",), (), "adam"))
_DTYPE_WEIGHT_BYTES = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16"}   # a precision with those weight bytes


def optimizer_kind(text: str) -> str | None:
    """The optimizer truth.json describes in words, as one of theory.OPTIMIZERS ("none": no state)."""
    lower = text.lower()
    for any_of, all_of, kind in _OPTIMIZER_WORDS:
        if (not any_of or any(w in lower for w in any_of)) and all(w in lower for w in all_of):
            return kind
    return None


def real_workload(name: str, truth: dict[str, Any]) -> Workload | None:
    """The workload truth.json states for a real recording: parameter count, weight dtype, optimizer, workload;
    None where it does not give them. Its shape is not stated there, so activations are not estimated."""
    precision = _DTYPE_WEIGHT_BYTES.get(str(truth.get("param_dtype") or "").split(" ")[0])
    if not truth.get("params") or precision is None or truth.get("workload") is None:
        return None
    sources = truth.get("sources") or []
    training = truth["workload"] == "training"
    return Workload(name, params=float(truth["params"]),
                    trainable=(truth.get("trainable_param_bytes") or 0) / theory.PRECISIONS[precision][0] if training else 0.0,
                    precision=precision, optimizer=optimizer_kind(str(truth.get("optimizer") or "")),
                    training=training, gpus=int(truth.get("gpus") or 1),
                    bytes_per_value=theory.PRECISIONS[precision][0], source=sources[0] if sources else "truth.json")


def real_truth(truth: dict[str, Any]) -> dict[str, int | None]:
    """The categories truth.json gives at the peak (None where it does not)."""
    def get(key: str) -> int | None:
        value = truth.get(key)
        return None if value is None else int(value)

    return {PARAMETER: get("param_bytes"), GRADIENT: get("grad_bytes_at_peak"),
            OPTIMIZER: get("optimizer_state_bytes_at_peak"), ACTIVATION: get("activation_bytes_at_peak_file"),
            TOTAL: get("peak_bytes_file") if isinstance(truth.get("peak_bytes_file"), int) else None}


# ---- the headline ---------------------------------------------------------------------------------------------
def summary(rows: Iterable[Row]) -> dict[str, dict[str, float | int | None]]:
    """Per category: how many rows are scored, the median and the largest absolute relative error, and how
    many estimates put memory where the truth has none (over 1% of the peak)."""
    import numpy as np

    rows = [r for r in rows if not r.modelled]
    out: dict[str, dict[str, float | int | None]] = {}
    for category in CATEGORIES:
        errors = [abs(e) for r in rows if (e := r.error(category)) is not None]
        misses = [m for r in rows if (m := r.empty_miss(category)) is not None]
        out[category] = {"scored": len(errors), "median": float(np.median(errors)) if errors else None,
                         "max": max(errors) if errors else None, "empty": len(misses), "empty_missed": sum(misses)}
    return out
