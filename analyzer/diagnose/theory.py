"""The formulas practitioners check memory against (ZeRO paper, Korthikanti et al. 2022, FlashAttention).

Model states, Ψ parameters (Rajbhandari et al. 2020, ZeRO §3.1 and §5): bytes per parameter of the weights,
their gradients and the optimizer's state depend on the precision regime and the optimizer. Mixed precision
keeps 16-bit weights and gradients and an fp32 master copy (2 + 2 + 4), fp32 training keeps 4 + 4 and no
master, pure bf16 2 + 2; Adam then adds two states (m, v), SGD with momentum one, plain SGD none, 4 bytes each
(2 in pure bf16, 1 for 8-bit Adam's quantized moments). Mixed-precision Adam is the paper's 16Ψ (K = 12), as is
fp32 Adam (4 + 4 + 8); fp32 or mixed SGD with momentum is 12Ψ, pure bf16 Adam and fp32 SGD 8Ψ. ZeRO-1 shards
the optimizer's bytes over N GPUs, ZeRO-2 the gradients too, ZeRO-3 the weights too (mixed Adam: 4Ψ + 12Ψ/N,
2Ψ + 14Ψ/N, 16Ψ/N).

Activations per transformer layer (Korthikanti et al. 2022, §4.1, no sequence parallelism): the tensors kept for
backward are 16·sbh values + 2·a·s²·b (the softmax output and its dropout output) and the dropout masks
2·sbh + a·s²·b bytes; in 16-bit that is s·b·h·(34 + 5·a·s/h) bytes. Without dropout (most LLMs today) the masks
and the dropout output go: 16·sbh + a·s²·b values. Fused attention (FlashAttention, Dao et al. 2022, §3.1 and
Algorithm 2) keeps no s×s matrix: its backward needs its output O, laid out b·s·a·d and so the projection's input
itself (counted in the 16·sbh), and the fp32 softmax statistics (a·s·b·4 bytes). With full activation checkpointing only the layer inputs stay
(sbh values per layer) plus one layer being recomputed. Outside the layers (Korthikanti §4, total activations): the final norm's
input and output (2·sbh values) and the loss's fp32 log-probabilities (4·s·b·v bytes); PyTorch's cross-entropy
backward then makes two more of that size at once (the gradients of the log-probabilities and of the logits).
"""
from __future__ import annotations

from dataclasses import dataclass

ADAM_BYTES_PER_PARAM = 16
AGREEMENT_TOLERANCE = 0.1   # measured model states agree with 16Ψ when within this share of it
#: bytes per parameter of the weights, of their gradients, of an fp32 master copy, and of one optimizer state
PRECISIONS: dict[str, tuple[int, int, int, int]] = {"mixed": (2, 2, 4, 4), "fp32": (4, 4, 0, 4), "bf16": (2, 2, 0, 2)}
#: states per parameter, the bytes of one where the optimizer fixes them (8-bit Adam's quantized moments), and
#: whether it updates an fp32 master copy under mixed precision on the GPU (no optimizer, or one offloaded to
#: the CPU: nothing there); Adafactor's factored second moment is about none
OPTIMIZERS: dict[str, tuple[int, int | None, bool]] = {
    "adam": (2, None, True), "adam_8bit": (2, 1, True), "adafactor": (0, None, True), "sgd_momentum": (1, None, True),
    "sgd": (0, None, True), "none": (0, None, False), "offloaded": (0, None, False)}
LOGITS_BYTES = 4            # the loss's log-probabilities are fp32, under autocast too (Korthikanti §4)


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU bytes of the weights, their gradients and the optimizer's state (fp32 master copy included)."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_states(params: float, precision: str = "mixed", optimizer: str = "adam", zero: int = 0, gpus: int = 1,
                 trainable: float | None = None) -> ModelStates:
    """The model states of a precision regime and optimizer at a ZeRO stage; only `trainable` parameters (all,
    unless given: LoRA trains a few) have gradients and optimizer state."""
    weight, gradient, master, state = PRECISIONS[precision]
    count, fixed, updates_master = OPTIMIZERS[optimizer]
    trained = params if trainable is None else trainable
    n = max(gpus, 1)
    return ModelStates(weight * params / (n if zero >= 3 else 1), gradient * trained / (n if zero >= 2 else 1),
                       (master * updates_master + count * (fixed or state)) * trained / (n if zero >= 1 else 1))


def model_states_bytes(params: float, zero: int = 0, gpus: int = 1) -> float:
    """Per-GPU bytes of parameters, gradients and Adam states, mixed precision, at a ZeRO stage."""
    return model_states(params, zero=zero, gpus=gpus).total


def activation_bytes(layers: int, micro_batch: int, seq: int, hidden: int, heads: int,
                     bytes_per_value: int = 2, checkpointing: bool = False, tensor_parallel: int = 1,
                     flash_attention: bool = True, dropout: bool = True, selective: bool = False) -> float:
    """Activations kept for backward by a transformer's layers (Korthikanti et al., no sequence parallelism)."""
    one_layer = layer_activation_bytes(micro_batch, seq, hidden, heads, bytes_per_value, tensor_parallel,
                                       flash_attention, dropout, selective)
    if checkpointing:
        return layers * seq * micro_batch * hidden * bytes_per_value + one_layer
    return layers * one_layer


def layer_activation_bytes(b: int, s: int, h: int, a: int, bytes_per_value: int = 2, t: int = 1,
                           flash: bool = True, dropout: bool = True, selective: bool = False) -> float:
    """One layer: the norms' inputs and the QKV and first MLP inputs (4·sbh values, whole on every tensor-parallel
    rank), Q, K, V, the projection's input and the MLP's 4h-wide GeLU and second inputs (12·sbh/t values), then
    the attention core: the softmax output (and its dropout output and mask) or FlashAttention's fp32
    statistics, none of it under selective checkpointing (Korthikanti §5: the core is recomputed); dropout
    masks are a byte a value."""
    sbh = s * b * h
    values = 4 * sbh + 12 * sbh / t
    masks = 2 * sbh if dropout else 0.0
    statistics = 0.0
    if flash and not selective:
        statistics = 4 * a * s * b / t
    elif not selective:
        scores = a * s * s * b / t
        values += scores * (2 if dropout else 1)
        masks += scores if dropout else 0.0
    return values * bytes_per_value + masks + statistics


def output_layer_bytes(micro_batch: int, seq: int, hidden: int, vocab: int, bytes_per_value: int = 2) -> float:
    """Kept for backward after the last layer: the final norm's input and output and the fp32 log-probabilities."""
    return 2 * seq * micro_batch * hidden * bytes_per_value + LOGITS_BYTES * seq * micro_batch * vocab


def loss_backward_bytes(micro_batch: int, seq: int, vocab: int) -> float:
    """The temporaries of F.cross_entropy's backward, alive together at its start: the gradients of the
    log-probabilities (nll_loss) and of the logits (log_softmax), fp32, each s·b·v."""
    return 2 * LOGITS_BYTES * seq * micro_batch * vocab


def foreach_step_bytes(trainable: float, precision: str = "mixed") -> float:
    """The temporary of torch.optim.Adam's foreach step (the default on CUDA): `torch._foreach_sqrt(exp_avg_sq)`
    makes one tensor per parameter, of the state's dtype, live until the update (`_multi_tensor_adam`)."""
    return PRECISIONS[precision][3] * trainable


def attention_backward_bytes(b: int, s: int, h: int, a: int, bytes_per_value: int = 2) -> tuple[float, float]:
    """Written-out attention's backward in one layer: what the layer still keeps when it starts (its first norm's
    input and output, Q, K, V and the softmax output, 5·sbh + a·s²·b values: the MLP's and the projection's
    inputs are freed by then) and the temporaries it makes, the gradients of the softmax output and of the
    scores (2·a·s²·b values), live together. With a small vocabulary this, not the loss, makes the peak."""
    scores = a * s * s * b
    return (5 * s * b * h + scores) * bytes_per_value, 2 * scores * bytes_per_value


@dataclass(frozen=True)
class Peak:
    """What is live at the estimated peak of a training step, by category, and at which moment."""

    moment: str                 # "backward" (its start: every activation kept) or "optimizer" (the step)
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries


def training_peak(states: ModelStates, activations: float, loss_temporaries: float = 0.0,
                  gradients_kept: bool = True, step_temporaries: float = 0.0, recomputing: float = 0.0,
                  others: tuple[Peak, ...] = ()) -> Peak:
    """The highest of the moments a training step peaks at. At the start of backward every activation and the
    loss's temporaries are live, and gradients only where they outlive the step (DDP's buckets, ZeRO's
    partitions, accumulation; not with one GPU and `zero_grad(set_to_none=True)`, PyTorch's default since 2.0).
    Under full checkpointing, `recomputing` is what is live once the loss's memory is freed and the last layer
    is made again (every layer's input and that layer's activations). In the optimizer step all gradients are
    live, the activations gone, plus the step's own temporaries. `others`: moments the caller knows more of
    (inside a layer's backward)."""
    gradients = states.gradients if gradients_kept else 0.0
    moments = [Peak("backward", states.parameters, gradients, states.optimizer, activations, loss_temporaries),
               Peak("recompute", states.parameters, gradients, states.optimizer, recomputing, 0.0),
               Peak("optimizer", states.parameters, states.gradients, states.optimizer, 0.0, step_temporaries), *others]
    return max(moments, key=lambda m: m.total)


@dataclass
class Regime:
    """How the measured model states read under one precision assumption."""

    name: str
    parameters: float            # Ψ implied by the measured parameter bytes
    expected_states_bytes: float  # 16Ψ
    measured_states_bytes: int
    agrees: bool                  # within 10%


def explain_model_states(parameter_bytes: int, gradient_bytes: int, optimizer_bytes: int) -> list[Regime]:
    """Which precision regime the measured bytes fit: fp32 Adam (params 4 B each) or mixed precision (2 B)."""
    measured = parameter_bytes + gradient_bytes + optimizer_bytes
    regimes = []
    for name, bytes_per_param in (("fp32 Adam", 4), ("mixed-precision Adam", 2)):
        psi = parameter_bytes / bytes_per_param
        expected = ADAM_BYTES_PER_PARAM * psi
        agrees = abs(measured - expected) <= AGREEMENT_TOLERANCE * expected if expected else False
        regimes.append(Regime(name, psi, expected, measured, agrees))
    return regimes
