"""Advice chosen for the workload, at its boundaries (issue 18): a run that fits gets no try-first, remedies
saving too little are left out, ties are explained, a sharding remedy names its GPU count, and each workload
(training, frozen base, forward only, autocast on, one GPU, host memory) gets only the remedies that act on it.

Thresholds are written here with their documented values (analyzer.diagnose.remedies, .workload); inputs sit
one byte either side of them.
"""
from __future__ import annotations

import math

import pytest

import analyzer
from analyzer.diagnose.remedies import BY_ID, Demand, count_layers, gpus_for, rank_remedies
from analyzer.diagnose.workload import frozen_share
from support.paths import FIXTURES, REAL
from support.snapshots import GiB, MiB, Recording

AMPLE_HEADROOM = 0.20     # remedies.AMPLE_HEADROOM: a run fits as it is with 20% of the device free at its peak
FIT_HEADROOM = 0.95       # remedies.FIT_HEADROOM: ... and its reserve within 95% of it
MIN_SAVING_SHARE = 0.01   # remedies.MIN_SAVING_SHARE: a remedy saving at most 1% of the peak is left out
FROZEN_SHARE = 0.5        # workload.FROZEN_SHARE: gradients of under half the parameters: a frozen part
QUANTIZE_SHARE = 0.25     # remedies.QUANTIZE_SHARE: untrained weights of a quarter of the peak or more: quantize
PIPELINE_MIN_LAYERS = 2   # remedies.PIPELINE_MIN_LAYERS: pipeline stages need two repeated blocks or more
SHARDING = {"zero1", "zero2", "zero3", "tensor_parallel", "pipeline_parallel", "sharded_save"}
TRAINING_ONLY = {"gradient_accumulation", "activation_checkpointing", "bf16", "zero1", "zero2", "zero3", "pipeline_parallel"}
CAPACITY = 80 * GiB


def _ids(demand: Demand) -> list[str]:
    return [r["id"] for r in rank_remedies(demand)]


def _training(total: int, **kw) -> Demand:
    """A training peak of `total` bytes: 60% activations, 10% each parameters, gradients, optimizer state and
    temporaries."""
    tenth = total // 10
    by_category = {"activation": total - 4 * tenth, "parameter": tenth, "gradient": tenth,
                   "optimizer_state": tenth, "temporary": tenth}
    return Demand(**{"total": total, "by_category": by_category, "capacity": CAPACITY, "world_size": None,
                     "layers": None, **kw})


# ---- AMPLE_HEADROOM: a run that fits gets no try-first --------------------------------------------------------
FITS_AT = math.floor((1 - AMPLE_HEADROOM) * CAPACITY)


@pytest.mark.parametrize(("total", "fits"), [(FITS_AT, True), (FITS_AT + 1, False)], ids=["at", "above"])
def test_a_run_with_a_fifth_of_the_device_free_fits_and_gets_no_try_first(total, fits):
    remedies = rank_remedies(_training(total))
    assert remedies, "the remedies stay, as ways to grow the batch or the model"
    assert {r["purpose"] for r in remedies} == ({"grow"} if fits else {"fix"})
    assert any(r["try_first"] for r in remedies) is not fits


def test_a_run_that_oomed_never_fits_as_it_is():
    remedies = rank_remedies(_training(GiB, oomed=True))
    assert {r["purpose"] for r in remedies} == {"fix"} and any(r["try_first"] for r in remedies)


@pytest.mark.parametrize(("reserved", "fits"), [(math.floor(FIT_HEADROOM * CAPACITY), True),
                                                (math.floor(FIT_HEADROOM * CAPACITY) + 1, False)], ids=["at", "above"])
def test_a_run_whose_reserve_nears_the_device_does_not_fit_as_it_is(reserved, fits):
    remedies = rank_remedies(_training(GiB, reserved_peak=reserved))
    assert any(r["try_first"] for r in remedies) is not fits


SMALLEST_GPU = 8 * GiB     # remedies.SMALLEST_GPU: without a known device, a run that fits this fits any GPU
FITS_ANY_AT = math.floor((1 - AMPLE_HEADROOM) * SMALLEST_GPU)


@pytest.mark.parametrize(("total", "fits"), [(FITS_ANY_AT, True), (FITS_ANY_AT + 1, False)], ids=["at", "above"])
def test_an_unknown_device_fits_only_what_fits_the_smallest_gpu(total, fits):
    remedies = rank_remedies(_training(total, capacity=None))
    assert any(r["try_first"] for r in remedies) is not fits
    assert {r["purpose"] for r in remedies} == ({"grow"} if fits else {"fix"})


def test_the_verdict_on_an_unknown_device_says_which_gpus_it_fits():
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(512 * MiB)
    d = analyzer.analyze(rec.trace()).devices[0].diagnosis
    assert d.fits == {"peak_bytes": 512 * MiB, "capacity_bytes": 8 * GiB, "headroom_bytes": 8 * GiB - 512 * MiB,
                      "capacity_assumed": True}
    assert "Fits any GPU of 8.00 GiB or more (peak 0.50 GiB; pass --gpu-memory" in d.verdict
    assert "try first" not in d.verdict.lower()


def test_the_verdict_of_a_run_that_fits_says_so_with_its_headroom():
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        rec.alloc(512 * MiB)
    d = analyzer.analyze(rec.trace(), gpu_memory=24 * GiB).devices[0].diagnosis
    assert d.fits == {"peak_bytes": 512 * MiB, "capacity_bytes": 24 * GiB, "headroom_bytes": 24 * GiB - 512 * MiB}
    assert "Fits: peak 0.50 GiB of 24.00 GiB, 23.50 GiB headroom" in d.verdict and "Try first" not in d.verdict


# ---- MIN_SAVING_SHARE: no remedy saves nothing -----------------------------------------------------------------
TOTAL = 100 * GiB


@pytest.mark.parametrize(("recoverable", "listed"), [(math.floor(MIN_SAVING_SHARE * TOTAL) + 1, True),
                                                     (math.floor(MIN_SAVING_SHARE * TOTAL), False)],
                         ids=["above", "at"])
def test_a_remedy_saving_at_most_one_percent_of_the_peak_is_left_out(recoverable, listed):
    demand = Demand(total=TOTAL, by_category={"activation": TOTAL}, capacity=None, world_size=None, layers=None,
                    findings={"fragmentation"}, recoverable_fragmentation=recoverable)
    assert ("expandable_segments" in _ids(demand)) is listed


def test_no_listed_remedy_saves_zero_or_less():
    """A forward-only peak of parameters alone: accumulation's estimate (half the batch less the gradients it
    keeps) is negative and ZeRO has nothing to shard; neither is listed."""
    demand = Demand(total=10 * GiB, by_category={"parameter": 7 * GiB, "activation": 3 * GiB}, capacity=None,
                    world_size=None, layers=None)
    remedies = rank_remedies(demand)
    assert remedies and all(r["saved_bytes"] is None or r["saved_bytes"] > 0 for r in remedies)
    assert "gradient_accumulation" not in {r["id"] for r in remedies}


def test_equal_savings_name_the_cheaper_remedy_and_what_both_act_on():
    demand = Demand(total=80 * GiB, by_category={"activation": 80 * GiB}, capacity=CAPACITY, world_size=None,
                    layers=None, oomed=True)
    remedies = {r["id"]: r for r in rank_remedies(demand)}
    assert remedies["micro_batch"]["note"] is None
    assert remedies["activation_checkpointing"]["saved_bytes"] == remedies["micro_batch"]["saved_bytes"]
    assert remedies["activation_checkpointing"]["note"].startswith(
        f"the same saving as #{remedies['micro_batch']['rank']} (Halve the micro-batch): both estimates rest on the "
        "activations")


def test_savings_that_print_differently_are_about_the_same_not_the_same():
    """Issue 33.4: two savings within SAME_SAVING_SHARE of the peak whose printed sizes differ (5.04 vs 5.14 GiB)
    are 'about the same saving', each size said; printed alike, 'the same saving'."""
    from analyzer.diagnose.remedies import _same_saving

    demand = Demand(total=80 * GiB, by_category={"activation": 80 * GiB}, capacity=CAPACITY, world_size=None,
                    layers=None, oomed=True)
    cheaper = [{"id": "micro_batch", "rank": 1, "title": "Halve the micro-batch", "saved_bytes": 5 * GiB}]
    remedy = BY_ID["activation_checkpointing"]
    assert _same_saving(demand, remedy, 5 * GiB + 2**20, cheaper).startswith("the same saving as #1")
    assert _same_saving(demand, remedy, int(5.1 * GiB), cheaper).startswith(
        "about the same saving (5.10 GiB against 5.00 GiB) as #1 (Halve the micro-batch)")
    assert _same_saving(demand, remedy, 6 * GiB, cheaper) is None   # beyond 1% of the peak: not the same at all


def test_the_order_is_the_cost_order_and_try_first_the_cheapest_that_fits():
    demand = _training(90 * GiB, oomed=True)
    remedies = rank_remedies(demand)
    assert [r["rank"] for r in remedies] == list(range(1, len(remedies) + 1))
    first = next(r for r in remedies if r["try_first"])
    assert not any(r["fits"] for r in remedies[: remedies.index(first)])


# ---- GPUs: sharding names N ------------------------------------------------------------------------------------
def test_sharding_over_the_given_gpus_names_them():
    titles = {r["id"]: r["title"] for r in rank_remedies(_training(90 * GiB, oomed=True, world_size=4))}
    assert titles["zero3"].endswith("over 4 GPUs") and titles["tensor_parallel"].startswith("Tensor parallelism over 4")


def test_one_gpu_gets_no_sharding():
    assert not SHARDING & set(_ids(_training(90 * GiB, oomed=True, world_size=1)))


def test_without_gpus_sharding_takes_the_fewest_that_fit():
    demand = _training(90 * GiB, oomed=True)
    states = demand.bytes("parameter", "gradient", "optimizer_state")
    n, how = gpus_for(demand, states)
    assert demand.total - states * (1 - 1 / n) <= FIT_HEADROOM * CAPACITY
    assert demand.total - states * (1 - 1 / (n - 1)) > FIT_HEADROOM * CAPACITY or n == 2
    title = next(r["title"] for r in rank_remedies(demand) if r["id"] == "zero3")
    assert title.endswith(f"over {n} GPUs (the fewest that fit; pass --gpus for your count)") and "fewest" in how


def test_without_gpus_or_device_memory_the_assumed_8_is_said():
    title = next(r["title"] for r in rank_remedies(_training(90 * GiB, capacity=None)) if r["id"] == "zero3")
    assert title.endswith("over 8 GPUs (assumed; pass --gpus for your count)")


# ---- workloads -------------------------------------------------------------------------------------------------
def test_forward_only_gets_no_training_remedies():
    demand = Demand(total=20 * GiB, by_category={"parameter": 14 * GiB, "activation": 6 * GiB}, capacity=16 * GiB,
                    world_size=None, layers=None, workload="forward_only")
    ids = set(_ids(demand))
    assert not TRAINING_ONLY & ids
    assert {"micro_batch", "weight_quantization"} <= ids
    assert next(r for r in rank_remedies(demand) if r["id"] == "micro_batch")["title"].startswith("Halve the batch")


def test_kept_activations_offer_inference_mode_on_its_condition_never_first():
    demand = Demand(total=20 * GiB, by_category={"parameter": 4 * GiB, "activation": 16 * GiB}, capacity=16 * GiB,
                    world_size=None, layers=None, workload="forward_only", graph_kept=True, graph_bytes=15 * GiB)
    remedies = {r["id"]: r for r in rank_remedies(demand)}
    assert remedies["no_grad"]["title"].startswith("If the forward runs with autograd on")
    assert remedies["no_grad"]["fits"] and not remedies["no_grad"]["try_first"]


def test_temporaries_dominating_get_the_halved_batch():
    demand = Demand(total=10 * GiB, by_category={"temporary": 9 * GiB, "parameter": GiB}, capacity=8 * GiB,
                    world_size=None, layers=None, workload="forward_only", oomed=True)
    assert rank_remedies(demand)[0]["id"] == "micro_batch"


@pytest.mark.parametrize(("autocast", "offered"), [(True, False), (False, True), (None, True)])
def test_bf16_is_not_offered_when_autocast_is_already_on(autocast, offered):
    assert ("bf16" in _ids(_training(90 * GiB, oomed=True, autocast=autocast))) is offered


@pytest.mark.parametrize(("gradients", "frozen"), [(math.ceil(FROZEN_SHARE * 100), False),
                                                   (math.ceil(FROZEN_SHARE * 100) - 1, True)])
def test_gradients_of_under_half_the_parameters_show_a_frozen_part(gradients, frozen):
    assert (frozen_share(100, gradients, 0) is not None) is frozen


@pytest.mark.parametrize(("optimizer_state", "frozen"), [(math.ceil(FROZEN_SHARE * 100), False),
                                                         (math.ceil(FROZEN_SHARE * 100) - 1, True)])
def test_without_gradients_the_optimizer_state_bounds_what_trains(optimizer_state, frozen):
    """One state a parameter (zidongliu-decomfl's zeroth-order Adam-like estimator keeps one) trains the whole
    model: it is not taken for a frozen base."""
    assert (frozen_share(100, 0, optimizer_state) is not None) is frozen


def test_a_frozen_base_is_said_to_have_no_gradients_to_shard():
    demand = _training(90 * GiB, oomed=True, world_size=4, frozen_share=0.9)
    title = next(r["title"] for r in rank_remedies(demand) if r["id"] == "zero2")
    assert title.endswith("(of the trainable part: the frozen base has neither)")


def test_host_memory_alone_is_treated_without_the_cuda_allocator_settings():
    """A profiler trace of a run on the CPU (host memory only, device -1): its own advice, but not the CUDA
    caching allocator's settings."""
    analysis = analyzer.analyze(FIXTURES / "kineto" / "train.pt.trace.json.gz")
    assert [d.device for d in analysis.devices] == [-1]
    d = analysis.devices[0].diagnosis
    assert "GPU remedies do not act on it" not in d.verdict
    assert not {"expandable_segments", "max_split_size"} & {r["id"] for r in d.remedies}


def test_host_memory_beside_a_gpu_gets_no_remedies_and_never_leads():
    path = REAL / "tracelens" / "Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
    if not path.exists():
        pytest.skip(f"real recordings not found at {REAL}")
    from analyzer.report.view import build_view
    analysis = analyzer.analyze(path)
    host = analysis.device(-1)
    assert host.diagnosis.remedies == [] and host.diagnosis.verdict.startswith("CPU (host memory): peak")
    view = build_view(analysis)
    assert view.lead_device == 0 and view.devices[-1].device == -1 and "GPU remedies do not act" not in view.verdict


# ---- quantized weights: only weights nothing trains, a quarter of the peak or more -----------------------------
QUANTIZE_TOTAL = 100 * GiB
QUANTIZE_AT = math.ceil(QUANTIZE_SHARE * QUANTIZE_TOTAL)
QUANTIZED = {"weight_quantization", "weight_quantization_4bit"}


def _weights(parameters: int, **kw) -> Demand:
    return Demand(**{"total": QUANTIZE_TOTAL, "capacity": 80 * GiB, "world_size": 1, "layers": None, "oomed": True,
                     "by_category": {"parameter": parameters, "activation": QUANTIZE_TOTAL - parameters}, **kw})


@pytest.mark.parametrize(("parameters", "offered"), [(QUANTIZE_AT, True), (QUANTIZE_AT - 1, False)], ids=["at", "below"])
def test_quantized_weights_are_offered_from_a_quarter_of_the_peak(parameters, offered):
    remedies = {r["id"]: r for r in rank_remedies(_weights(parameters, workload="forward_only"))}
    assert (QUANTIZED <= set(remedies)) is offered
    if offered:   # of 16-bit weights: half saved at 8 bits, three quarters at 4
        assert remedies["weight_quantization"]["saved_bytes"] == parameters // 2
        assert remedies["weight_quantization_4bit"]["saved_bytes"] == parameters * 3 // 4


def test_weights_that_train_are_not_quantized():
    assert not QUANTIZED & {r["id"] for r in rank_remedies(_weights(60 * GiB, workload="training"))}


@pytest.mark.parametrize(("frozen", "offered"), [(QUANTIZE_SHARE / 0.6, True), (QUANTIZE_SHARE / 0.6 - 0.01, False)],
                         ids=["at", "below"])
def test_a_frozen_base_is_quantized_as_qlora_from_a_quarter_of_the_peak(frozen, offered):
    """60 GiB of parameters, a share of them frozen: the frozen part (not the trained adapters) is what can be
    quantized, so it must itself be a quarter of the peak."""
    remedies = {r["id"]: r for r in rank_remedies(_weights(60 * GiB, workload="training", frozen_share=frozen))}
    assert ("weight_quantization" in remedies) is offered
    if offered:
        assert remedies["weight_quantization"]["title"].endswith("for the frozen base (QLoRA)")
        assert remedies["weight_quantization"]["saved_bytes"] == int(60 * GiB * frozen) // 2


@pytest.mark.parametrize(("phase", "offered"), [("load", True), ("forward", False)])
def test_an_oom_while_loading_the_model_is_offered_quantized_loading(phase, offered):
    """A run that ran out of memory before showing any training (workload unknown): quantized loading acts
    when it failed while loading the weights, not in the forward of a run that may train them."""
    remedies = {r["id"]: r for r in rank_remedies(_weights(60 * GiB, workload="unknown", oom_phase=phase))}
    assert ("weight_quantization" in remedies) is offered
    if offered:
        assert remedies["weight_quantization"]["title"].endswith("when loading, if these weights are not trained")


# ---- pipeline parallelism: a run that trains, on more than one GPU, with repeated blocks ------------------------
def _pipeline(**kw) -> Demand:
    return _training(90 * GiB, **{"oomed": True, "world_size": 4, "layers": 32, **kw})


@pytest.mark.parametrize(("layers", "offered"), [(PIPELINE_MIN_LAYERS, True), (PIPELINE_MIN_LAYERS - 1, False),
                                                 (None, False)], ids=["two", "one", "none seen"])
def test_pipeline_stages_need_repeated_blocks(layers, offered):
    assert ("pipeline_parallel" in _ids(_pipeline(layers=layers))) is offered


def test_pipeline_parallelism_holds_one_stage_of_states_and_in_flight_activations():
    """1F1B over S stages with the batch as S micro-batches: the first stage holds 1/S of the model states and,
    S micro-batches of 1/S in flight over L/S layers, 1/S of the activations and temporaries."""
    demand = _pipeline()
    remedy = next(r for r in rank_remedies(demand) if r["id"] == "pipeline_parallel")
    staged = demand.bytes("parameter", "gradient", "optimizer_state", "activation", "temporary")
    assert remedy["saved_bytes"] == int(staged * (1 - 1 / 4))
    assert remedy["title"] == ("Pipeline parallelism over 4 GPUs: the 32 layers as 4 stages (1F1B, the batch as 4 "
                               "micro-batches)")
    assert "over 2 GPUs: the 2 layers as 2 stages" in next(
        r["title"] for r in rank_remedies(_pipeline(layers=2)) if r["id"] == "pipeline_parallel")


@pytest.mark.parametrize(("world_size", "workload"), [(1, "training"), (4, "forward_only")])
def test_pipeline_parallelism_needs_gpus_and_a_run_that_trains(world_size, workload):
    assert "pipeline_parallel" not in _ids(_pipeline(world_size=world_size, workload=workload))


def test_layers_are_counted_from_qualified_names_or_from_a_loops_calls():
    assert count_layers(["model.layers.0.mlp", "model.layers.1.attn", "model.norm"]) == 2
    calls = [f"train.py:9 step › model.py:382 forward[{i}] › model.py:101 forward" for i in range(12)]
    assert count_layers(calls) == 12
    assert count_layers(["train.py:9 step › model.py:382 forward[0]", "model.py:40 forward"]) is None


def test_a_recording_that_runs_out_while_loading_is_offered_quantized_loading_first():
    """Eleven 1 GiB weights loaded on a 12 GiB card, then a 2 GiB one fails: nothing trained yet (workload
    unknown), the OOM in the load phase: 8-bit weights (6.5 GiB) fit and are what to try first."""
    rec = Recording()
    with rec.step(1), rec.phase("load"):
        for i in range(11):
            rec.alloc(GiB, where=f"model.py:{10 + i}")
        rec.oom(2 * GiB, device_free=GiB)
    d = analyzer.analyze(rec.trace(), gpu_memory=12 * GiB, world_size=1).devices[0].diagnosis
    assert d.workload.kind == "unknown"
    first = next(r for r in d.remedies if r["try_first"])
    assert first["id"] == "weight_quantization" and first["fits"]
    assert first["title"].endswith("when loading, if these weights are not trained")
    assert first["saved_bytes"] == 13 * GiB // 2 and "8-bit weights" in d.verdict
