"""A device nn.DataParallel's scatter made heavy is told to split the batch by size first, and tensor or pipeline
parallelism is offered only where repeated blocks hold memory at the worst moment (issue 32, "Several GPUs"):
each rule on both sides, and on the real recording where it was seen (Constructor-Sun/code_location: a graph
network under torch_geometric's DataParallel, out of memory on cuda:1)."""
from __future__ import annotations

from typing import Any

import pytest

import analyzer
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR
from analyzer.diagnose.imbalance import PeakSummary, find_imbalance, scatter_excess
from analyzer.diagnose.remedies import Demand, blocks_alive, rank_remedies
from support.paths import REAL
from support.snapshots import GiB

PIPELINE_MIN_LAYERS = 2   # remedies.PIPELINE_MIN_LAYERS: two repeated blocks or more to split
BATCH = ("activation", "input", "temporary")
LINEAR = "/envs/gnn/lib/python3.11/site-packages/torch/nn/modules/linear.py:125"


def _device(label: str, activations: int, replicas: bool) -> PeakSummary:
    return PeakSummary(label, activations + GiB, False, by_category={"activation": activations, "parameter": GiB},
                       by_module={"model.py:231 forward": activations}, data_parallel_replicas=replicas)


@pytest.mark.parametrize("replicas", [True, False], ids=["DataParallel replicas", "no replicas"])
def test_only_dataparallels_scatter_gives_a_device_an_excess_to_even_out(replicas):
    """cuda:1 holds 78 GiB of activations, cuda:0 5 and cuda:2 19 (mean 34): under DataParallel an even split takes
    44 GiB off cuda:1 and nothing off the others; without DataParallel's replicas it is no scatter of ours to even."""
    peaks = [_device("cuda:0", 5 * GiB, False), _device("cuda:1", 78 * GiB, replicas), _device("cuda:2", 19 * GiB, replicas)]
    found = find_imbalance(peaks)
    assert found is not None
    excess = scatter_excess(found, peaks)
    assert excess == ({"cuda:1": 78 * GiB - (5 + 78 + 19) * GiB // 3} if replicas else {})
    assert found.evidence.details.cause == ("uneven_scatter" if replicas else None)


def _oomed(scatter: int = 0, layers: int | None = 28, split_blocks: int | None = 0) -> Demand:
    """An activation-heavy OOM on an 80 GiB GPU of 8 (75 GiB of activations, 1 GiB of parameters)."""
    by_category = {"parameter": GiB, "activation": 75 * GiB}
    return Demand(total=76 * GiB, by_category=by_category, capacity=80 * GiB, world_size=8, layers=layers,
                  split_blocks=split_blocks, oomed=True, scatter_excess=scatter)


@pytest.mark.parametrize("scatter", [40 * GiB, 0], ids=["scatter excess", "none"])
def test_an_even_split_leads_only_where_the_scatter_made_the_device_heavy(scatter):
    remedies = rank_remedies(_oomed(scatter))
    first = next(r for r in remedies if r["try_first"])
    if scatter:
        assert first["id"] == "balance_scatter" and first["saved_bytes"] == scatter
        assert first["new_peak_bytes"] == 36 * GiB and first["fits"]
    else:
        assert first["id"] == "micro_batch" and "balance_scatter" not in {r["id"] for r in remedies}


@pytest.mark.parametrize(("split_blocks", "offered"), [(PIPELINE_MIN_LAYERS, True), (PIPELINE_MIN_LAYERS - 1, False),
                                                       (0, False)])
def test_tensor_and_pipeline_parallelism_need_repeated_blocks_holding_memory_at_the_peak(split_blocks, offered):
    """28 blocks seen in the run (a frozen encoder run before the peak) are not enough: the blocks must hold memory
    at the worst moment."""
    ids = {r["id"] for r in rank_remedies(_oomed(split_blocks=split_blocks))}
    assert ("tensor_parallel" in ids) is offered and ("pipeline_parallel" in ids) is offered


@pytest.mark.parametrize(("modules", "blocks"), [
    (["model.layers.0.mlp", "model.layers.1.mlp"], 2),                                    # qualified names
    (["Model_0 › TinyBlock_0 › Linear_1", "Model_0 › TinyBlock_1 › Linear_3"], 2),        # Kineto's instances
    (["Model_0 › TinyBlock_0 › Linear_1", "Model_0 › Linear_3"], 0),                      # one block
    ([f"models.py:231 forward › {LINEAR} forward[{i}]" for i in (0, 2)], 0),                # a GCN's nn.Linear loop
    (["modeling_llama.py:408 forward › modeling_llama.py:330 forward"], None),            # frames, no loop seen
    (["unattributed", "(no module)"], None)])                                             # structure unknown
def test_the_blocks_alive_are_counted_from_either_naming(modules, blocks):
    """Kineto names a module by its class and instance (`TinyBlock_1`): a class with children seen twice is a
    repeated block; torch.nn's Linear called in a loop is not, and shows there is none; a snapshot's frames
    without a loop, or nothing named, say nothing of the structure (a Llama's snapshot names lines, not blocks)."""
    assert blocks_alive([m.replace(" › ", MODULE_PATH_SEPARATOR) for m in modules]) == blocks


def test_a_recording_that_names_no_module_keeps_tensor_parallelism():
    assert "tensor_parallel" in {r["id"] for r in rank_remedies(_oomed(split_blocks=None))}


def _real(relative: str) -> Any:
    path = REAL / relative
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    return analyzer.analyze(path)


def test_a_real_dataparallel_graph_network_is_told_to_split_by_size_first_and_offered_no_tp_or_pp():
    """cuda:1 ran out of memory holding 3.9x cuda:2's peak: its even share of the batch is the mean of the three
    devices' batch memory at their peaks; no device holds repeated blocks at its peak (a GCN's loop over
    nn.Linear, a frozen Qwen3 encoder run before it), so none is offered tensor or pipeline parallelism."""
    analysis = _real("constructor-sun-code_location/memory_snapshot.pickle")
    batch = {d.device: sum(r["bytes"] for r in d.by_category if r["name"] in BATCH) for d in analysis.devices}
    mean = sum(batch.values()) / len(batch)
    heavy = next(d for d in analysis.devices if d.device == 1).diagnosis
    first = next(r for r in heavy.remedies if r["try_first"])
    assert first["id"] == "balance_scatter" and first["saved_bytes"] == int(batch[1] - mean) and first["fits"]
    assert heavy.verdict.split("Try first: ")[1].startswith("Split each batch by size, not by count")
    for d in analysis.devices:
        ids = {r["id"] for r in d.diagnosis.remedies}
        assert not {"tensor_parallel", "pipeline_parallel"} & ids
        assert ("balance_scatter" in ids) is (d.device == 1)
