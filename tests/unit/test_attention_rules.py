"""Attention and caches (issue 32): eager attention's s x s tensors offered fused attention with their bytes, no
attention advice for a model without attention, a forward-only run's KV cache named with its remedies, and the
verdict of a recording whose peak is mostly memory made before it began. Each rule on both sides, on the real
recordings where it was seen (../shared/real, skipped when absent) and on small tables built here.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import analyzer
from analyzer.attribute import attribute
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, RECORD_HISTORY, FindingKind, RemedyId
from analyzer.diagnose import kv_cache
from analyzer.diagnose.attention import cache_call_ends, score_tensors
from analyzer.diagnose.before_recording import UNSEEN_SHARE, unseen
from analyzer.diagnose.context import make_context
from analyzer.diagnose.counterfactual import recorded_settings, recorded_stream, replay
from analyzer.diagnose.remedies import BY_ID, Demand
from analyzer.diagnose.transforms import NUDGE, Stream
from analyzer.ingest import load
from analyzer.pipeline import measure
from support.paths import REAL

MiB, GiB = 1 << 20, 1 << 30
RELEVANT_SHARE = 0.05     # remedies.RELEVANT_SHARE: what a remedy acts on must be 5% of the peak
KV_CACHE_SHARE = 0.05     # kv_cache.KV_CACHE_SHARE: a cache of 5% of the peak is named
UNSEEN = 0.5              # diagnose.UNSEEN_SHARE: half the peak made before the recording leads the verdict
WEDSONLIN = "wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle"
QWEN = "tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"
SKETCHKV = "lfielike-sketchkv2/my_snapshot.pickle"
RESNET = "kineto-tb_plugin/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz"


def _path(relative: str) -> Path:
    path = REAL / relative
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    return path


def _gpu(relative: str) -> Any:
    """The first GPU's diagnosis of a real recording."""
    return next(d for d in analyzer.analyze(_path(relative)).devices if d.device >= 0).diagnosis


def _context(relative: str, device: int = 0) -> Any:
    trace = attribute(load(_path(relative)))
    return make_context(trace, measure(trace, device), None, None)


def _remedies(diagnosis: Any) -> dict[str, Any]:
    return {r["id"]: r for r in diagnosis.remedies}


# ---- eager attention: a softmax over a matmul, b·h·s² ----------------------------------------------------------
def test_eager_attentions_scores_are_offered_fused_attention_with_their_replayed_bytes():
    """wedsonlin: 16 heads, 1024 positions, batch 4: b·h·s² = 2**26 elements, 128 MiB of bf16 scores and 256 MiB
    of fp32 probabilities per layer; fused attention is listed before halving the micro-batch, with bytes."""
    ctx = _context(WEDSONLIN)
    live = ctx.d.peak.live
    scores = score_tensors(ctx.allocations, ctx.trace.stacks, "allocated_bytes")
    kept = live[live["alloc_id"].isin(ctx.allocations.loc[scores, "alloc_id"])]
    assert set(kept["allocated_bytes"]) == {2**26 * 2, 2**26 * 4}
    measured = int(kept["allocated_bytes"].sum())
    assert measured > 0.4 * ctx.d.peak.allocated_bytes
    d = _gpu(WEDSONLIN)
    remedies = _remedies(d)
    fused = remedies[RemedyId.FUSED_ATTENTION]
    assert fused["saving_source"] == "replay" and fused["saved_bytes"] > 0.9 * measured
    assert fused["rank"] < remedies[RemedyId.MICRO_BATCH]["rank"]
    assert "eager attention's s x s scores and probabilities hold" in d.verdict
    assert "GQA/MQA, fewer or narrower layers" in remedies[RemedyId.MODEL_CHANGES]["title"]


@pytest.mark.parametrize("relative", [QWEN, "nothanmin-cs336-a2/memory_snapshot_forward.pickle"])
def test_attention_that_is_fused_already_is_not_offered_fused_attention(relative: str):
    assert RemedyId.FUSED_ATTENTION not in _remedies(_gpu(relative))


def test_a_cnn_is_offered_no_attention_change():
    remedies = _remedies(_gpu(RESNET))
    assert RemedyId.FUSED_ATTENTION not in remedies
    title = remedies[RemedyId.MODEL_CHANGES]["title"]
    assert "attention" not in title.lower() and "GQA" not in title


def _stacks(*rows: tuple[int, str | None, str]) -> pd.DataFrame:
    """Stacks of one Python frame each: (id, op, function)."""
    return pd.DataFrame({"stack_id": [r[0] for r in rows], "frames": [[("model.py", 1, r[2])] for r in rows],
                         "top_user_frame": [f"model.py:1 {r[2]}" for r in rows], "op": [r[1] for r in rows]})


def _rows(*rows: tuple[str, int, str, int, str]) -> pd.DataFrame:
    """Allocations: (module, bytes, phase, stack id, category), step 1."""
    return pd.DataFrame({"module": [r[0] for r in rows], "bytes": [r[1] for r in rows], "phase": [r[2] for r in rows],
                         "stack_id": [r[3] for r in rows], "category": [r[4] for r in rows], "step": 1})


STACKS = _stacks((0, "aten::bmm", "forward"), (1, "aten::_softmax", "forward"), (2, "aten::addmm", "forward"),
                 (3, "aten::_log_softmax", "forward"), (4, "aten::mul", "forward"),
                 (5, "aten::_softmax_backward_data", "forward"))


def test_a_softmax_over_a_matmul_in_repeated_blocks_is_attention_with_its_gradients():
    s2 = 4 * 16 * 256 * 256        # b·h·s² elements
    rows = _rows(("layers.0.attn", s2 * 2, "forward", 0, "activation"),      # scores, bf16
                 ("layers.0.attn", s2 * 4, "forward", 1, "activation"),      # probabilities, fp32
                 ("layers.0.attn", s2 * 4, "backward", 5, "temporary"),      # their gradient
                 ("layers.1.attn", s2 * 2, "forward", 0, "activation"),
                 ("layers.1.attn", s2 * 4, "forward", 1, "activation"),
                 ("layers.1.mlp", s2 * 4, "forward", 2, "activation"))       # a Linear's output of that size
    assert score_tensors(rows, STACKS, "bytes").tolist() == [True] * 5 + [False]


def test_a_softmax_without_a_matmul_or_outside_blocks_is_not_attention():
    s2 = 4 * 16 * 256 * 256
    head = _rows(("layers.0.head", s2 * 4, "forward", 1, "activation"),         # no matmul of its size
                 ("layers.0.head", s2, "forward", 0, "activation"))
    assert not score_tensors(head, STACKS, "bytes").any()
    loss = _rows(("lm_head", s2 * 4, "forward", 0, "activation"), ("lm_head", s2 * 4, "forward", 1, "activation"))
    assert not score_tensors(loss, STACKS, "bytes").any(), "no repeated block: a classifier's softmax"
    log = _rows(("layers.0.attn", s2 * 2, "forward", 0, "activation"), ("layers.0.attn", s2 * 4, "forward", 3, "activation"))
    assert not score_tensors(log, STACKS, "bytes").any(), "log_softmax is a loss, not attention"
    small = _rows(("layers.0.attn", MiB // 2, "forward", 0, "activation"), ("layers.0.attn", MiB - 4, "forward", 1, "activation"))
    assert not score_tensors(small, STACKS, "bytes").any(), "under SCORES_MIN_BYTES (1 MiB)"


def test_the_attention_share_is_a_threshold_of_the_python_api():
    """wedsonlin's s x s tensors hold 44.9% of its peak (10.12 of 22.55 GiB): named and offered fused attention at
    the default 5%, neither at a share tuned to 45%."""
    assert analyzer.Thresholds().attention_share == RELEVANT_SHARE
    tuned = next(d for d in analyzer.analyze(_path(WEDSONLIN), thresholds=analyzer.Thresholds(attention_share=0.45))
                 .devices if d.device >= 0).diagnosis
    assert RemedyId.FUSED_ATTENTION not in _remedies(tuned)
    assert "eager attention's s x s" not in tuned.verdict and "activations are 73% of the peak" in tuned.verdict


@pytest.mark.parametrize("share,offered", [(RELEVANT_SHARE, True), (RELEVANT_SHARE - 0.001, False)])
def test_fused_attention_is_offered_from_5_percent_of_the_peak(share: float, offered: bool):
    total = 100 * GiB
    d = Demand(total=total, by_category={"activation": 60 * GiB, "parameter": 40 * GiB}, capacity=None, world_size=1,
               layers=8, attention_scores={"activation": int(share * total)}, attention=True)
    assert BY_ID[RemedyId.FUSED_ATTENTION].applies(d) is offered


# ---- a KV cache --------------------------------------------------------------------------------------------------
def test_a_forward_only_runs_kv_cache_is_named_with_its_remedies():
    """Qwen1.5-0.5B under inference_mode, batch 16 x 559 tokens: K and V of [16, 16, 559, 64] in bf16 per layer,
    24 layers, kept past each layer's call."""
    per_layer = 2 * (16 * 16 * 559 * 64 * 2)
    d = _gpu(QWEN)
    finding = next(f for f in d.findings if f.kind == FindingKind.KV_CACHE)
    assert finding.bytes == 24 * per_layer and finding.evidence.details.layers == 24
    remedies = _remedies(d)
    assert remedies[RemedyId.KV_CACHE_OFF]["saving_source"] == "replay"       # replayed: see the tests below
    assert remedies[RemedyId.KV_CACHE_QUANTIZED]["saving_source"] == "replay"
    assert remedies[RemedyId.MODEL_CHANGES]["saved_bytes"] == 24 * per_layer * 3 // 4     # GQA: a formula
    assert remedies[RemedyId.MODEL_CHANGES]["saving_source"] == "formula"
    assert RemedyId.NO_GRAD not in remedies
    assert "a KV cache holds 0.82 GiB of it (42%)" in d.verdict
    assert d.workload.summary.endswith("activations kept with autograd off (inference_mode): a KV cache, not a graph")


def _qwen_replays() -> tuple[int, int, dict[str, Any]]:
    """Qwen's recorded peak, the allocator model's peak of the recorded stream as it is, and the diagnosis'
    remedies."""
    ctx = _context(QWEN)
    identity = replay(recorded_stream(ctx.trace, 0), None, recorded_settings(ctx.trace)).peak_allocated_bytes
    return ctx.d.peak.allocated_bytes, identity, _remedies(_gpu(QWEN))


def test_use_cache_false_is_replayed_each_layers_k_and_v_freed_when_its_attention_returns():
    """Qwen's peak (2,088,508,416 B) is in layer 23's MLP, after every layer's attention has returned: without
    a cache the 24 layers' K and V (879,230,976 B) are all gone there. The replay's peak is that, 1,209,277,440 B,
    plus the allocator model's rounding (at most what it adds to the recorded stream as it is: 3,704,320 B); the
    saving is measured at the replayed peak, not taken from the formula."""
    per_layer = 2 * (16 * 16 * 559 * 64 * 2)
    peak, identity, remedies = _qwen_replays()
    off = remedies[RemedyId.KV_CACHE_OFF]
    replayed = off["replay"]["peak_allocated_bytes"]
    assert 0 <= replayed - (peak - 24 * per_layer) <= identity - peak < 0.002 * peak
    assert off["saved_bytes"] == peak - replayed and off["new_peak_bytes"] == replayed


def test_a_quantized_cache_is_replayed_at_half_its_bytes():
    """Each of Qwen's 48 cache tensors (18,317,312 B) at half its bytes: the replayed peak is the recorded
    stream's, as the allocator model replays it, less half of 24 layers' K and V, to the byte."""
    per_layer = 2 * (16 * 16 * 559 * 64 * 2)
    _, identity, remedies = _qwen_replays()
    quantized = remedies[RemedyId.KV_CACHE_QUANTIZED]
    assert quantized["replay"]["peak_allocated_bytes"] == identity - 12 * per_layer


def test_the_kv_cache_transforms_act_on_no_training_run():
    """wedsonlin trains (backward, optimizer state): no cache remedy is offered, and the transforms, asked
    anyway, leave its stream as it is (the replay would judge nothing)."""
    remedies = _remedies(_gpu(WEDSONLIN))
    assert not {RemedyId.KV_CACHE_OFF, RemedyId.KV_CACHE_QUANTIZED} & set(remedies)
    stream = recorded_stream(_context(WEDSONLIN).trace, 0)
    assert stream is not None
    assert kv_cache.uncached(stream) is stream and kv_cache.cache_scaled(stream, 0.5) is stream


def test_a_cache_without_an_allocation_history_keeps_the_formula():
    """SketchKV2's cache (2.71 GiB) was alive at the dump with no history of its allocations: no stream to edit,
    so use_cache=False saves the cache's bytes at the peak, a formula, and says so."""
    d = _gpu(SKETCHKV)
    finding = next(f for f in d.findings if f.kind == FindingKind.KV_CACHE)
    off = _remedies(d)[RemedyId.KV_CACHE_OFF]
    assert off["saving_source"] == "formula" and off["replay"] is None and off["saved_bytes"] == finding.bytes


def _attention_call(i: int, kept: bool) -> list[tuple[str, float, float]]:
    """Layer i's forward (module, made, freed): K in its attention (kept to the end, or not), a tensor of the
    layer itself (a rotary table), a score freed inside the attention, then its MLP."""
    attention = _block(i)
    layer = MODULE_PATH_SEPARATOR.join(["Model_0", f"DecoderLayer_{i}"])
    mlp = MODULE_PATH_SEPARATOR.join(["Model_0", f"DecoderLayer_{i}", f"MLP_{i}"])
    start = 10.0 * i
    return [(attention, start, 100.0 if kept else start + 2), (layer, start + 0.5, start + 3),
            (attention, start + 1, start + 2), (mlp, start + 4, start + 5)]


def test_use_cache_false_frees_each_cache_tensor_when_its_attention_returns():
    """Two layers under inference_mode: K (made at 0 and 10, kept to 100) is freed just after its attention's
    last allocation in its layer's call (1 and 11; the layer's own tensor between them does not end it), before
    the layer's MLP; nothing else moves."""
    rows = [r for i in range(2) for r in _attention_call(i, kept=True)]
    stream = Stream(rows=pd.DataFrame({"at": [r[1] for r in rows], "until": [r[2] for r in rows], "bytes": 64,
                                       "stream": 0, "category": "activation", "phase": "forward",
                                       "module": [r[0] for r in rows], "step": 1.0, "stack_id": np.nan}),
                    releases=np.array([]), stacks=_stacks(), grad_mode="inference_mode")
    assert kv_cache.uncached(stream).rows["until"].tolist() == [1 + NUDGE / 2, 3, 2, 5, 11 + NUDGE / 2, 13, 12, 15]
    assert kv_cache.cache_scaled(stream, 0.5).rows["bytes"].tolist() == [32, 64, 64, 64] * 2
    assert kv_cache.uncached(replace(stream, grad_mode="enabled")).rows.equals(stream.rows), \
        "autograd on: the same tensors may be the graph, which no_grad addresses"


def test_a_cache_the_frames_show_quantized_is_not_offered_quantization():
    d = _gpu(SKETCHKV)
    finding = next(f for f in d.findings if f.kind == FindingKind.KV_CACHE)
    assert finding.evidence.details.quantized is True
    remedies = _remedies(d)
    assert RemedyId.KV_CACHE_QUANTIZED not in remedies and RemedyId.KV_CACHE_OFF in remedies
    assert RemedyId.NO_GRAD not in remedies, "the activations kept are the cache, not a graph"
    assert "activations kept (a KV cache, and maybe an autograd graph: the recording cannot tell)" in d.workload.summary


def test_a_training_runs_activations_are_no_kv_cache():
    ctx = _context(WEDSONLIN)
    assert kv_cache.kv_cache_at_peak(ctx) == kv_cache.NONE and not kv_cache.detect(ctx)


@pytest.mark.parametrize("share,named", [(0.42, True), (0.43, False)])
def test_the_kv_cache_is_named_from_its_share_of_the_peak(share: float, named: bool):
    """Qwen's cache is 879,230,976 of 2,088,508,416 bytes at the peak: 42.1%."""
    assert kv_cache.KV_CACHE_SHARE == KV_CACHE_SHARE
    assert bool(kv_cache.detect(_context(QWEN), share=share)) is named


def test_the_kv_cache_share_is_a_threshold_of_the_python_api():
    """Qwen's 42.1% cache is named at the default 5% and not when the share is tuned to 43%."""
    assert analyzer.Thresholds().kv_cache_share == KV_CACHE_SHARE
    tuned = next(d for d in analyzer.analyze(_path(QWEN), thresholds=analyzer.Thresholds(kv_cache_share=0.43)).devices
                 if d.device >= 0).diagnosis
    assert not [f for f in tuned.findings if f.kind == FindingKind.KV_CACHE]
    assert RemedyId.KV_CACHE_OFF not in _remedies(tuned)


def _block(i: int) -> str:
    return MODULE_PATH_SEPARATOR.join(["Model_0", f"DecoderLayer_{i}", f"Attention_{i}"])


def _allocations(kept: bool) -> pd.DataFrame:
    """Two layers' forward: each makes K in its attention, kept to the end (a cache) or freed inside the layer."""
    rows = []
    for i in range(2):
        start = 10 * i
        rows.append((_block(i), start, 100 if kept else start + 2))     # K
        rows.append((_block(i), start + 1, start + 3))                  # a score, freed inside
        rows.append((MODULE_PATH_SEPARATOR.join(["Model_0", f"DecoderLayer_{i}", f"MLP_{i}"]), start + 4, start + 5))
    return pd.DataFrame({"module": [r[0] for r in rows], "seq_alloc": [r[1] for r in rows],
                         "seq_free": [r[2] for r in rows], "phase": "forward", "category": "activation",
                         "step": 1, "stack_id": None, "alloc_id": range(len(rows)), "allocated_bytes": 64})


def test_attention_tensors_kept_past_their_layer_are_a_cache_only_with_autograd_off():
    stacks = _stacks()
    assert cache_call_ends(_allocations(kept=True), stacks).notna().tolist() == [True, False, False] * 2
    assert not cache_call_ends(_allocations(kept=True), stacks, structural=False).notna().any(), \
        "autograd on or unknown: the same tensors may be the graph"
    assert not cache_call_ends(_allocations(kept=False), stacks).notna().any(), "nothing outlives its layer: no cache"


# ---- memory made before the recording began ----------------------------------------------------------------------
def test_a_peak_mostly_made_before_the_recording_says_so_and_how_to_see_it():
    d = _gpu(SKETCHKV)
    assert d.verdict.startswith("Peak 15.27 GiB allocated on cuda:0: 12.55 GiB of it (82%) was allocated before "
                                "the recording began")
    assert "a KV cache holds 2.71 GiB of it (18%)" in d.verdict and "activations are" not in d.verdict
    assert f"To see what the 12.55 GiB is, call {RECORD_HISTORY} before the model is loaded" in d.verdict


@pytest.mark.parametrize("share,said", [(0.82, True), (0.83, False)])
def test_memory_made_before_the_recording_leads_from_half_the_peak(share: float, said: bool):
    """SketchKV2's 12.55 GiB of 15.27 GiB made before its only recorded event: 82.2%."""
    assert UNSEEN_SHARE == UNSEEN
    clause, how_to_see = unseen(_context(SKETCHKV), share)
    assert bool(clause) is said and bool(how_to_see) is said


def test_the_unseen_share_is_a_threshold_of_the_python_api():
    """SketchKV2's 82.2% made before the recording leads its verdict at the default half, and not at 83%."""
    assert analyzer.Thresholds().unseen_share == UNSEEN
    tuned = next(d for d in analyzer.analyze(_path(SKETCHKV), thresholds=analyzer.Thresholds(unseen_share=0.83)).devices
                 if d.device >= 0).diagnosis
    assert tuned.verdict.startswith("Peak 15.27 GiB allocated on cuda:0: a KV cache holds 2.71 GiB of it (18%)")
    assert "was allocated before the recording began" not in tuned.verdict and "To see what" not in tuned.verdict


def _decode(sizes: list[list[int]]) -> pd.DataFrame:
    """Two layers run once per call (a prefill, then decode steps); in call c each layer's attention makes K of
    sizes[c][layer] bytes, kept until that layer's next call makes its own (torch.cat of past and new)."""
    rows, seq = [], 0
    calls = len(sizes)
    for c in range(calls):
        for layer in range(2):
            rows.append((_block(layer), seq, sizes[c][layer], c, layer))
            rows.append((_block(layer), seq + 1, 8, -1, layer))            # a temporary freed in the call
            seq += 3
    table = pd.DataFrame(rows, columns=["module", "seq_alloc", "allocated_bytes", "call", "layer"])
    free = []
    for row in table.itertuples():
        if row.call < 0:
            free.append(row.seq_alloc + 1)
            continue
        later = table[(table["layer"] == row.layer) & (table["call"] == row.call + 1)]
        free.append(float(later["seq_alloc"].iloc[0]) + 0.5 if len(later) else 1000.0)
    return table.assign(seq_free=free, phase="forward", category="activation", step=1, stack_id=None,
                        alloc_id=range(len(table)))[["module", "seq_alloc", "seq_free", "allocated_bytes", "phase",
                                                     "category", "step", "stack_id", "alloc_id"]]


@pytest.mark.parametrize("sizes,cache", [
    ([[100, 100], [110, 110], [120, 120]], True),      # decode steps: each layer's K grows by a token a step
    ([[100, 100], [100, 100], [100, 100]], False),     # repeated forwards keeping the same: outputs, not a cache
    ([[100, 100]], True),                               # one call (a prefill): growth cannot be seen
])
def test_a_cache_kept_across_decode_steps_must_grow(sizes: list[list[int]], cache: bool):
    assert bool(cache_call_ends(_decode(sizes), _stacks()).notna().any()) is cache


@pytest.mark.parametrize("relative,title,kv", [
    (QWEN, "Halve the batch (or the sequence length)", True),                     # a KV cache of 42%
    ("tracelens/gaunernst_bert-small-uncased__1016001.json.gz", "Halve the batch (or the sequence length)", False),
    ("hugepanda-octree-nca/inference2_peso_oct.pickle", "Halve the batch (or the input size)", False),  # convolutions
])
def test_a_forwards_smaller_batch_names_the_kv_cache_only_where_there_is_one(relative: str, title: str, kv: bool):
    """A BERT forward and a CNN keep no KV cache: their smaller batch does not say it shrinks one; a CNN's input is
    an image, not a sequence."""
    batch = _remedies(_gpu(relative))[RemedyId.MICRO_BATCH]
    assert batch["title"] == title
    assert ("KV cache" in batch["how"]) is kv
