"""The plan of `analyze estimate` (issue 21): the cheapest combination of changes that fits, found over the
remedy lattice in the method's cost order, each step's per-GPU bytes from the 16Ψ / ZeRO and Korthikanti
formulas, checked here against those formulas written out by hand."""
from __future__ import annotations

import json

import pytest

import analyzer
from analyzer.commands import main
from analyzer.commands.estimate import (
    BUSY_TOKENS,
    OVERHEAD,
    SMALL_HALVING,
    Layout,
    Shape,
    _micro_batch_level,
    estimate,
    per_gpu_bytes,
)
from analyzer.diagnose.plan import COST

GiB = 2**30
PSI, GPUS, B, S, L, H = 7e9, 8, 32, 2048, 32, 4096
SHAPE = Shape(B, S, L, H, 32)
USABLE = 80 * GiB * (1 - OVERHEAD)


def _sbh(b: int = B) -> float:
    return S * b * H


def _layer(b: int = B) -> float:
    """One layer with fused attention, 16-bit, dropout: 34·sbh and FlashAttention's fp32 logsumexp (4·a·s·b)."""
    return 34 * _sbh(b) + 4 * 32 * S * b


def test_the_worked_example_gets_a_plan_that_fits_with_the_formulas_numbers():
    """7B, FP16 + Adam, 8 x 80 GiB, micro-batch 32, sequence 2048: 16Ψ alone is over the device. The seed's fix
    order: ZeRO-1 first (4Ψ + 12Ψ/8 per GPU: the same traffic as data parallel, nearly free), then micro-batch 4
    with x8 accumulation (8,192 tokens a micro-batch keep the matmuls large), before full checkpointing (one more
    forward: 2·sbh per layer plus one layer, 34·sbh), which fits too, dearer, with a lower peak."""
    result = estimate(PSI, GPUS, 0, 80 * GiB, SHAPE, False)
    assert result["fits"] is False
    plan = result["plan"]
    assert plan["fits"] and [s["remedy"] for s in plan["steps"]] == ["zero1", "micro_batch"]
    zero1 = 4 * PSI + 12 * PSI / GPUS
    first, second = plan["steps"]
    assert first["predicted_peak_allocated_bytes"] == int(zero1 + L * _layer()) and first["fits"] is False
    assert second["predicted_peak_allocated_bytes"] == int(zero1 + L * _layer(4)) and second["value"] == 8
    assert second["fits"] and second["source"] == "formula"
    assert second["predicted_peak_allocated_bytes"] <= USABLE < first["predicted_peak_allocated_bytes"]
    assert first["cost"]["communication"].startswith("the same traffic")
    assert second["cost"]["throughput"].startswith("micro-batches of 8,192 tokens keep the matmuls large, 8 accumulation")
    # the alternatives fit, cost at least as much, and none is the plan with more changes added
    for alt in plan["alternatives"]:
        assert alt["predicted_peak_allocated_bytes"] <= USABLE and alt["extra_cost"] >= 0
        assert not {first["title"], second["title"]} <= set(alt["titles"])
    checkpointed = plan["alternatives"][0]   # dearer by checkpointing's cost less three halvings': 3 - 3 x 0.5
    assert checkpointed["remedies"] == ["zero1", "activation_checkpointing"] and checkpointed["extra_cost"] == 1.5
    assert checkpointed["predicted_peak_allocated_bytes"] == int(zero1 + L * 2 * _sbh() + _layer())


def test_zero2_alone_is_not_enough_and_zero3_with_checkpointing_and_a_smaller_micro_batch_fits():
    """The seed's narrative as per-GPU numbers: ZeRO-2 (2Ψ + 14Ψ/N) leaves the 34·sbh·L activations; ZeRO-3
    (16Ψ/N) with checkpointing at micro-batch 8 and x4 accumulation fits."""
    zero2 = per_gpu_bytes(PSI, GPUS, SHAPE, Layout(B, 1, "none", "adam", 2, 1, 1, False))
    assert zero2 == pytest.approx(2 * PSI + 14 * PSI / GPUS + L * _layer()) and zero2 > USABLE
    both = per_gpu_bytes(PSI, GPUS, SHAPE, Layout(8, 4, "full", "adam", 3, 1, 1, False))
    assert both == pytest.approx(16 * PSI / GPUS + L * 2 * _sbh(8) + _layer(8)) and both <= USABLE


def test_one_side_of_fits_gets_a_plan_the_other_none():
    """At micro-batch 1 with checkpointing and ZeRO-3 given, 7B fits 80 GiB: no plan; on 12 GiB it does not."""
    fitting = estimate(PSI, GPUS, 3, 80 * GiB, Shape(1, S, L, H, 32), True)
    assert fitting["fits"] and fitting["plan"] is None
    tight = estimate(PSI, GPUS, 3, 12 * GiB, Shape(1, S, L, H, 32), True)
    assert tight["fits"] is False and tight["plan"]["fits"]
    assert all(s["remedy"] not in ("zero1", "zero2", "zero3", "activation_checkpointing") for s in tight["plan"]["steps"])


def test_the_last_step_is_the_only_one_that_fits_and_costs_rise():
    """70B on 8 x 80 GiB: even ZeRO-3 leaves 2 TB/8 of states; the plan shrinks the optimizer's memory as the
    seed's fix order does (Adafactor before optimizer-state offload, story 3), offload half a point dearer next."""
    plan = estimate(70e9, GPUS, 0, 80 * GiB, Shape(4, 4096, 80, 8192, 64), False)["plan"]
    fits = [s["fits"] for s in plan["steps"]]
    assert fits[-1] and not any(fits[:-1])
    assert [COST[s["remedy"]] for s in plan["steps"]] == sorted(COST[s["remedy"]] for s in plan["steps"])
    assert [s["remedy"] for s in plan["steps"]] == ["micro_batch", "activation_checkpointing", "adafactor", "zero3"]
    offload = plan["alternatives"][0]
    assert offload["remedies"] == ["activation_checkpointing", "zero3", "optimizer_offload"]
    assert offload["extra_cost"] == 0.5


def test_pipeline_stages_hold_their_layers_and_the_in_flight_micro_batches():
    """1F1B: the first of p stages holds min(p, m) micro-batches of L/p layers and Ψ/p of the parameters."""
    job = Layout(4, 8, "none", "adam", 0, 1, 4, False)
    assert per_gpu_bytes(PSI, GPUS, SHAPE, job) == pytest.approx(16 * PSI / 4 + 4 * (L // 4) * _layer(4))
    two = Layout(4, 2, "none", "adam", 0, 1, 4, False)   # only 2 micro-batches: 2 in flight
    assert per_gpu_bytes(PSI, GPUS, SHAPE, two) == pytest.approx(16 * PSI / 4 + 2 * (L // 4) * _layer(4))


def test_selective_checkpointing_drops_the_attention_scores_only():
    """Eager attention keeps 5·a·s/h·sbh per layer more; selective recomputes just that (34 vs 34 + 5as/h)."""
    eager = Shape(B, S, L, H, 32, flash_attention=False)
    none = per_gpu_bytes(PSI, GPUS, eager, Layout(B, 1, "none", "adam", 3, 1, 1, False))
    selective = per_gpu_bytes(PSI, GPUS, eager, Layout(B, 1, "selective", "adam", 3, 1, 1, False))
    assert none - selective == pytest.approx(L * 5 * 32 * S / H * _sbh())
    assert selective == pytest.approx(16 * PSI / GPUS + L * 34 * _sbh())
    levers = {s["remedy"] for s in estimate(PSI, GPUS, 3, 40 * GiB, eager, False)["plan"]["steps"]}
    assert levers & {"selective_checkpointing", "activation_checkpointing"}


def test_the_command_prints_the_plan(capsys):
    code = main(["estimate", "--params", "7e9", "--gpus", "8", "--micro-batch", "32", "--seq", "2048", "--layers", "32",
                 "--hidden", "4096", "--gpu-memory", "80GiB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "1. ZeRO-1: 308.11 GiB per GPU, does not fit yet (throughput about that of data parallel, the same " \
           "traffic (a reduce-scatter and an all-gather))" in out
    assert "2. micro-batch 4 with gradient accumulation x8: 69.89 GiB per GPU, fits (micro-batches of 8,192 tokens " \
           "keep the matmuls large, 8 accumulation steps per optimizer step (the same global batch))" in out
    assert "  - ZeRO-1 + full activation checkpointing: 60.36 GiB per GPU; dearer than the plan, for full activation " \
           "checkpointing: about 20-30% more compute (one more forward)" in out
    assert "cost order" not in out


def test_zero1_on_data_parallel_gpus_costs_less_than_a_halving_and_a_halving_less_than_checkpointing():
    """The seed's order as costs: ZeRO-1 (the traffic of data parallel) 0.25, a halving that keeps BUSY_TOKENS
    0.5, full checkpointing 3; on one GPU there is nothing to shard and ZeRO is no step."""
    assert COST["zero1"] == 0.25 < COST["micro_batch"] == 0.5 < COST["activation_checkpointing"] == 3.0
    one = estimate(1.3e9, 1, 0, 24 * GiB, Shape(32, S, 24, 2048, 16), False)["plan"]
    assert one["fits"] and [s["remedy"] for s in one["steps"]] == ["micro_batch", "activation_checkpointing"]
    eight = estimate(1.3e9, GPUS, 0, 24 * GiB, Shape(32, S, 24, 2048, 16), False)["plan"]
    assert [s["remedy"] for s in eight["steps"]] == ["zero1", "micro_batch"]


def test_a_halving_costs_little_while_the_micro_batch_keeps_busy_tokens():
    """At sequence 512 and micro-batch 32: down to 4 (2,048 tokens, BUSY_TOKENS) a halving costs 0.5; to 2 (1,024
    tokens) SMALL_HALVING, 2."""
    shape = Shape(32, 512, L, H, 32)
    assert BUSY_TOKENS == 2048 and SMALL_HALVING == 2.0
    at_busy, below = _micro_batch_level(shape, 8), _micro_batch_level(shape, 16)
    assert at_busy.cost == pytest.approx(3 * 0.5) and below.cost == pytest.approx(3 * 0.5 + SMALL_HALVING)
    assert "2,048 tokens keep the matmuls large" in at_busy.price()["throughput"]
    assert "1,024 tokens make smaller matmuls" in below.price()["throughput"]


@pytest.mark.parametrize(("memory", "second"), [(48, "activation_checkpointing"), (50, "micro_batch")])
def test_checkpointing_leads_only_where_the_micro_batch_would_go_below_busy_tokens(memory, second):
    """7B on 8 GPUs, micro-batch 32 of 512 tokens, ZeRO-1 (35.85 GiB of states): on 50 GiB (45 usable) micro-batch
    4 (2,048 tokens, 8.51 GiB of activations) fits, cost 1.5 < checkpointing's 3; on 48 GiB (43.2 usable) it does
    not, micro-batch 2 (1,024 tokens) would cost 3.5, and checkpointing at micro-batch 32 (42.1 GiB) is the plan."""
    plan = estimate(PSI, GPUS, 0, memory * GiB, Shape(32, 512, L, H, 32), False)["plan"]
    assert [s["remedy"] for s in plan["steps"]] == ["zero1", second]
    usable = memory * GiB * (1 - OVERHEAD)
    states = 4 * PSI + 12 * PSI / GPUS
    sbh = 512 * 32 * H
    assert (states + L * (34 * 512 * 4 * H + 4 * 32 * 512 * 4) <= usable) is (memory == 50)
    assert states + L * 2 * sbh + 34 * sbh + 4 * 32 * 512 * 32 <= usable


def test_busy_tokens_is_a_threshold_of_the_python_api():
    """On 50 GiB micro-batch 4 (2,048 tokens) leads checkpointing at the default BUSY_TOKENS; tuned to 8,192 tokens
    the halvings past micro-batch 16 cost SMALL_HALVING each: 0.5 + 2 x 2 = 4.5 > checkpointing's 3, which leads."""
    assert analyzer.Thresholds().busy_tokens == BUSY_TOKENS
    tuned = estimate(PSI, GPUS, 0, 50 * GiB, Shape(32, 512, L, H, 32), False,
                     thresholds=analyzer.Thresholds(busy_tokens=8192))["plan"]
    assert [s["remedy"] for s in tuned["steps"]] == ["zero1", "activation_checkpointing"]


def test_precision_dropout_and_the_vocabulary_reach_the_per_gpu_bytes():
    """fp32 Adam: 4 + 4 + 8 bytes a parameter, no master (ZeRO-1 shards the 8), activations at 4 bytes a value
    (the two dropout masks stay a byte);
    without dropout a layer keeps 32·sbh + 2·a·s²·b bytes in 16-bit (eager); the vocabulary adds the final norm's
    2·sbh values, the fp32 log-probabilities and cross-entropy's two backward temporaries (4·s·b·v each)."""
    b, v = 4, 32000
    fp32 = Shape(b, S, L, H, 32, bytes_per_value=4)
    job = Layout(b, 1, "none", "adam", 1, 1, 1, False, precision="fp32")
    assert per_gpu_bytes(PSI, GPUS, fp32, job) == pytest.approx(4 * PSI + 4 * PSI + 8 * PSI / GPUS
                                                                + L * ((16 * 4 + 2) * _sbh(b) + 4 * 32 * S * b))
    eager = Shape(b, S, L, H, 32, flash_attention=False, dropout=False)
    none = Layout(b, 1, "none", "adam", 3, 1, 1, False)
    assert per_gpu_bytes(PSI, GPUS, eager, none) == pytest.approx(16 * PSI / GPUS + L * _sbh(b) * (32 + 2 * 32 * S / H))
    vocab = Shape(b, S, L, H, 32, vocab=v)
    without = per_gpu_bytes(PSI, GPUS, Shape(b, S, L, H, 32), none)
    assert per_gpu_bytes(PSI, GPUS, vocab, none) - without == pytest.approx(2 * 2 * _sbh(b) + 3 * 4 * S * b * v)
    result = estimate(PSI, None, 0, None, None, False, precision="fp32")
    assert result["model_states_bytes"] == 16 * PSI and result["precision"] == "fp32"


def test_the_command_takes_the_precision_dropout_and_vocabulary(capsys):
    """fp32: 4-byte activations and no master copy; --no-dropout and --vocab change the per-GPU figure by the
    terms the formulas give (one GPU, micro-batch 1, sequence 1024, 24 layers of width 1024, vocabulary 50257)."""
    args = ["estimate", "--params", "350e6", "--micro-batch", "1", "--seq", "1024", "--layers", "24", "--hidden",
            "1024", "--format", "json"]
    def per_gpu(*extra: str) -> int:
        assert main([*args, *extra]) == 0
        return json.loads(capsys.readouterr().out)["per_gpu_bytes"]
    sbh, a, v = 1024 * 1024, 8, 50257
    base = per_gpu()
    assert per_gpu("--no-dropout") == pytest.approx(base - 24 * 2 * sbh, abs=2)
    assert per_gpu("--vocab", str(v)) == pytest.approx(base + 2 * 2 * sbh + 3 * 4 * 1024 * v, abs=2)
    assert per_gpu("--precision", "fp32") == pytest.approx(16 * 350e6 + 24 * ((16 * 4 + 2) * sbh + 4 * a * 1024), abs=2)
    assert main(args[:-2] + ["--precision", "fp32"]) == 0
    assert capsys.readouterr().out.startswith("Model states (fp32 Adam, 16Ψ): 16 × 0.35B")
