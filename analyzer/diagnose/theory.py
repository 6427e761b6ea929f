"""The formulas practitioners check memory against (ZeRO paper, Korthikanti et al. 2022).

Model states for Adam, Ψ parameters: 16Ψ bytes, whether mixed precision (2Ψ fp16/bf16 params + 2Ψ grads +
4Ψ fp32 master + 4Ψ + 4Ψ moments) or fp32 (4Ψ params + 4Ψ grads + 8Ψ moments). Per GPU over N GPUs:
ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N (mixed precision). Transformer activations per layer,
without recomputation: s·b·h·(34 + 5·a·s/h) bytes in 16-bit; with full activation checkpointing only the
layer inputs stay (2·s·b·h bytes per layer) plus one layer being recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

ADAM_BYTES_PER_PARAM = 16
AGREEMENT_TOLERANCE = 0.1   # measured model states agree with 16Ψ when within this share of it


def model_states_bytes(params: float, zero: int = 0, gpus: int = 1) -> float:
    """Per-GPU bytes of parameters, gradients and Adam states, mixed precision, at a ZeRO stage."""
    n = max(gpus, 1)
    if zero <= 0:
        return 16 * params
    if zero == 1:
        return 4 * params + 12 * params / n
    if zero == 2:
        return 2 * params + 14 * params / n
    return 16 * params / n


def activation_bytes(layers: int, micro_batch: int, seq: int, hidden: int, heads: int,
                     bytes_per_value: int = 2, checkpointing: bool = False, tensor_parallel: int = 1,
                     flash_attention: bool = True) -> float:
    """Activations kept for backward by a transformer (Korthikanti et al., no sequence parallelism). Fused
    attention (SDPA / FlashAttention) keeps no s×s score matrices: the 5·a·s/h term goes."""
    one_layer = _layer_activations(micro_batch, seq, hidden, heads, bytes_per_value, tensor_parallel, flash_attention)
    if checkpointing:
        per_layer_inputs = 2 * seq * micro_batch * hidden * (bytes_per_value / 2)
        return layers * per_layer_inputs + one_layer
    return layers * one_layer


def _layer_activations(b: int, s: int, h: int, a: int, bytes_per_value: int, t: int, flash: bool) -> float:
    scores = 0 if flash else 5 * a * s / (h * t)
    return s * b * h * (10 + 24 / t + scores) * (bytes_per_value / 2)


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
