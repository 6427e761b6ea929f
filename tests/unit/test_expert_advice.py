"""Advice an expert would sign (issue 32), each rule tested on both sides of what decides it, and on the real
recording where it was seen (read from ../shared/real, skipped when that folder is absent).

Thresholds are written here with their documented values; inputs sit one block either side of them.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

import analyzer
from analyzer.core.vocabulary import RECORD_HISTORY, FindingKind
from analyzer.diagnose.imbalance import PeakSummary, find_imbalance
from analyzer.diagnose.remedies import Demand, rank_remedies
from analyzer.ingest.kineto import read_kineto
from analyzer.ingest.snapshot import snapshot_to_trace
from support.paths import REAL
from support.snapshots import BLOCK, GiB, MiB, Recording

RECOVERY_THRESHOLD = 0.05     # fragmentation.RECOVERY_THRESHOLD: 5% of the reserve free is worth a word
END_STATE_MODEL_SHARE = 0.05  # workload.END_STATE_MODEL_SHARE: parameters of 5% of an end state show a model


def _real(relative: str) -> Any:
    path = REAL / relative
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")
    return analyzer.analyze(path)


def _end_state(rec: Recording, **settings: Any) -> Any:
    """The snapshot `rec` would dump with no history recorded: its segments and blocks (with their frames) only."""
    snapshot = rec.snapshot(**settings)
    snapshot["device_traces"] = [[] for _ in snapshot["device_traces"]]
    snapshot["external_annotations"] = []
    return analyzer.analyze(snapshot_to_trace(snapshot, "end state")).devices[0].diagnosis


# ---- a snapshot without history says what its end state can tell --------------------------------------------
def test_a_real_snapshot_without_history_says_what_is_free_and_how_to_record_more():
    d = _real("kkaitlyn111-cs336-a2/memory_snapshot.pickle").devices[0].diagnosis
    assert d.verdict.startswith("51.30 GiB allocated on cuda:0 when the snapshot was taken.")
    assert "19.39 GiB (27%) of the 70.69 GiB reserved is cached but free" in d.verdict
    assert "the largest free block 314.00 MiB" in d.verdict
    assert "that free memory is fragmentation (" in d.verdict
    assert "): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True." in d.verdict
    assert RECORD_HISTORY in d.verdict
    assert d.workload.kind == "unknown", "nothing in an end state without a model shows a forward"


def _one_segment(used: int) -> Recording:
    rec = Recording()
    segment = rec.reserve(100 * MiB)
    rec.alloc(used, segment=segment)
    return rec


@pytest.mark.parametrize(("used", "fragmented"), [(100 * MiB - int(RECOVERY_THRESHOLD * 100 * MiB), True),
                                                  (100 * MiB - int(RECOVERY_THRESHOLD * 100 * MiB) + BLOCK, False)],
                         ids=["5% free", "under 5% free"])
def test_an_end_state_with_a_twentieth_of_its_reserve_free_names_fragmentation(used, fragmented):
    verdict = _end_state(_one_segment(used)).verdict
    assert ("that free memory is fragmentation (" in verdict) is fragmented
    assert ("expandable_segments:True" in verdict) is fragmented
    assert ("the work itself did not fit" in verdict) is not fragmented


def test_an_end_state_with_expandable_segments_on_is_not_told_to_turn_them_on():
    verdict = _end_state(_one_segment(50 * MiB), expandable_segments=True).verdict
    assert "expandable_segments:True" not in verdict and "expandable segments are on" in verdict


MODEL_AT = int(END_STATE_MODEL_SHARE * 100 * MiB)


@pytest.mark.parametrize(("parameters", "kind"), [(MODEL_AT, "forward_only"), (MODEL_AT - BLOCK, "unknown")],
                         ids=["5% parameters", "under 5%"])
def test_an_end_state_is_forward_only_only_when_it_holds_a_model(parameters, kind):
    rec = Recording()
    rec.alloc(parameters, where="model.py:12", name="__init__")
    rec.alloc(100 * MiB - parameters, where="model.py:40", name="forward")
    d = _end_state(rec)
    assert d.workload.kind == kind
    assert d.workload.summary.startswith("forward only" if kind == "forward_only" else "unknown (no allocation")


def test_a_real_end_state_of_loaded_weights_alone_stays_forward_only():
    d = _real("yiyi-llm-inference/oom_snapshot.pickle").devices[0].diagnosis
    assert d.workload.kind == "forward_only" and "parameters are 100% of the peak" in d.verdict


# ---- never offer what is already on: autograd off in the recording -------------------------------------------
GRAD_MODE_MIN_OPS = 100  # kineto.GRAD_MODE_MIN_OPS: this many ops with no sequence number show autograd was off


def _chrome_trace(tmp_path, ops: int, sequenced: int = 0, metadata: dict | None = None):
    """A profiler trace of one GPU: two allocations and `ops` cpu_op spans, the first `sequenced` of them with
    autograd's Sequence number; `metadata` as a harness writes it beside traceEvents."""
    events: list[dict[str, Any]] = []
    for i in range(ops):
        args = {"External id": i} | ({"Sequence number": i} if i < sequenced else {})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0 * i,
                       "dur": 5.0, "args": args})
    for i, (addr, size, total) in enumerate([(0x1000, 4 * MiB, 4 * MiB), (0x900000, 8 * MiB, 12 * MiB)]):
        events.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
                       "ts": 10.0 * i + 1, "s": "t", "args": {"Device Type": 1, "Device Id": 0, "Addr": addr,
                                                              "Bytes": size, "Total Allocated": total,
                                                              "Total Reserved": 20 * MiB}})
    document: dict[str, Any] = {"schemaVersion": 1, "traceEvents": events}
    if metadata is not None:
        document = {"metadata": metadata, **document}
    path = tmp_path / "run.pt.trace.json"
    path.write_text(json.dumps(document))
    return read_kineto(path)


@pytest.mark.parametrize(("ops", "mode"), [(GRAD_MODE_MIN_OPS, "off"), (GRAD_MODE_MIN_OPS - 1, None)],
                         ids=["100 ops", "99 ops"])
def test_ops_without_a_sequence_number_show_autograd_off_only_when_there_are_enough(tmp_path, ops, mode):
    assert _chrome_trace(tmp_path, ops).grad_mode == mode


def test_one_op_with_a_sequence_number_shows_autograd_on(tmp_path):
    assert _chrome_trace(tmp_path, GRAD_MODE_MIN_OPS, sequenced=1).grad_mode == "enabled"


@pytest.mark.parametrize(("recorded", "mode"), [("inference_mode", "inference_mode"), ("no_grad", "no_grad"),
                                                ("something else", "enabled")])
def test_the_grad_mode_a_harness_writes_in_the_metadata_is_read_first(tmp_path, recorded, mode):
    trace = _chrome_trace(tmp_path, 3, sequenced=1, metadata={"profiler": {"grad_mode": recorded}})
    assert trace.grad_mode == mode, "a word the vocabulary does not know falls back on the sequence numbers"


def _forward_keeping_activations(grad_mode: str | None) -> Any:
    """A forward-only run whose activations (three of 64 MiB, made in the forward, alive at the peak) are kept."""
    rec = Recording()
    with rec.step(1), rec.phase("forward"):
        for line in (41, 42, 43):
            rec.alloc(64 * MiB, where=f"model.py:{line}", name="forward")
    trace = dataclasses.replace(rec.trace(), grad_mode=grad_mode)
    return analyzer.analyze(trace).devices[0].diagnosis


@pytest.mark.parametrize(("grad_mode", "offered"), [(None, True), ("enabled", True), ("no_grad", False),
                                                    ("inference_mode", False), ("off", False)])
def test_no_grad_is_offered_only_where_autograd_may_be_on(grad_mode, offered):
    d = _forward_keeping_activations(grad_mode)
    assert ("no_grad" in [r["id"] for r in d.remedies]) is offered
    assert d.workload.graph_kept is offered
    assert ("a cache or outputs, not a graph" in d.workload.summary) is not offered


def test_a_real_trace_recorded_under_inference_mode_is_not_told_to_use_it():
    analysis = _real("tracelens/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz")
    assert analysis.trace.grad_mode == "inference_mode"
    gpu = next(d for d in analysis.devices if d.device >= 0).diagnosis
    assert "no_grad" not in [r["id"] for r in gpu.remedies]
    assert "autograd off (inference_mode)" in gpu.workload.summary


def test_a_real_training_trace_shows_autograd_on():
    assert _real("tracelens-mi300/resnet_act_checkpoint.json.gz").trace.grad_mode == "enabled"


# ---- parallelism and offload only for states or a batch that do not fit one GPU ----------------------------------
SHARD_TO_GROW_SHARE = 0.5   # remedies.SHARD_TO_GROW_SHARE: a fitting run's states must hold half the device
BEYOND_ONE_GPU = {"optimizer_offload", "zero1", "zero2", "zero3", "tensor_parallel", "pipeline_parallel", "offload"}
CAPACITY = 80 * GiB


def _fitting(states: int) -> Demand:
    """A training run that fits an 80 GiB GPU with room (10 GiB of activations), its model states `states`
    bytes: a quarter parameters, a quarter gradients, half Adam's state; eight repeated blocks, on 8 GPUs."""
    by_category = {"parameter": states // 4, "gradient": states // 4, "optimizer_state": states - states // 2,
                   "activation": 10 * GiB}
    return Demand(total=sum(by_category.values()), by_category=by_category, capacity=CAPACITY, world_size=8,
                  layers=8)


@pytest.mark.parametrize(("states", "offered"), [(int(SHARD_TO_GROW_SHARE * CAPACITY), True),
                                                 (int(SHARD_TO_GROW_SHARE * CAPACITY) - BLOCK, False)],
                         ids=["states half the device", "just under half"])
def test_a_run_that_fits_is_offered_parallelism_only_when_its_states_crowd_the_device(states, offered):
    remedies = rank_remedies(_fitting(states))
    assert {r["purpose"] for r in remedies} == {"grow"}
    assert bool(BEYOND_ONE_GPU & {r["id"] for r in remedies}) is offered
    if offered:
        assert {"zero1", "zero2", "zero3", "tensor_parallel", "pipeline_parallel"} <= {r["id"] for r in remedies}


@pytest.mark.parametrize(("states", "offered"), [(int(SHARD_TO_GROW_SHARE * CAPACITY), True),
                                                 (int(SHARD_TO_GROW_SHARE * CAPACITY) - BLOCK, False)],
                         ids=["states half the device", "just under half"])
def test_a_leak_is_not_offered_more_gpus_unless_the_work_needs_them_without_it(states, offered):
    """A leak runs out of memory later whatever the GPUs (fits_as_is is false for it): parallelism and offload
    would only delay it, as a smaller batch would. They are judged as for the run without the leak."""
    leaking = dataclasses.replace(_fitting(states), findings={FindingKind.LEAK}, triage="leak")
    ids = {r["id"] for r in rank_remedies(leaking)}
    assert bool(BEYOND_ONE_GPU & ids) is offered


def test_a_small_model_whose_batch_does_not_fit_is_still_offered_parallelism():
    by_category = {"parameter": GiB // 4, "gradient": GiB // 4, "optimizer_state": GiB // 2, "activation": 78 * GiB}
    demand = Demand(total=sum(by_category.values()), by_category=by_category, capacity=CAPACITY, world_size=8,
                    layers=8, oomed=True)
    assert "tensor_parallel" in {r["id"] for r in rank_remedies(demand)}


def test_a_real_resnet50_that_fits_any_gpu_is_offered_no_sharding_or_offload():
    d = next(x for x in _real("hta/memory_timeline.raw.gz").devices if x.device >= 0).diagnosis
    assert d.fits is not None and d.workload.kind == "training"
    assert 100 * MiB > d.theory.parameter_bytes > 90 * MiB, "ResNet-50's 25.6 M fp32 parameters"
    ids = {r["id"] for r in d.remedies}
    assert ids and not BEYOND_ONE_GPU & ids


# ---- imbalance: the heavy device, and why --------------------------------------------------------------------
PIPELINE_MIN_LAYERS = 2   # remedies.PIPELINE_MIN_LAYERS: pipeline stages need two repeated blocks or more


def _device(label: str, activations: int, replicas: bool = False, layers: int | None = None) -> PeakSummary:
    return PeakSummary(label, activations + GiB, False, by_category={"activation": activations, "parameter": GiB},
                       by_module={"model.py:231 forward": activations}, data_parallel_replicas=replicas, layers=layers)


def test_a_heavy_dataparallel_replica_is_told_of_the_uneven_scatter_not_of_the_master_copy():
    found = find_imbalance([_device("cuda:0", 5 * GiB), _device("cuda:1", 78 * GiB, replicas=True, layers=8),
                            _device("cuda:2", 19 * GiB, replicas=True, layers=8)])
    assert found.remedies[0].startswith("Split each batch by size, not by count: cuda:1 holds 59.00 GiB more "
                                           "activations than cuda:2 in the same code (model.py:231 forward)")
    assert not any("master copy" in r or "pipeline" in r for r in found.remedies)


def test_a_heavy_dataparallel_source_is_told_of_its_master_copy():
    found = find_imbalance([_device("cuda:0", 78 * GiB), _device("cuda:1", 19 * GiB, replicas=True),
                            _device("cuda:2", 19 * GiB, replicas=True)])
    assert "master copy of the model on the GPU it scatters from (cuda:0)" in found.remedies[0]
    assert not any("by size, not by count" in r for r in found.remedies)


@pytest.mark.parametrize(("layers", "pipelined"), [(PIPELINE_MIN_LAYERS, True), (PIPELINE_MIN_LAYERS - 1, False),
                                                   (None, False)])
def test_pipeline_stages_are_advised_only_where_there_are_blocks_to_split(layers, pipelined):
    found = find_imbalance([_device(f"rank {i}", 10 * GiB, layers=layers) for i in range(3)]
                           + [_device("rank 3", 40 * GiB, layers=layers)])
    assert any("pipeline stages" in r for r in found.remedies) is pipelined


def test_a_real_dataparallel_graph_network_is_told_which_device_is_heavy_and_why():
    found = _real("constructor-sun-code_location/memory_snapshot.pickle").imbalance
    assert found.evidence.details.worst == "cuda:1"
    assert found.remedies[0].startswith("Split each batch by size, not by count: cuda:1 holds 59.45 GiB more "
                                           "activations than cuda:2 in the same code (models.py:231 forward)")
    assert not any("master copy" in r or "pipeline" in r for r in found.remedies)


# ---- every offload says how much host memory it needs --------------------------------------------------------
NODE_HOST_MEMORY = 1 << 40   # remedies.NODE_HOST_MEMORY: 1 TiB, what a GPU server node usually has
NODE_GPUS = 8                # remedies.NODE_GPUS


def _offloaded(optimizer_state: int, world_size: int | None, mixed_precision: bool | None) -> dict[str, Any]:
    """An out-of-memory training run on 80 GiB whose optimizer state is `optimizer_state` bytes."""
    by_category = {"parameter": 10 * GiB, "gradient": 10 * GiB, "optimizer_state": optimizer_state,
                   "activation": 40 * GiB}
    demand = Demand(total=sum(by_category.values()), by_category=by_category, capacity=CAPACITY,
                    world_size=world_size, layers=None, oomed=True, mixed_precision=mixed_precision)
    return {r["id"]: r for r in rank_remedies(demand)}


@pytest.mark.parametrize(("state", "verdict"), [(NODE_HOST_MEMORY // NODE_GPUS, "within"),
                                                (NODE_HOST_MEMORY // NODE_GPUS + BLOCK, "beyond")],
                         ids=["a node's worth", "one block more"])
def test_optimizer_offload_says_the_host_memory_of_a_node_of_gpus(state, verdict):
    cost = _offloaded(state, NODE_GPUS, True)["optimizer_offload"]["cost"]
    assert f"needs {state / GiB:.2f} GiB of host memory (12 bytes a parameter" in cost
    assert f"{state * NODE_GPUS / GiB:.2f} GiB for the 8 GPUs of a node, {verdict} the 1.00 TiB" in cost


def test_fp32_adam_offloads_its_two_moments_and_weight_offload_its_parameters_and_activations():
    remedies = _offloaded(20 * GiB, 1, False)
    assert "8 bytes a parameter: Adam's two fp32 moments" in remedies["optimizer_offload"]["cost"]
    assert "for the" not in remedies["optimizer_offload"]["cost"], "one GPU: no node total"
    assert ("needs 30.00 GiB of host memory (the parameters and half the activations), within the 1.00 TiB"
            in remedies["offload"]["cost"])


def test_a_real_inference_offload_says_the_host_memory_of_its_weights():
    d = _real("yiyi-llm-inference/oom_snapshot.pickle").devices[0].diagnosis
    offload = next(r for r in d.remedies if r["id"] == "offload")
    assert offload["cost"].endswith("needs 11.03 GiB of host memory (the weights), within the 1.00 TiB a GPU "
                                    "server node usually has")


# ---- a large transient no tensor holds, in a memory timeline: cuDNN's workspace ---------------------------------
UNKNOWN_SHARE = 0.5   # conv_workspace.UNKNOWN_SHARE: torch's unknown memory from half the peak is named


def _timeline(tmp_path, unknown: int, freed: bool = True, **options: Any) -> Any:
    """A raw memory timeline (export_memory_timeline_raw rows [t_ns, action, bytes, category]): 100 MiB of
    parameters from before, 200 MiB of activations, then `unknown` bytes in torch's unknown category (7),
    freed 2 ms later unless `freed` is False."""
    ms = 1_000_000
    rows = [[-1, 1, 100 * MiB, 0], [10 * ms, 2, 200 * MiB, 4], [20 * ms, 2, unknown, 7]]
    if freed:
        rows.append([22 * ms, 4, -unknown, 7])
    rows.append([30 * ms, 4, -200 * MiB, 4])
    path = tmp_path / "run.raw.json"
    path.write_text(json.dumps(rows))
    return analyzer.analyze(path, **options).devices[0].diagnosis


@pytest.mark.parametrize(("unknown", "named"), [(300 * MiB, True), (300 * MiB - BLOCK, False)],
                         ids=["half the peak", "one block under"])
def test_a_transient_of_half_the_peak_in_torchs_unknown_category_is_named_cudnns_workspace(tmp_path, unknown, named):
    d = _timeline(tmp_path, unknown)
    found = next((f for f in d.findings if f.kind == "conv_workspace"), None)
    assert (found is not None) is named
    assert ("cudnn_benchmark_off" in [r["id"] for r in d.remedies]) is named
    if named:
        assert found.summary.startswith("0.29 GiB of the 0.59 GiB peak (50%) is memory no tensor holds")
        assert "cuDNN's convolution workspace" in found.summary and "lived 2.0 ms" in found.summary
    assert ("50% of it is a transient no tensor holds, most likely cuDNN's convolution workspace" in d.verdict) is named


def test_the_workspace_share_is_a_threshold_of_the_python_api(tmp_path):
    """One block under half the peak is named at a share tuned to 0.4, and half the peak is not at 0.6."""
    assert analyzer.Thresholds().conv_workspace_share == UNKNOWN_SHARE
    under = _timeline(tmp_path, 300 * MiB - BLOCK, thresholds=analyzer.Thresholds(conv_workspace_share=0.4))
    assert [f for f in under.findings if f.kind == "conv_workspace"]
    half = _timeline(tmp_path, 300 * MiB, thresholds=analyzer.Thresholds(conv_workspace_share=0.6))
    assert not [f for f in half.findings if f.kind == "conv_workspace"]


def test_unknown_memory_kept_to_the_end_is_no_workspace(tmp_path):
    assert not [f for f in _timeline(tmp_path, 400 * MiB, freed=False).findings if f.kind == "conv_workspace"]
