"""The estimator's formulas (analyzer.diagnose.theory) against hand computation and against what PyTorch itself
keeps (the optimizer's tensors after a real step; the tensors autograd saves for backward, counted through
`saved_tensors_hooks`), and the fidelity of the whole estimate on small simulated runs
(analyzer.evaluate.estimator_fidelity), held to the bars docs/results/accuracy.md publishes."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from analyzer.diagnose import theory
from analyzer.evaluate import estimator_fidelity as fidelity
from analyzer.evaluate.estimator_fidelity import ACTIVATION, CATEGORIES, GRADIENT, OPTIMIZER, PARAMETER, TOTAL
from analyzer.simulate.gpt import GPT, GPTConfig
from analyzer.simulate.remedy_runs import STEPS, RemedySetup, model, simulate

#: the published bars (docs/results/accuracy.md, "Estimator fidelity"): |estimate - truth| / truth at the peak
BARS = {PARAMETER: 0.01, GRADIENT: 0.01, OPTIMIZER: 0.01, ACTIVATION: 0.05, TOTAL: 0.05}


# ---- model states: the precision regime and the optimizer -------------------------------------------------------
def _bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


@pytest.mark.parametrize("make, kind", [
    (lambda p: torch.optim.Adam(p, foreach=True), "adam"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd_momentum"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "sgd")], ids=["adam 16Ψ", "sgd momentum 12Ψ", "sgd 8Ψ"])
def test_fp32_model_states_are_what_the_optimizer_holds_after_a_step(make: Callable, kind: str):
    """fp32 weights and gradients (4 + 4 bytes) and 4 bytes per state: Adam's m and v, SGD's momentum buffer, plain
    SGD nothing. Counted off the objects after a real step; Adam's 0-dim `step` counters are left out."""
    layer = nn.Linear(64, 32)
    optimizer = make(layer.parameters())
    layer(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    params = list(layer.parameters())
    held = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    psi = sum(p.numel() for p in params)
    states = theory.model_states(psi, "fp32", kind)
    assert (states.parameters, states.gradients, states.optimizer) == (_bytes(params), _bytes(p.grad for p in params),
                                                                       _bytes(held))
    assert states.total == {"adam": 16, "sgd_momentum": 12, "sgd": 8}[kind] * psi


def test_regimes_by_hand_and_the_zero_papers_closed_forms():
    """Mixed precision: 2 + 2 bytes and a 4-byte master; pure bf16 no master and 2-byte states; 8-bit Adam 1 byte
    a moment; LoRA trains 1%: gradients and states of those only. ZeRO-1/2/3 of mixed Adam: 4Ψ + 12Ψ/N,
    2Ψ + 14Ψ/N, 16Ψ/N (Rajbhandari et al. 2020, §5)."""
    psi, n = 1000.0, 8
    def split(*args: object, **kwargs: object) -> tuple[float, float, float]:
        s = theory.model_states(psi, *args, **kwargs)  # type: ignore[arg-type]
        return s.parameters, s.gradients, s.optimizer
    assert split("mixed", "adam") == (2 * psi, 2 * psi, (4 + 4 + 4) * psi)
    assert split("mixed", "sgd_momentum") == (2 * psi, 2 * psi, (4 + 4) * psi)          # 12Ψ
    assert split("bf16", "adam") == (2 * psi, 2 * psi, (2 + 2) * psi)                   # 8Ψ
    assert split("mixed", "adam_8bit") == (2 * psi, 2 * psi, (4 + 1 + 1) * psi)
    assert split("fp32", "adam", trainable=10) == (4 * psi, 4 * 10, 8 * 10)
    assert split("mixed", "none", trainable=0) == (2 * psi, 0, 0)
    assert [theory.model_states_bytes(psi, z, n) for z in (0, 1, 2, 3)] == [
        16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]


# ---- activations: what autograd saves ---------------------------------------------------------------------------
def _saved_bytes(module: nn.Module, run: Callable[[], object]) -> dict[str, int]:
    """Bytes of the distinct storages autograd saves for backward while `run` runs, by kind: floating tensors
    with a sequence axis, the norms' per-token statistics (a last axis of 1), other; the module's weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and t.dim() > 0 and storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = ("statistics" if t.shape[-1] == 1 else "kept", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    out = {"kept": 0, "statistics": 0}
    for kind, nbytes in seen.values():
        out[kind] += nbytes
    return out


B, S, H, A, V = 2, 16, 32, 4, 100


@pytest.mark.parametrize("fused", [False, True], ids=["written-out attention", "scaled_dot_product_attention"])
def test_one_layer_keeps_what_the_formula_counts(fused: bool):
    """fp32, no dropout: 16·sbh values, plus the a·s²·b softmax output (written out) or FlashAttention's fp32
    logsumexp a·s·b (fused, whose output is the projection's input: no copy). The two norms' mean and rstd
    (2 · 2 · s·b values) are the only thing saved the formula leaves out."""
    gpt = model(GPTConfig(vocab=V, d_model=H, layers=1, heads=A, max_seq=S), fused, checkpointing=False)
    x = torch.randn(B, S, H, requires_grad=True)
    saved = _saved_bytes(gpt, lambda: gpt.layers[0](x, gpt.causal_mask))
    sbh = S * B * H
    by_hand = (16 * sbh + (0 if fused else A * S * S * B)) * 4 + (4 * A * S * B if fused else 0)
    assert theory.layer_activation_bytes(B, S, H, A, 4, flash=fused, dropout=False) == by_hand
    assert saved == {"kept": by_hand, "statistics": 2 * 2 * S * B * 4}


def test_with_dropout_and_16_bits_the_formula_is_korthikantis():
    """Korthikanti et al. 2022, eq. 1 and 2: s·b·h·(34 + 5·a·s/h) bytes, and 10 + 24/t + 5as/(ht) over t ranks."""
    b, s, h, a = 4, 2048, 4096, 32
    assert theory.layer_activation_bytes(b, s, h, a, 2, flash=False, dropout=True) == s * b * h * (34 + 5 * a * s / h)
    assert theory.layer_activation_bytes(b, s, h, a, 2, t=4, flash=False, dropout=True) == pytest.approx(
        s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    # fused attention keeps no s x s tensor and no attention-dropout mask; the two output-dropout masks stay
    assert theory.layer_activation_bytes(b, s, h, a, 2, flash=True, dropout=True) == s * b * h * 34 + 4 * a * s * b


def test_the_output_layer_keeps_the_final_norm_and_the_fp32_log_probabilities():
    """After the last layer: the final norm's input and output (2·sbh values) and log_softmax's fp32 output
    (4·s·b·v bytes; the logits themselves are not saved)."""
    gpt = GPT(GPTConfig(vocab=V, d_model=H, layers=0, heads=A, max_seq=S))
    idx = torch.randint(0, V, (B, S))
    saved = _saved_bytes(gpt, lambda: gpt(idx, idx))
    by_hand = 2 * S * B * H * 4 + 4 * S * B * V
    assert theory.output_layer_bytes(B, S, H, V, 4) == by_hand
    assert saved == {"kept": by_hand, "statistics": 2 * S * B * 4}


# ---- the peak: its moment, the loss's and the optimizer's temporaries (simulated) ---------------------------------
def _simulated(setup: RemedySetup, folder: Path) -> tuple[fidelity.Row, dict]:
    out = folder / "run.pickle"
    simulate(setup, out)
    truth = json.loads(out.with_name("run.truth.json").read_text())
    measured, attributed, peak = fidelity.measure_simulated(out)
    workload = fidelity.workload_of(setup.name, setup.loop(), STEPS)
    return fidelity.compare(workload, measured, attributed, peak), truth


def test_a_large_vocabulary_peaks_at_the_start_of_backward_with_two_loss_temporaries(tmp_path: Path):
    """Vocabulary 8192, width 32: the loss dominates. The peak is in backward with no gradient yet (set_to_none),
    and its temporaries are cross-entropy's two fp32 s·b·v gradients, as `loss_backward_bytes` says."""
    setup = RemedySetup("loss", GPTConfig(vocab=8192, d_model=32, layers=1, heads=2, max_seq=64), 4, 64)
    row, truth = _simulated(setup, tmp_path)
    at = truth["measures"]["peak_by_category"]
    assert truth["measures"]["peak_phase"] == "backward" and at["gradient"] == 0 and row.estimate[GRADIENT] == 0
    assert at["temporary"] == pytest.approx(theory.loss_backward_bytes(4, 64, 8192), rel=0.001)
    assert 2 * 4 * 64 * 4 * 8192 == theory.loss_backward_bytes(4, 64, 8192)


def test_large_states_and_few_activations_peak_in_the_optimizer_step_with_foreachs_temporary(tmp_path: Path):
    """Width 512 at sequence 8: the states dominate. The peak is the optimizer step, all gradients live, plus
    foreach Adam's sqrt(v) list (4 bytes a parameter); the estimate picks that moment."""
    setup = RemedySetup("states", GPTConfig(vocab=1024, d_model=512, layers=2, heads=8, max_seq=8), 1, 8)
    row, truth = _simulated(setup, tmp_path)
    at = truth["measures"]["peak_by_category"]
    assert truth["measures"]["peak_phase"] == "optimizer"
    assert row.estimate[ACTIVATION] == 0 and row.estimate[GRADIENT] == 4 * row.workload.trainable
    assert at["temporary"] == pytest.approx(theory.foreach_step_bytes(row.workload.trainable, "fp32"), rel=0.05)
    assert at["gradient"] == pytest.approx(row.estimate[GRADIENT], rel=0.05)


def test_a_small_vocabulary_peaks_inside_written_out_attentions_backward(tmp_path: Path):
    """Vocabulary 512 at sequence 512: the loss's memory is small, and the peak is inside the last layer's
    attention backward, with the gradients of the softmax output and of the scores (2·a·s²·b fp32 values)."""
    setup = RemedySetup("inside", GPTConfig(vocab=512, d_model=128, layers=2, heads=4, max_seq=512), 2, 512)
    row, truth = _simulated(setup, tmp_path)
    kept, temporaries = theory.attention_backward_bytes(2, 512, 128, 4, 4)
    assert (kept, temporaries) == ((5 * 512 * 2 * 128 + 4 * 512 * 512 * 2) * 4, 2 * 4 * 512 * 512 * 2 * 4)
    assert truth["measures"]["peak_phase"] == "backward"
    assert truth["measures"]["peak_by_category"]["temporary"] == pytest.approx(temporaries, rel=0.1)
    assert theory.loss_backward_bytes(2, 512, 512) <= temporaries / 4
    assert abs(row.error(TOTAL) or 1) <= BARS[TOTAL] and abs(row.error(ACTIVATION) or 1) <= BARS[ACTIVATION]
    without = fidelity.compare(row.workload, row.truth, row.analysis, row.peak,
                               estimator=lambda w: fidelity.estimate(w, inside_layers=False))
    assert abs(without.error(TOTAL) or 0) > BARS[TOTAL]      # the moment is what brings it within the bar


def test_the_peak_moment_either_side():
    """Which moment wins, by hand: the start of backward when activations exceed the gradients and the step's
    temporaries, the optimizer step otherwise; gradients are counted at the start of backward only when kept."""
    states = theory.ModelStates(parameters=4.0, gradients=4.0, optimizer=8.0)
    assert theory.training_peak(states, 9.0, step_temporaries=4.0, gradients_kept=False).moment == "backward"
    assert theory.training_peak(states, 7.0, step_temporaries=4.0, gradients_kept=False).moment == "optimizer"
    kept = theory.training_peak(states, 1.0, gradients_kept=True)
    assert kept.moment == "backward" and kept.total == 4 + 4 + 8 + 1
    # full checkpointing: the recomputed layer and the output layer are live at different moments
    assert theory.training_peak(states, 9.0, 2.0, False, recomputing=12.0).moment == "recompute"
    assert theory.training_peak(states, 9.0, 2.0, False, recomputing=10.0).moment == "backward"


# ---- the fidelity of the whole estimate ----------------------------------------------------------------------------
@pytest.mark.parametrize("fused, checkpointing", [(False, False), (True, False), (False, True)],
                         ids=["eager", "sdpa", "eager checkpointed"])
def test_the_estimate_of_a_small_gpt_run_is_within_the_published_bars(tmp_path: Path, fused: bool,
                                                                       checkpointing: bool):
    """A 2-layer GPT (width 256, sequence 256, micro-batch 2, vocabulary 4096, fp32 Adam), simulated: each
    category's estimate against the truth at the peak, as the benchmark measures it."""
    setup = RemedySetup("small", GPTConfig(vocab=4096, d_model=256, layers=2, heads=4, max_seq=256), 2, 256,
                        fused_attention=fused, checkpointing=checkpointing)
    row, _ = _simulated(setup, tmp_path)
    for category in CATEGORIES:
        error = row.error(category)
        if error is None:
            assert row.empty_miss(category) is False, category
        else:
            assert abs(error) <= BARS[category], (category, error)
    assert row.error(OPTIMIZER) is not None and row.error(TOTAL) is not None
    # checkpointed, this model's activations are small: the optimizer step peaks, as estimated
    assert (row.error(ACTIVATION) is None) == checkpointing
