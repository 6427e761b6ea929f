"""Advice on every real recording in ../shared/real (issue 18's done-bar), with the card SOURCES.md / TRUTH.md
name where they name one: a run that fits gets no try-first, no listed remedy saves 0 B or less or is one
the workload cannot use, the list is in the cost order with try-first the cheapest that fits, fragmentation
is warned of only at a moment where it nearly caused an OOM, and a profiler trace states no segment figure."""
from __future__ import annotations

from pathlib import Path

import pytest

import analyzer
from analyzer.core.units import human_bytes, parse_bytes
from analyzer.diagnose.fragmentation import NEAR_OOM_SHARE
from analyzer.diagnose.remedies import CONDITIONAL, FIT_HEADROOM, LAYOUT_ONLY, REMEDIES
from analyzer.report.view import build_view
from analyzer.result import Analysis
from support.paths import REAL

# file: (--gpu-memory, --gpus) as SOURCES.md / TRUTH.md (or issue 18's own commands) state the card
CARDS: dict[str, tuple[str | None, int | None]] = {
    "constructor-sun-code_location/memory_snapshot.pickle": (None, 4),
    "kkaitlyn111-cs336-a2/memory_snapshot.pickle": ("80GiB", 1),          # "an 80 GB-class GPU"
    "hugepanda-octree-nca/inference2_peso_oct.pickle": ("24GiB", 1),      # "24 GB-class GPU"
    "hta/df_index_resolver.json.gz": ("32GiB", 2),                        # V100-SXM2-32GB, rank 1 of 2
    "cwilson51-colloquium/train_batch_128_nworkers_6_memory_broken.json": ("20GiB", 1),  # A100 MIG 4g.20gb
    "tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz": ("80GiB", 1),    # H100 80GB
    "zidongliu-decomfl/memory.pickle": ("24GiB", 1),                      # issue 18's command
    "yiyi-llm-inference/oom_snapshot.pickle": ("12GiB", 1),               # issue 18's command
}
ORDER = [r.id for r in REMEDIES]
TRAINING_ONLY = {"gradient_accumulation", "activation_checkpointing", "bf16", "zero1", "zero2", "zero3", "pipeline_parallel"}
SHARDING = {"zero1", "zero2", "zero3", "tensor_parallel", "pipeline_parallel", "sharded_save"}


def _files() -> list[Path]:
    if not REAL.is_dir():
        return []
    return sorted(p for p in REAL.rglob("*") if p.is_file() and p.suffix in (".pickle", ".pkl", ".gz", ".json")
                  and p.name != "truth.json")


FILES = _files()
_CACHE: dict[str, Analysis | None] = {}


def _analysis(path: Path) -> Analysis | None:
    name = str(path.relative_to(REAL))
    if name not in _CACHE:
        memory, gpus = CARDS.get(name, (None, 1))
        result = analyzer.analyze(path, parse_bytes(memory) if memory else None, gpus)
        _CACHE[name] = result if isinstance(result, Analysis) else None
    return _CACHE[name]


def test_real_recordings_are_here():
    if not REAL.is_dir():
        pytest.skip(f"real recordings not found at {REAL}")
    assert len(FILES) >= 30


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(REAL)) for p in FILES])
def test_the_advice_holds(path: Path):
    analysis = _analysis(path)
    if analysis is None:
        pytest.skip("a set of ranks: each rank is an analysis of its own")
    segmented = analysis.trace.has_segments
    gpu_present = any(d.device >= 0 for d in analysis.devices)
    for d in analysis.devices:
        dx = d.diagnosis
        remedies = dx.remedies
        if d.device < 0 and gpu_present:
            assert remedies == [] and dx.verdict.endswith("GPU remedies do not act on it")
        if dx.fits is not None:
            assert not any(r["try_first"] for r in remedies) and "Try first" not in dx.verdict
            assert d.oom is None and dx.fits["peak_bytes"] <= 0.8 * dx.fits["capacity_bytes"]
        assert all(r["saved_bytes"] is None or r["saved_bytes"] > 0 for r in remedies)
        # cost order (allocator settings lead only at a fragmentation OOM), ranks as listed
        layout_first = any(f.kind == "oom" and f.verdict == "fragmentation" for f in dx.findings)
        key = [(layout_first and r["id"] not in LAYOUT_ONLY, ORDER.index(r["id"])) for r in remedies]
        assert key == sorted(key) and [r["rank"] for r in remedies] == list(range(1, len(remedies) + 1))
        first = [r for r in remedies if r["try_first"]]
        assert len(first) <= 1
        if first and d.capacity_bytes is not None and first[0]["id"] != "fix_leak":
            before = remedies[: remedies.index(first[0])]
            assert not any(r["fits"] and r["id"] not in CONDITIONAL for r in before)
        if dx.plan is not None and dx.plan["fits"]:   # one try-first: the plan's first step, in the list and verdict
            assert [r["id"] for r in first] == [dx.plan["steps"][0]["remedy"]]
            assert (first[0]["plan_step"] is None) is dx.plan["single"]
            assert ("Try first, as the plan below" in dx.verdict) is not dx.plan["single"]
        ids = {r["id"] for r in remedies}
        workload = dx.workload
        if workload.kind == "forward_only":
            assert not TRAINING_ONLY & ids
        if workload.mixed_precision_on:
            assert "bf16" not in ids
        if workload.gpus == 1:
            assert not SHARDING & ids
        for f in dx.findings:
            if f.kind == "fragmentation":
                details = f.evidence.details.picture
                assert details.event_index == d.peak.event_index
                assert details.reserved_bytes >= NEAR_OOM_SHARE * d.capacity_bytes
        if not segmented and dx.fragmentation is not None:
            assert dx.fragmentation.largest_free_block_bytes is None
            assert dx.fragmentation.external_bytes is None and dx.fragmentation.segments == []
    view = build_view(analysis)
    if gpu_present and view.lead_device is not None:
        assert view.lead_device >= 0 and "GPU remedies do not act on it" not in view.verdict
        assert [v.device < 0 for v in view.devices] == sorted(v.device < 0 for v in view.devices)
    if not segmented:
        for v in view.devices:
            assert v.end["largest_free_block_bytes"] is None


def _one(name: str) -> analyzer.DeviceAnalysis:
    path = REAL / name
    if not path.exists():
        pytest.skip(f"real recordings not found at {REAL}")
    analysis = _analysis(path)
    assert analysis is not None
    return max(analysis.devices, key=lambda d: d.peak.allocated_bytes)


def test_a_small_job_on_a_big_card_fits():
    d = _one("zidongliu-decomfl/memory.pickle")
    assert d.diagnosis.fits is not None and "Fits: peak 1.66 GiB of 24.00 GiB, 22.34 GiB headroom" in d.diagnosis.verdict


def test_inference_on_one_gpu_is_not_told_to_shard():
    d = _one("yiyi-llm-inference/oom_snapshot.pickle")
    assert d.diagnosis.workload.kind == "forward_only"
    ids = [r["id"] for r in d.diagnosis.remedies]
    assert not SHARDING & set(ids) and "offload" in ids
    assert next(r for r in d.diagnosis.remedies if r["try_first"])["id"] == "weight_quantization"


def test_a_run_under_autocast_is_not_offered_bf16_nor_warned_of_its_cache():
    d = _one("wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle")
    assert d.diagnosis.workload.mixed_precision_on is True
    assert "bf16" not in {r["id"] for r in d.diagnosis.remedies}
    assert not [f for f in d.diagnosis.findings if f.kind == "fragmentation"]
    picture = d.diagnosis.fragmentation
    assert picture.event_index == d.peak.event_index
    assert picture.allocated_bytes >= 0.9 * picture.reserved_bytes   # at the peak the reserve is used


def test_cache_released_at_the_start_is_not_offered_back():
    d = _one("kkaitlyn111-cs336-a2/memory_ctx512_forward.pickle")
    assert "expandable_segments" not in {r["id"] for r in d.diagnosis.remedies}
    assert d.diagnosis.fragmentation.event_index == d.peak.event_index


def test_equal_savings_on_the_oom_device_are_explained():
    d = _one("constructor-sun-code_location/memory_snapshot.pickle")
    assert d.device == 1
    remedies = d.diagnosis.remedies

    def alike(r: dict, first: dict) -> bool:
        return (r["saved_bytes"] is not None and first["saved_bytes"] is not None
                and abs(r["saved_bytes"] - first["saved_bytes"]) <= 0.01 * d.diagnosis.demand_bytes)

    # the first remedy a later one saves the same as (balance_scatter leads here, and nothing saves what it saves)
    first = next(f for i, f in enumerate(remedies) if any(alike(r, f) for r in remedies[i + 1:]))
    assert first["id"] == "micro_batch"
    same = [r for r in remedies[first["rank"]:] if alike(r, first)]
    assert same and all(r["note"] and r["note"].startswith(f"the same saving as #{first['rank']}") for r in same
                        if human_bytes(r["saved_bytes"]) == human_bytes(first["saved_bytes"]))
    # issue 33.4: savings within 1% that print differently are not called the same
    assert all(r["note"].startswith(f"about the same saving ({human_bytes(r['saved_bytes'])} against "
                                    f"{human_bytes(first['saved_bytes'])}) as #{first['rank']}") for r in same
               if human_bytes(r["saved_bytes"]) != human_bytes(first["saved_bytes"]))
    assert all("over 4 GPUs" in r["title"] for r in remedies if r["id"] in SHARDING)


# real recordings on a card their run does not fit, at most one single change fitting (--gpus 1): a plan of
# several changes whose last step's prediction (replayed where a transform exists) fits
SQUEEZED = [("wedsonlin-cs336-a2/medium_1024_training_memory_snapshot.pickle", 0.3),
            ("kkaitlyn111-cs336-a2/memory_ctx512_forward.pickle", 0.3),
            ("nothanmin-cs336-a2/memory_snapshot_forward.pickle", 0.3),
            ("maphsge4-select_n/04d383c/snapshot.pickle", 0.3),
            ("constructor-sun-code_location/memory_snapshot.pickle", 0.5)]


@pytest.mark.parametrize(("name", "share"), SQUEEZED, ids=[n for n, _ in SQUEEZED])
def test_a_run_no_single_change_fits_gets_a_plan_that_fits(name: str, share: float):
    path = REAL / name
    if not path.exists():
        pytest.skip(f"real recordings not found at {REAL}")
    worst = max(_one(name).diagnosis.demand_bytes, 1)
    capacity = int(worst * share)
    analysis = analyzer.analyze(path, capacity, 1)
    assert isinstance(analysis, Analysis)
    dx = max(analysis.devices, key=lambda d: d.diagnosis.demand_bytes).diagnosis
    assert not any(r["fits"] and r["id"] not in CONDITIONAL for r in dx.remedies)
    found = dx.plan
    assert found["fits"] and found["steps"][-1]["fits"] and not any(s["fits"] for s in found["steps"][:-1])
    assert found["steps"][-1]["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * capacity
    assert next(r for r in dx.remedies if r["try_first"])["id"] == found["steps"][0]["remedy"]
    assert "Try first, as the plan below: " + found["steps"][0]["title"] in dx.verdict


def test_host_memory_is_named_once_in_its_verdict():
    """tracelens' BERT trace names its host device 'CPU (host memory)': the verdict says that name, not
    'Host memory (CPU (host memory))'; a host device with no recorded name is 'Host memory (host)'."""
    from dataclasses import replace

    path = REAL / "tracelens" / "gaunernst_bert-small-uncased__1016001.json.gz"
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    trace = analyzer.load(path)
    assert isinstance(trace, analyzer.MemoryTrace)

    def host_verdict(t: analyzer.MemoryTrace) -> str:
        result = analyzer.analyze(t)
        assert isinstance(result, Analysis)
        return next(d.diagnosis.verdict for d in result.devices if d.device < 0)

    assert host_verdict(trace).startswith("CPU (host memory): peak 16 B allocated; GPU remedies do not act on it")
    unnamed = replace(trace, devices={**trace.devices, -1: replace(trace.devices[-1], name=None)})
    assert host_verdict(unnamed).startswith("Host memory (host): peak 16 B allocated")
