"""Text logs: each form read from real texts (fixtures/logs, sources in SOURCES.md) with its numbers computed by
hand from the printed values, the cause rule on each side of every threshold, and the command on a log."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from analyzer.core.log_records import Era, OomText, Reading, gpu_name
from analyzer.ingest.log import read_log, read_log_file
from analyzer.ingest.log.lines import clean
from analyzer.log_diagnose import trends
from analyzer.log_diagnose.cause import CONTEXT_ALLOWANCE, FREE_SLACK, judge
from analyzer.log_result import LogAnalysis, analyze_log, analyze_reading
from tests.support.paths import ROOT

LOGS = ROOT / "fixtures" / "logs"
GiB, MiB, KiB = 2**30, 2**20, 2**10


def g(x: float) -> int:
    return round(x * GiB)


def m(x: float) -> int:
    return round(x * MiB)


# fixture -> (era, cause, requested, capacity, free, allocated, reserved, unallocated), bytes from the printed sizes
CASES = {
    "cached_pytorch_16417.log": (Era.CACHED, "unknown", m(12.5), g(10.92), g(9.28), m(8.57), m(8.57) + m(4.68), m(4.68)),
    "cached_pr13751_request_too_large.log": (Era.CACHED, "capacity", g(16), g(11.93), g(7.33), g(4), g(4) + round(179 * KiB), round(179 * KiB)),
    "reserved_summary_pytorch_35901.log": (Era.RESERVED, "fragmentation", g(10.84), g(23.65), g(10.26), g(1.06), g(12.53), g(12.53) - g(1.06)),
    "reserved_malloc_at_fairseq_2442.log": (Era.RESERVED, "unknown", m(246), g(31.75), m(460.38), g(26), g(27.88), g(27.88) - g(26)),
    "reserved_free_enough_pytorch_59778.log": (Era.RESERVED, "unknown", g(2.26), g(6), g(3.03), m(781.59), g(1.24), g(1.24) - m(781.59)),
    "reserved_capacity_zero_dce_52.log": (Era.RESERVED, "capacity", g(1.71), g(6), g(1.04), g(3.49), g(3.5), g(3.5) - g(3.49)),
    "reserved_windows_inconsistent_ipassr_9.log": (Era.RESERVED, "unknown", g(10.73), g(8), 0, g(17.2), g(19.15), g(19.15) - g(17.2)),
    "reserved_wrapped_comment.log": (Era.RESERVED, "fragmentation", m(36), g(7.93), m(47.06), m(130.35), m(188), m(188) - m(130.35)),
    "ofwhich_capacty_mygirlgpt_11.log": (Era.OF_WHICH, "capacity", m(32), g(4), m(41.56), g(2.58), g(2.58) + m(1.9), m(1.9)),
    "ofwhich_fragmentation_lerf_73.log": (Era.OF_WHICH, "fragmentation", g(3), g(23.65), g(1.66), g(12.09), g(12.09) + g(4.84), g(4.84)),
    "ofwhich_capacity_chained_cads_4.log": (Era.OF_WHICH, "capacity", g(22.78), g(31.47), g(12.73), g(9.08), g(9.08) + g(9.35), g(9.35)),
    "ofwhich_process_listed_langchain_3992.log": (Era.OF_WHICH, "capacity", g(128), g(23.65), g(7.95), g(8.13), g(8.13) + m(8.94), m(8.94)),
    "ofwhich_no_nvml_neurolens_2.log": (Era.OF_WHICH, "capacity", g(55.57), g(12), g(9.02), m(984.52), m(984.52) + m(463.48), m(463.48)),
    "ofwhich_other_process_fbgemm_5605.log": (Era.OF_WHICH, "other_process", g(122.07), g(255.98), g(50.64), g(123.74), g(123.74) + m(8.94), m(8.94)),
    "ofwhich_vllm_worker_club3090_32.log": (Era.OF_WHICH, "unknown", g(1.19), g(24), g(14.71), g(7.89), g(7.89) + m(12.54), m(12.54)),
    "hip_forward_pytorch_175431.log": (Era.OF_WHICH, "unknown", m(2), g(287.98), g(203.49), g(68.63), g(68.63) + g(14.93), g(14.93)),
    "xpu_ofwhich_torch_xpu_ops_3011.log": (Era.OF_WHICH, "unknown", g(4.66), g(5.65), g(5.65), round(195.5 * KiB), round(195.5 * KiB) + m(1.81), m(1.81)),
    "cached_optimizer_step_pytorch_29198.log": (Era.CACHED, "other_process", m(352), g(7.92), m(156), g(1.67), g(1.67) + m(124.28), m(124.28)),
    "reserved_optimizer_dreambooth_194.log": (Era.RESERVED, "fragmentation", m(146), g(23.69), m(108.94), g(21.99), g(22.22), g(22.22) - g(21.99)),
    "xpu_paren_ipex_629.log": (Era.RESERVED, "unknown", g(1.71), g(15.56), None, 0, 0, 0),
    "mps_other_allocations_comfyui_7440.log": (Era.MPS, "other_process", m(292.5), g(27.2), g(27.2) - g(9.57) - g(17.35), g(9.57), None, None),
    "mps_capacity_comfyui_7372.log": (Era.MPS, "capacity", m(1024), g(18.13), g(18.13) - g(17.68) - m(3.95), g(17.68), None, None),
    # "A is allocated by PyTorch, with P allocated in private pools": A counts P, so reserved is still A + U
    "ofwhich_private_pools_club3090_138.log": (Era.OF_WHICH, "fragmentation", m(136), g(23.56), m(117.38), g(21.98), g(21.98) + m(391.42), m(391.42)),
    "hip_allowed_private_pools_therock_2118.log": (Era.OF_WHICH, "capacity", m(2), g(255.98), g(244.65), m(1017.01), m(1017.01) + m(54.99), m(54.99)),
    "ofwhich_container_zero_bytes_aria_24.log": (Era.OF_WHICH, "capacity", g(1.88), g(21.96), g(1.29), g(19.02), g(19.02) + g(1.32), g(1.32)),
    "ofwhich_16eib_windows_oneframe_lab.log": (Era.OF_WHICH, "capacity", g(2.13), g(8), g(6.10), m(954), m(954), 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_oom_messages_read_and_judged(name: str) -> None:
    era, cause, requested, capacity, free, allocated, reserved, unallocated = CASES[name]
    a = analyze_log(LOGS / name)
    o = a.ooms[-1]
    assert (o.text.era, o.cause.cause) == (era, cause)
    assert (o.text.requested_bytes, o.text.capacity_bytes, o.text.free_bytes) == (requested, capacity, free)
    assert (o.text.allocated_bytes, o.text.reserved_bytes, o.text.unallocated_bytes) == (allocated, reserved, unallocated)


def test_every_fixture_is_listed_in_sources() -> None:
    sources = (LOGS / "SOURCES.md").read_text()
    assert all(p.name in sources for p in LOGS.glob("*.log"))


def test_2_1_form_reads_this_process_and_other_processes() -> None:
    o = analyze_log(LOGS / "ofwhich_process_listed_langchain_3992.log").ooms[0]
    assert o.text.processes == ((1957120, g(7.10)),) and o.text.this_process_bytes == g(8.58)
    assert o.cause.non_pytorch_bytes == g(8.58) - (g(8.13) + m(8.94))
    assert o.text.repeats == 2  # the logger's line and the exception's: one OOM


def test_several_ooms_in_one_log_are_kept_apart() -> None:
    a = analyze_log(LOGS / "cached_warnings_pytorch_31252.log")
    # four lines, the third repeats the first's numbers but the second differs in between: four OOMs
    assert [o.text.requested_bytes for o in a.ooms] == [g(1.72), g(1.68), g(1.72), g(1.64)]
    assert [o.cause.cause for o in a.ooms] == ["fragmentation"] * 4   # 5.54/3.90/5.54/3.98 GiB cached >= request


def test_malloc_at_suffix_and_summary_table() -> None:
    a = analyze_log(LOGS / "reserved_malloc_at_fairseq_2442.log")
    assert a.ooms[0].text.malloc_at == "CUDACachingAllocator.cpp:501"
    (table,) = a.reading.readings
    assert table.source == "memory_summary" and table.device == 0
    assert table.counts == {"ooms": 1, "alloc_retries": 6}
    assert (table.bytes["allocated"], table.bytes["allocated_peak"]) == (26377 * MiB, 26988 * MiB)


def test_summary_table_reserved_row() -> None:
    (table,) = analyze_log(LOGS / "reserved_summary_pytorch_35901.log").reading.readings
    assert table.bytes["reserved"] == 12420 * MiB and table.bytes["active_peak"] == 4877 * MiB


def test_outside_allocator_ooms_with_phase_and_rank_prefixes() -> None:
    o = analyze_log(LOGS / "cublas_ranks_thunder_1296.log").ooms[0]
    assert (o.text.source, o.cause.cause, o.text.rank, o.phase) == ("cublas", "unknown", 0, "backward")
    assert o.user_frame == "/workspace/lightning-thunder/thunder/benchmarks/benchmark_litgpt.py:748 in train"
    nccl = analyze_log(LOGS / "nccl_calloc_nccl_1235.log").ooms[0]
    assert (nccl.text.source, nccl.text.requested_bytes) == ("nccl", 6291456)
    assert analyze_log(LOGS / "cuda_error_moss_328.log").ooms[0].text.source == "cuda_error"
    (th,) = analyze_log(LOGS / "thcudacheck_pytorch_1829.log").ooms   # torch <= 0.4, under an IPython prompt
    assert (th.text.era, th.text.source, th.text.line, th.cause.cause) == (Era.OUTSIDE, "thcudacheck", 2, "unknown")


def test_phase_and_user_frame_of_a_forward() -> None:
    o = analyze_log(LOGS / "hip_forward_pytorch_175431.log").ooms[0]
    assert (o.text.backend, o.text.device, o.phase) == ("HIP", 7, "forward")
    assert o.user_frame == "/workspace/Quark/quark/torch/quantization/observer/observer.py:712 in forward"


def test_framework_lines() -> None:
    ds = analyze_log(LOGS / "deepspeed_see_memory_usage_522.log").reading.readings
    assert [(r.label, r.bytes["allocated"], r.bytes["reserved_peak"]) for r in ds] == \
        [("before forward 1", g(4.89), g(7)), ("before backward 1", g(5.19), g(7))]
    vllm = analyze_log(LOGS / "vllm_profiling_14447.log")
    assert "vllm" in vllm.reading.frameworks
    assert vllm.reading.readings[0].bytes == {"weights": g(21.21), "non_torch": g(0.2), "activation_peak": g(0.37),
                                              "kv_cache": g(1.57)}
    assert vllm.reading.readings[1].bytes["budget"] == g(23.35)
    sg = analyze_log(LOGS / "sglang_kv_cache_18039.log").reading.readings
    assert [(r.rank, r.bytes["kv_cache"]) for r in sg] == [(1, g(8.38) + g(5.59)), (2, g(8.38) + g(5.59))]
    pool = analyze_log(LOGS / "sglang_memory_pool_18263.log").reading.readings
    assert [r.bytes for r in pool] == [{"available": g(230.2), "weights": g(56.98)},
                                       {"kv_cache": g(76.44) * 2}, {"available": g(74.01)}]


def test_nvidia_smi_screen() -> None:
    a = analyze_log(LOGS / "nvidia_smi_screen_pytorch_5434.log")
    assert a.gpu_peaks == [{"device": 0, "used_bytes": 1 * MiB, "total_bytes": 11439 * MiB, "line": 10, "readings": 1}]


# --- the cause rule, each side of each threshold ------------------------------------------------------------

def _oom(**kw: int | None) -> OomText:
    base = {"line": 1, "rank": None, "era": Era.OF_WHICH, "backend": "CUDA", "device": 0, "requested_bytes": g(2),
            "capacity_bytes": g(80), "free_bytes": g(1), "allocated_bytes": g(70), "unallocated_bytes": g(1),
            "reserved_bytes": g(71), "this_process_bytes": g(71.5)}
    base.update(kw)
    return OomText(**base)  # type: ignore[arg-type]


def test_fragmentation_when_unallocated_reaches_the_request() -> None:
    assert judge(_oom(unallocated_bytes=g(2), reserved_bytes=g(72), this_process_bytes=g(72.5))).cause == "fragmentation"
    assert judge(_oom(unallocated_bytes=g(2) - 1, reserved_bytes=g(72) - 1, this_process_bytes=g(72.5))).cause == "capacity"


def test_free_slack_decides_whether_the_numbers_say_it_fits() -> None:
    assert judge(_oom(free_bytes=g(2) + FREE_SLACK)).cause == "unknown"
    assert judge(_oom(free_bytes=g(2) + FREE_SLACK - 1)).cause == "capacity"


def test_other_process_needs_more_than_a_context_outside_the_cache() -> None:
    must = g(2) + FREE_SLACK - g(1)
    held = CONTEXT_ALLOWANCE + must
    assert judge(_oom(this_process_bytes=g(71), processes=((7, held),))).cause == "other_process"
    assert judge(_oom(this_process_bytes=g(71), processes=((7, held - 1),))).cause == "capacity"
    # this process's own non-PyTorch memory counts too (torch >= 2.1: this process minus reserved)
    assert judge(_oom(this_process_bytes=g(71) + held)).cause == "other_process"
    assert judge(_oom(this_process_bytes=g(71) + held - 1)).cause == "capacity"


def test_request_larger_than_the_device_and_allowed_limit() -> None:
    assert judge(_oom(requested_bytes=g(80) + 1)).reason.startswith("the request alone")
    assert not judge(_oom(requested_bytes=g(80))).reason.startswith("the request alone")  # equal: not larger
    limited = judge(_oom(allowed_bytes=g(73), free_bytes=g(8)))  # reserved 71 + 2 = 73 fits exactly
    assert limited.cause == "unknown"
    assert judge(_oom(allowed_bytes=g(73) - 1, free_bytes=g(8))).limit == "allowed"


def test_inconsistent_numbers_get_no_verdict_built_on_them() -> None:
    """NVML's per-process figures that contradict the rest are said and set aside: the allocator's own numbers
    still judge: 80 GiB, 1 GiB free, 71 GiB reserved leave 8 GiB outside the cache, more than a context and the
    1.06 GiB that must go (other_process; with NVML's consistent 71.5 GiB for this process it is capacity, since
    the 8 GiB is then nobody's the message names). The allocator's own numbers contradicting each other leave no
    verdict at all."""
    wsl = judge(_oom(this_process_bytes=17179869184 * GiB))   # WSL's NVML: 16 EiB "in use"
    assert wsl.cause == "other_process" and wsl.outside_bytes == g(8) and "NVML's 'not available' (17179869184.00 GiB" in wsl.inconsistent[0]
    assert "set aside" in wsl.notes[-1] and wsl.non_pytorch_bytes is None
    container = judge(_oom(this_process_bytes=0))              # a container: "0 bytes" for this process
    assert container.cause == "other_process" and "hides the process" in container.inconsistent[0]
    huge = judge(_oom(this_process_bytes=g(81)))               # above the capacity, not NVML's "not available"
    assert huge.cause == "other_process" and "more than the device's total capacity" in huge.inconsistent[0]
    consistent = judge(_oom(this_process_bytes=g(71)))         # exactly what PyTorch reserves
    assert consistent.cause == "capacity" and consistent.inconsistent == [] and consistent.notes == []
    own = judge(_oom(this_process_bytes=0, reserved_bytes=g(81)))   # the allocator's reserved above the capacity
    assert own.cause == "unknown" and own.inconsistent[0].startswith("reserved by PyTorch") and len(own.inconsistent) == 2


def test_a_process_line_that_is_this_process() -> None:
    cause = judge(_oom(this_process_bytes=None, processes=((42, g(71.5)),)))
    assert cause.cause == "capacity" and cause.other_processes == [] and "taken to be this process" in cause.notes[0]


def test_16_eib_process_lines_are_read_and_refused_a_verdict() -> None:
    # A real message (Windows, torch >= 2.1) where NVML could not read per-process use: every Process line and
    # this process say 17179869184.00 GiB (2**64 bytes, 16 EiB), the form the issue names for WSL
    o = analyze_log(LOGS / "ofwhich_16eib_windows_oneframe_lab.log").ooms[0]
    assert o.text.this_process_bytes == 17179869184 * GiB == 2**64
    assert len(o.text.processes) == 14 and o.text.processes[0] == (9132, 2**64) and o.text.processes[-1] == (1680, 2**64)
    assert o.text.allowed_bytes == g(2.63)
    # NVML's figures are set aside; the allocator's own: reserved 954 MiB + 2.13 GiB > 2.63 GiB allowed
    assert o.cause.cause == "capacity" and o.cause.limit == "allowed" and o.cause.other_processes == []
    assert [c.split(" is NVML")[0] for c in o.cause.inconsistent] == ["this process's use", "the other processes' use"]
    # kept as a JSON string: the message ends at its closing quote, not with the line's '",'
    assert o.text.text.startswith("CUDA out of memory.") and o.text.text.endswith("alloc-conf)")
    assert analyze_log_text('x = "' + o.text.text + '"\n').ooms[0].text.text == o.text.text
    assert analyze_log_text(o.text.text + ' "quoted"\n').ooms[0].text.text.endswith('"quoted"')   # no quote before


def test_container_zero_bytes_for_this_process_is_set_aside() -> None:
    """Aria#24: "this process has 0 bytes memory in use" while PyTorch reserves 20.34 GiB of 21.96 GiB; without
    NVML's figure, 1.29 GiB free for 1.88 GiB, 1.32 GiB unallocated (less than the request), and 0.33 GiB outside
    the cache (21.96 - 1.29 - 20.34): PyTorch's own memory fills the device."""
    o = analyze_log(LOGS / "ofwhich_container_zero_bytes_aria_24.log").ooms[0]
    assert (o.text.device, o.text.this_process_bytes, o.text.processes) == (3, 0, ())
    assert o.cause.cause == "capacity" and "hides the process" in o.cause.inconsistent[0]
    assert o.cause.outside_bytes == g(21.96) - g(1.29) - (g(19.02) + g(1.32))


def test_private_pool_clause_in_real_cuda_and_hip_messages() -> None:
    cuda = analyze_log(LOGS / "ofwhich_private_pools_club3090_138.log").ooms[0]
    assert (cuda.text.private_pool_bytes, cuda.text.this_process_bytes) == (m(21.71), g(22.82))
    assert cuda.cause.non_pytorch_bytes == g(22.82) - g(21.98) - m(391.42)   # this process less what PyTorch reserves
    hip = analyze_log(LOGS / "hip_allowed_private_pools_therock_2118.log").ooms[0]
    assert (hip.text.backend, hip.text.private_pool_bytes, hip.text.allowed_bytes) == ("HIP", m(17), g(1.05))
    # reserved 1072.00 MiB + 2.00 MiB = 1074.00 MiB is under the printed 1.05 GiB (1075.20 MiB) but within the
    # printed sizes' rounding of it, with 244.65 GiB free: the allowed limit refused it
    assert m(1017.01) + m(54.99) + m(2) < g(1.05) < m(1017.01) + m(54.99) + m(2) + hip.text.tolerance_bytes
    assert (hip.cause.cause, hip.cause.limit) == ("capacity", "allowed") and "rounding" in hip.cause.reason


def analyze_log_text(text: str) -> LogAnalysis:
    return analyze_reading(read_log(io.BytesIO(text.encode()), "built"))


def test_allowed_limit_within_the_printed_rounding() -> None:
    tol = m(10)   # reserved 71 GiB + request 2 GiB, the allowed limit just above it
    assert judge(_oom(allowed_bytes=g(73) + tol, free_bytes=g(8), tolerance_bytes=tol)).limit is None   # equal: no
    assert judge(_oom(allowed_bytes=g(73) + tol - 1, free_bytes=g(8), tolerance_bytes=tol)).limit == "allowed"


# --- across lines -----------------------------------------------------------------------------------------

def _series(values: list[int]) -> list[Reading]:
    return [Reading(line=i, source="megatron", rank=0, bytes={"allocated": v}) for i, v in enumerate(values)]


def test_leak_needs_growth_in_every_reading_over_the_minimum() -> None:
    n, least = trends.LEAK_MIN_READINGS, trends.LEAK_MIN_GROWTH

    def rising(total: int, readings: int = n) -> list[int]:  # never down, `total` from the first to the last
        return [g(10) + total * i // (readings - 1) for i in range(readings)]

    assert trends.leaks(_series(rising(least)))[0]["growth_bytes"] == least
    assert trends.leaks(_series(rising(least - 1))) == []                 # one byte short of the growth
    assert trends.leaks(_series(rising(least, n - 1))) == []              # one reading short
    down_once = rising(2 * least)
    down_once[2], down_once[1] = down_once[1], down_once[2]                   # went down once
    assert trends.leaks(_series(down_once)) == []


def test_imbalance_ratio() -> None:
    def ranks(top: int) -> list[Reading]:
        return [Reading(line=r, source="megatron", rank=r, bytes={"allocated_peak": v})
                for r, v in enumerate([g(10), g(10), top])]
    assert trends.imbalance(ranks(g(12)))["rank"] == 2   # 1.2x the median exactly
    assert trends.imbalance(ranks(g(12) - 1)) is None


# --- lines and the command --------------------------------------------------------------------------------

def test_clean_strips_colour_html_and_prefixes() -> None:
    assert clean("\x1b[31m[rank3]: x &gt; y\x1b[0m\n") == ("x > y", 3)
    assert clean("(VllmWorkerProcess pid=521) INFO hello") == ("INFO hello", None)
    assert clean("0: [rank0]:   File") == ("  File", 0)
    assert clean("[2026-01-31 13:50:39 TP2] KV Cache") == ("KV Cache", 2)


def test_long_lines_are_read_in_bounded_pieces() -> None:
    from analyzer.ingest.log.lines import BLOCK, MAX_LINE
    # a 3 MiB line with the message at its very end, a line past a block boundary, and no newline at the end
    text = (b"x" * (3 * BLOCK) + b" CUDA error: out of memory\nnoise\n" + b"y" * (BLOCK - 3)
            + b"\nTHCudaCheck FAIL file=a.cu line=1 error=2 : out of memory")
    reading = read_log(io.BytesIO(text), "m")
    assert reading.lines == 4 and [o.line for o in reading.ooms] == [1, 4]
    assert [o.source for o in reading.ooms] == ["cuda_error", "thcudacheck"] and MAX_LINE < BLOCK


@pytest.mark.parametrize("block", [64, 300, 4096])
def test_what_is_read_back_does_not_depend_on_where_blocks_end(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    # a traceback's frames (read back from the OOM), a GPU's row (read back from its memory row) and
    # list_gpu_processes()' GPU:n (read back from its process lines) straddle block ends at these sizes
    import analyzer.ingest.log.lines as lines
    names = ["hip_forward_pytorch_175431.log", "cublas_ranks_thunder_1296.log", "nvidia_smi_screen_550_rlinf_255.log",
             "list_gpu_processes_pytorch_44616.log", "ofwhich_capacity_chained_cads_4.log"]
    whole = [read_log(io.BytesIO((LOGS / n).read_bytes()), n) for n in names]
    monkeypatch.setattr(lines, "BLOCK", block)
    assert [read_log(io.BytesIO((LOGS / n).read_bytes()), n) for n in names] == whole
    assert whole[0].ooms[0].frames[-1][3] == "amax, _ = torch.max(torch.abs(block_x), dim=-1, keepdim=True)"


def test_hyperscan_finds_the_lines_the_bytes_find_passes_find() -> None:
    """The one-pass search (Hyperscan) and the fallback where it is not installed pick the same lines of every
    fixture, all of them in one text too (anchors twice on a line, at its start and end, a line without a newline),
    each line once however many anchors it holds, and none past the limit they are given."""
    pytest.importorskip("hyperscan")
    from analyzer.ingest.log import ANCHORS
    from analyzer.ingest.log.lines import _ends_one_by_one, line_finder
    texts = [p.read_bytes() + b"\n" for p in sorted(LOGS.glob("*.log"))]
    texts += [b"".join(texts), b"emory\nMiB lloc MiB emory\nnothing\nLoad weight end\n"]
    finder = line_finder(ANCHORS)
    picked = [finder(t, len(t)) for t in texts]
    assert picked == [_ends_one_by_one(t, ANCHORS, len(t)) for t in texts]
    assert picked[-1] == [6, 25, 49] and sum(map(len, picked[:-2])) == len(picked[-2]) > 50
    assert finder(texts[-1], 33) == _ends_one_by_one(texts[-1], ANCHORS, 33) == [6, 25]


def test_a_log_reads_the_same_without_hyperscan(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    names = sorted(p.name for p in LOGS.glob("*.log"))
    fast = [read_log_file(LOGS / n) for n in names]
    real_import = builtins.__import__

    def no_hyperscan(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "hyperscan":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hyperscan)
    assert [read_log_file(LOGS / n) for n in names] == fast


def test_deepspeed_ma_lines_are_found_by_their_loggers_function_name() -> None:
    # the log is searched for "emory" (not "Max_MA"): DeepSpeed's logger prints see_memory_usage on the MA line
    ma = "MA 4.89 GB         Max_MA 4.89 GB         CA 6.68 GB         Max_CA 7 GB\n"
    logged = f"[2022-02-21 23:37:48,850] [INFO] [utils.py:827:see_memory_usage] {ma}"
    (r,) = read_log(io.BytesIO(logged.encode()), "ds").readings
    assert (r.source, r.bytes["allocated"], r.bytes["reserved_peak"]) == ("deepspeed", g(4.89), g(7))
    assert read_log(io.BytesIO(ma.encode()), "bare").readings == []   # a format without it: not looked for


def test_each_traceback_line_is_read_back_once_however_many_ooms(monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 OOMs, each after its own traceback: an OOM reads back only to the one before it (which took the
    # frames before it), so a log of OOMs does not read the same 64 KiB over again for each
    import analyzer.ingest.log.lines as lines
    oom = (b"RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
           b"1 GiB already allocated; 0 bytes free; 2 GiB reserved in total by PyTorch)\n")
    traceback = b'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n    step()\n'
    unit = b"noise\n" * 20 + traceback + oom
    calls = 0
    original = lines.decode

    def counted(raw: bytes) -> tuple[str, int | None]:
        nonlocal calls
        calls += 1
        return original(raw)

    import analyzer.ingest.log as log
    monkeypatch.setattr(lines, "decode", counted)   # the lines searched for
    monkeypatch.setattr(log, "decode", counted)     # the lines read back
    reading = read_log(io.BytesIO(unit * 300), "many")
    assert sum(o.repeats for o in reading.ooms) == 300 and reading.ooms[0].frames[0][:3] == ("train.py", 3, "<module>")
    # each unit once: its OOM line, the line after it (the message may wrap onto it) and its traceback's three
    # lines; other noise never (reading the 64 KiB behind each OOM again decoded 112,424 lines here)
    assert calls == 300 * 5 - 1


def _analyze(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "analyzer", *args], input=stdin, capture_output=True, cwd=ROOT,
                          timeout=120, check=False)


def test_stdin_json_and_exit_2_on_text_without_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = _analyze("-", "--format", "json", stdin=(LOGS / "ofwhich_fragmentation_lerf_73.log").read_bytes())
    doc = json.loads(done.stdout)
    assert done.returncode == 0 and doc["ooms"][0]["cause"] == "fragmentation"
    assert doc["ooms"][0]["unallocated_bytes"] == g(4.84) and doc["source"]["kind"] == "log"
    empty = tmp_path / "notes.txt"
    empty.write_text("nothing to see here\n")
    bad = _analyze(str(empty))
    assert bad.returncode == 2 and b"looked for" in bad.stderr and bad.stderr.count(b"\n") == 1


def test_reports_escape_the_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    hostile = tmp_path / "hostile.log"
    hostile.write_text('  File "<script>alert(1)</script>.py", line 1, in [x](http://evil)\n'
                       "    \x1b]0;owned\x07model(x)\n"
                       "RuntimeError: CUDA error: out of memory\n")
    for fmt, raw in (("html", "<script>alert"), ("md", "](http://evil)")):
        out = tmp_path / f"r.{fmt}"
        assert _analyze(str(hostile), "-o", str(out), "-q").returncode == 0
        text = out.read_text()
        assert "alert" in text and raw not in text.replace("in [x](http://evil)`", "")  # md: only in a code span
    term = _analyze(str(hostile))
    assert term.returncode == 0 and b"\x1b]0;" not in term.stdout and b"\x07" not in term.stdout


def test_old_fragment_without_prefix_is_an_other_process_oom() -> None:
    # 7.92 GiB - 24.56 MiB free - 86.00 MiB reserved = 7.81 GiB outside the cache; 216 MiB + 64 MiB - 24.56 MiB
    # had to go: a zombie process held the GPU (the thread's maintainer killed it)
    o = analyze_log(LOGS / "reserved_other_process_fastmri_238.log").ooms[0]
    assert (o.text.era, o.cause.cause) == (Era.RESERVED, "other_process")
    assert o.cause.outside_bytes == g(7.92) - m(24.56) - m(86)
    assert o.cause.must_free_bytes == m(216) + 64 * MiB - m(24.56)


def test_vllm_startup_refusal() -> None:
    (f,) = analyze_log(LOGS / "vllm_startup_refused_pytorch_175666.log").findings
    assert (f["device"], f["free_bytes"], f["total_bytes"], f["wanted_bytes"]) == (1, g(19.77), g(22.05), g(19.84))
    assert f["held_elsewhere_bytes"] == g(22.05) - g(19.77) and "0.89" in f["remedy"]  # floor(19.77/22.05, 2)


def test_nvidia_smi_process_tables_and_list_gpu_processes() -> None:
    procs = analyze_log(LOGS / "nvidia_smi_processes_nvitop_152.log").gpu_processes
    assert [(p["device"], p["process"].split()[1], p["used_bytes"]) for p in procs] == [
        (0, "10734", 160 * MiB), (0, "58661", 3 * MiB), (1, "10734", 160 * MiB), (2, "18243", 64 * MiB),
        (2, "22720", 34 * MiB)]
    (p,) = analyze_log(LOGS / "list_gpu_processes_pytorch_44616.log").gpu_processes
    assert (p["device"], p["process"], p["used_bytes"]) == (0, "pid 79749", 601 * MiB)
    peaks = analyze_log(LOGS / "nvidia_smi_screen_550_rlinf_255.log").gpu_peaks
    assert [(x["device"], x["used_bytes"], x["total_bytes"]) for x in peaks] == [(0, 507 * MiB, 24564 * MiB),
                                                                               (1, 459 * MiB, 24564 * MiB)]


def test_nvidia_smi_csv_logs_from_real_runs() -> None:
    # index, then memory.total before memory.used: the header's order, not a fixed one, names the columns
    two = analyze_log(LOGS / "nvidia_smi_csv_two_gpus_openad.log").gpu_peaks
    assert two == [{"device": 0, "used_bytes": 25073 * MiB, "total_bytes": 49140 * MiB, "line": 2, "readings": 3},
                   {"device": 1, "used_bytes": 15 * MiB, "total_bytes": 49140 * MiB, "line": 3, "readings": 3}]
    # no index column (and no total): one peak, for a GPU the log does not number; 71158 MiB at 01:18:22
    (one,) = analyze_log(LOGS / "nvidia_smi_csv_over_time_balance_budget.log").gpu_peaks
    assert one == {"device": None, "used_bytes": 71158 * MiB, "total_bytes": None, "line": 13, "readings": 14}
    assert gpu_name(None) == "a GPU the log does not number" and gpu_name(0) == "GPU 0"


def test_nvidia_smi_csv_log_peaks() -> None:
    text = (b"timestamp, index, memory.used [MiB], memory.total [MiB]\n"
            b"2024/01/01 00:00:00.000, 0, 1000 MiB, 81920 MiB\n2024/01/01 00:00:01.000, 0, 79000 MiB, 81920 MiB\n"
            b"2024/01/01 00:00:02.000, 0, 500 MiB, 81920 MiB\n")  # the format of --query-gpu=... --format=csv
    from analyzer.log_result import analyze_reading
    peaks = analyze_reading(read_log(io.BytesIO(text), "csv")).gpu_peaks
    assert peaks == [{"device": 0, "used_bytes": 79000 * MiB, "total_bytes": 81920 * MiB, "line": 3, "readings": 3}]


_NOHEADER_ROWS = b"2024/01/01 00:00:00.000, 1, 1000, 81920\n2024/01/01 00:00:05.000, 1, 79000, 81920\n"


def test_nvidia_smi_noheader_csv_is_read_after_the_command_that_names_its_columns() -> None:
    # --format=csv,noheader,nounits prints the queried fields in the order asked, in MiB, without a header
    command = b"$ nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,nounits -l 5\n"
    from analyzer.log_result import analyze_reading
    peaks = analyze_reading(read_log(io.BytesIO(command + _NOHEADER_ROWS), "csv")).gpu_peaks
    assert peaks == [{"device": 1, "used_bytes": 79000 * MiB, "total_bytes": 81920 * MiB, "line": 3, "readings": 2}]
    # the query in another order: the same numbers are other columns
    swapped = command.replace(b"memory.used,memory.total", b"memory.total,memory.used")
    readings = read_log(io.BytesIO(swapped + _NOHEADER_ROWS), "csv").readings
    assert [r.bytes for r in readings] == [{"total": 1000 * MiB, "used": 81920 * MiB},
                                           {"total": 79000 * MiB, "used": 81920 * MiB}]
    # --query-compute-apps with its alias used_memory, with units
    apps = (b"nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader\n"
            b"4242, python, 30000 MiB\n")
    (proc,) = analyze_reading(read_log(io.BytesIO(apps), "apps")).gpu_processes
    assert (proc["process"], proc["used_bytes"]) == ("pid 4242 python", 30000 * MiB)


def test_nvidia_smi_noheader_csv_without_its_command_is_not_read() -> None:
    # the same rows with no line naming their columns: any three numbers; a query whose columns do not match
    assert read_log(io.BytesIO(_NOHEADER_ROWS), "rows").readings == []
    other = b"nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits\n" + _NOHEADER_ROWS
    assert read_log(io.BytesIO(other), "other").readings == []
    headed = b"nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv\n" + _NOHEADER_ROWS
    assert read_log(io.BytesIO(headed), "headed").readings == []   # with a header expected, no header came


def test_megatron_memory_lines_of_both_eras_from_real_logs() -> None:
    # "MB" is MiB (report_memory divides by 1024 * 1024): 10250.5693359375 * 2**20 = 10748500992 exactly
    (old,) = read_log_file(LOGS / "megatron_legacy_megatron_60.log").readings
    assert (old.source, old.rank, old.step, old.line) == ("megatron", None, 5, 2)
    assert old.bytes == {"allocated": 10748500992, "allocated_peak": 13218414080,   # 12606.06201171875 MiB
                         "reserved": 17482 * MiB, "reserved_peak": 17482 * MiB}
    (new,) = read_log_file(LOGS / "megatron_rank_megatron_5662.log").readings
    assert (new.rank, new.step) == (0, 20)
    assert new.bytes == {"allocated": round(3270.16 * MiB), "allocated_peak": round(5670.39 * MiB),
                         "reserved": 6406 * MiB, "reserved_peak": 6406 * MiB}
    assert round(3270.16 * MiB) == 3429011292   # 3429011292.16 rounded


def test_megatron_bridge_gigabyte_line_from_a_real_log() -> None:
    # Megatron-Bridge's report_memory: bytes / 1.0e9 to five significant digits, so "gigabytes" are 10**9 bytes
    (r,) = read_log_file(LOGS / "megatron_gigabytes_dgxc_benchmarking.log").readings
    assert (r.source, r.rank, r.step) == ("megatron", 0, 1)
    assert r.bytes == {"allocated": 51_072_000_000, "allocated_peak": 194_410_000_000,
                       "reserved": 216_890_000_000, "reserved_peak": 216_890_000_000}
    assert r.bytes["allocated"] != g(51.072)   # read as GiB it would be 7.4% more
    # without the "[Rank r]" the rank comes from the line's prefix, the step still from "(after N iterations)"
    line = (LOGS / "megatron_gigabytes_dgxc_benchmarking.log").read_bytes().replace(b"[Rank 0] ", b"[rank3]: ")
    (r3,) = read_log(io.BytesIO(line), "bridge").readings
    assert (r3.rank, r3.step, r3.bytes["allocated"]) == (3, 1, 51_072_000_000)


def test_megatron_lines_and_a_leak_across_them() -> None:
    # Megatron's report_memory format (megatron/training/utils.py), "MB" being MiB; 300 MiB more each report
    lines = "".join(f"[Rank 0] (after {i * 10} iterations) memory (MB) | allocated: {1000 + 300 * i}.0 | max allocated: "
                    f"{2000 + 300 * i}.0 | reserved: 3000.0 | max reserved: 3000.0\n" for i in range(1, 6))
    from analyzer.log_result import analyze_reading
    a = analyze_reading(read_log(io.BytesIO(lines.encode()), "megatron"))
    assert [r.step for r in a.reading.readings] == [10, 20, 30, 40, 50]
    (leak,) = a.findings
    assert leak["growth_bytes"] == 1200 * MiB and leak["per_reading_bytes"] == 300 * MiB


def test_memory_stats_line_from_a_real_dict() -> None:
    # NVIDIA/MinkowskiEngine#359 posted memory_stats() OrderedDicts cut into 1000-character lines; one whole line
    assert len((LOGS / "memory_stats_wrapped_line_minkowski_359.log").read_text().rstrip("\n")) == 1000
    (r,) = read_log_file(LOGS / "memory_stats_wrapped_line_minkowski_359.log").readings
    assert (r.source, r.line) == ("memory_stats", 1)
    assert r.bytes == {"allocated": 42817536, "allocated_peak": 14244352000} and r.counts == {}   # .all. keys only


def test_memory_stats_dict_with_module_bytes() -> None:
    text = (b"OrderedDict([('active.all.allocated', 10), ('allocated_bytes.all.current', 1048576), "
            b"('allocated_bytes.all.peak', 4194304), ('num_alloc_retries', 2), ('num_ooms', 1), "
            b"('reserved_bytes.all.current', 8388608), ('module_bytes.layers.0', 2048)])\n")
    (r,) = read_log(io.BytesIO(text), "stats").readings
    assert r.bytes == {"allocated": MiB, "allocated_peak": 4 * MiB, "reserved": 8 * MiB, "module_bytes.layers.0": 2048}
    assert r.counts == {"alloc_retries": 2, "ooms": 1}


def test_expandable_segments_already_on_changes_the_remedy() -> None:
    base = (LOGS / "ofwhich_fragmentation_lerf_73.log").read_bytes()
    from analyzer.log_result import analyze_reading
    off = analyze_reading(read_log(io.BytesIO(base), "a")).ooms[0].remedies[0]["id"]
    on = analyze_reading(read_log(io.BytesIO(b"export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n" + base), "b"))
    assert off == "expandable_segments" and on.ooms[0].remedies[0]["id"] == "max_split_size"
    assert on.reading.settings[0].value == "expandable_segments:True"
    # newer torch also reads the variable under its device-neutral name, PYTORCH_ALLOC_CONF
    renamed = analyze_reading(read_log(io.BytesIO(b"export PYTORCH_ALLOC_CONF=expandable_segments:True\n" + base), "c"))
    assert renamed.ooms[0].remedies[0]["id"] == "max_split_size"


def test_allowed_clause_inside_the_torch_1_4_to_2_0_parenthesis() -> None:
    # built from the 1.x format string: "... F free; " + "L allowed; " + "R reserved in total by PyTorch)"
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 11.77 GiB total capacity; "
            "4.70 GiB already allocated; 6.90 GiB free; 4.77 GiB allowed; 4.74 GiB reserved in total by PyTorch)\n")
    (o,) = analyze_log_text(text).ooms
    assert (o.text.era, o.text.allowed_bytes, o.text.reserved_bytes) == (Era.RESERVED, g(4.77), g(4.74))
    assert (o.cause.cause, o.cause.limit) == ("capacity", "allowed")   # 4.74 + 2.00 GiB > 4.77 GiB


def test_other_process_remedy_names_what_nvidia_smi_listed() -> None:
    smi = (LOGS / "nvidia_smi_processes_nvitop_152.log").read_bytes()
    oom = (LOGS / "reserved_other_process_fastmri_238.log").read_bytes()
    from analyzer.log_result import analyze_reading
    a = analyze_reading(read_log(io.BytesIO(smi + oom), "both"))
    (other,) = [r for r in a.ooms[0].remedies if r["id"] == "other_processes"]
    assert "pid 10734" in other["detail"] and "pid 22720" not in other["detail"]  # GPU 0's processes only
    assert "non_pytorch_memory" not in [r["id"] for r in a.ooms[0].remedies], "nvidia-smi named who holds it"


def test_memory_outside_the_cache_that_the_message_cannot_split_may_be_this_processs_own() -> None:
    """FBGEMM#5605 (torch >= 2.1 without NVML lines): 81.59 GiB outside PyTorch's cache and no process listed, in
    a run whose own library allocates outside the allocator; the message cannot tell whose, so both are offered.
    With NVML's split (ComfyUI#7440: 17.35 GiB of this process outside PyTorch) the remedy names this process."""
    fbgemm = analyze_log(LOGS / "ofwhich_other_process_fbgemm_5605.log").ooms[0]
    ids = [r["id"] for r in fbgemm.remedies]
    assert fbgemm.cause.cause == "other_process" and ids == ["other_processes", "non_pytorch_memory"]
    assert fbgemm.remedies[1]["bytes"] == fbgemm.cause.outside_bytes
    assert "does not split" in fbgemm.remedies[1]["detail"]
    mps = analyze_log(LOGS / "mps_other_allocations_comfyui_7440.log").ooms[0]
    (own,) = [r for r in mps.remedies if r["id"] == "non_pytorch_memory"]
    assert own["bytes"] == mps.cause.non_pytorch_bytes and "does not split" not in own["detail"]


def test_summary_pool_rows() -> None:
    (table,) = analyze_log(LOGS / "reserved_malloc_at_fairseq_2442.log").reading.readings
    assert (table.bytes["allocated_large"], table.bytes["allocated_small"]) == (25981 * MiB, 395 * MiB)
    assert table.bytes["allocated_large_peak"] == 26595 * MiB


def test_serving_kv_cache_refusals_and_torch_calls() -> None:
    # the messages' wording from vLLM's gpu_worker.py / kv_cache_utils.py and SGLang's model_runner.py
    text = (b"ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            b"initializing the engine.\n"
            b"ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be "
            b"stored in KV cache (12288). Try increasing `gpu_memory_utilization` or decreasing `max_model_len`\n"
            b"RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n"
            b"epoch 3: max_memory_reserved = 12.50 GiB, max_memory_allocated: 10.00 GiB\n")
    from analyzer.log_result import analyze_reading
    a = analyze_reading(read_log(io.BytesIO(text), "serve"))
    assert [f["kind"] for f in a.findings] == ["serving_kv_cache"] * 3
    assert "--max-model-len 12288" in a.findings[1]["remedy"] and "--mem-fraction-static" in a.findings[2]["remedy"]
    assert a.reading.readings[-1].bytes == {"reserved_peak": round(12.5 * GiB), "allocated_peak": 10 * GiB}


def test_phase_of_an_optimizer_step() -> None:
    o = analyze_log(LOGS / "cached_optimizer_step_pytorch_29198.log").ooms[0]
    assert (o.phase, o.user_frame) == ("optimizer", "train.py:29 in train")
    # 7.92 GiB - 156 MiB free - (1.67 GiB + 124.28 MiB) held outside the cache
    assert o.cause.outside_bytes == g(7.92) - m(156) - (g(1.67) + m(124.28))
    lightning = analyze_log(LOGS / "reserved_optimizer_dreambooth_194.log").ooms[0]
    assert (lightning.phase, lightning.user_frame) == ("optimizer", None)  # every frame is in site-packages


def test_stdin_html_without_output_prints_the_summary_and_writes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run([sys.executable, "-m", "analyzer", "-"], input=(LOGS / "mps_capacity_comfyui_7372.log").read_bytes(),
                          capture_output=True, cwd=tmp_path, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and b"capacity" in done.stdout and list(tmp_path.iterdir()) == []
    pdf = _analyze(str(LOGS / "mps_capacity_comfyui_7372.log"), "--format", "pdf")
    assert pdf.returncode == 2 and b"a log's report is html, json, md" in pdf.stderr


def test_the_terminal_summary_at_80_columns_has_no_trailing_space_and_whole_code_lines(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every log fixture: no line ends in spaces, a remedy's wrapped text stays under its title (not at the
    margin), and its code is printed whole on one line, however long, so that it can be copied."""
    from analyzer.commands import main

    monkeypatch.setenv("COLUMNS", "80")
    for log in sorted(LOGS.glob("*.log")):
        assert main([str(log), "-o", str(tmp_path / "r.html")]) in (0, 1)
        lines = capsys.readouterr().out.splitlines()
        assert not [line for line in lines if line != line.rstrip()], log.name
        numbered = [i for i, line in enumerate(lines) if line.startswith("  1. ")]
        for i in numbered:   # its continuation lines, up to its code or the next item, are indented under it
            for line in lines[i + 1:]:
                if not line.startswith("     ") or line.lstrip().startswith(("PYTORCH_", "model.", "nvidia-smi", "torch.")):
                    break
                assert line.startswith("     ") and not line.startswith("      "), (log.name, line)
    main([str(LOGS / "ofwhich_fragmentation_lerf_73.log"), "-o", str(tmp_path / "r.html")])
    assert "       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py" in capsys.readouterr().out.splitlines()


def test_gzip_and_crlf_logs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gzip
    packed = tmp_path / "train.log.gz"
    packed.write_bytes(gzip.compress((LOGS / "ofwhich_fragmentation_lerf_73.log").read_bytes()))
    assert analyze_log(packed).ooms[0].cause.cause == "fragmentation"
    crlf = tmp_path / "windows.log"
    crlf.write_bytes((LOGS / "cublas_ranks_thunder_1296.log").read_bytes().replace(b"\n", b"\r\n"))
    o = analyze_log(crlf).ooms[0]
    assert (o.phase, o.text.rank) == ("backward", 0) and o.user_frame.endswith("benchmark_litgpt.py:748 in train")


@pytest.mark.parametrize("fmt", ["json", "html", "md"])
def test_a_log_is_analysed_without_pandas_or_numpy(tmp_path, fmt: str) -> None:
    """`analyze LOG` imports neither, nor the recording's pipeline (they took 0.5 s, half of a 200 MiB log's whole
    run): only a recording's tables need them."""
    probe = ("import sys; from analyzer.commands import main; "
             f"code = main([sys.argv[1], '--format', '{fmt}', '-o', sys.argv[2], '-q']); "
             "print(code, sorted(m for m in ('pandas', 'numpy', 'matplotlib', 'analyzer.diagnose', 'analyzer.result') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(LOGS / "reserved_summary_pytorch_35901.log"),
                           str(tmp_path / f"out.{fmt}")], capture_output=True, cwd=ROOT, timeout=120)
    assert done.stdout.decode().split() == ["0", "[]"], done.stderr.decode()[-2000:]
    assert (tmp_path / f"out.{fmt}").stat().st_size > 1000


def test_a_log_without_an_oom_says_how_high_its_memory_lines_went() -> None:
    """Megatron-LM#5662's `[Rank 0] (after 20 iterations) memory (MB) | allocated: 3270.16 | max allocated:
    5670.39 | reserved: 6406.00 | max reserved: 6406.00` (MiB, as Megatron divides by 1024 * 1024): the peaks
    stand for the current values, and the verdict names them."""
    a = analyze_log(LOGS / "megatron_rank_megatron_5662.log")
    assert a.memory_highs == [{"source": "megatron", "rank": 0, "device": None, "readings": 1, "first_line": 2,
                               "last_line": 2, "counts": {},
                               "bytes": {"allocated_peak": round(5670.39 * MiB), "reserved_peak": 6406 * MiB},
                               "summary": "megatron rank 0 (1 reading): allocated at peak 5.54 GiB, reserved at peak 6.26 GiB"}]
    assert a.verdict == ("No out-of-memory error in this log; 1 memory reading, nothing out of line: megatron rank 0 "
                         "(1 reading): allocated at peak 5.54 GiB, reserved at peak 6.26 GiB.")
    assert a.to_json()["memory_highs"] == a.memory_highs


def test_memory_highs_take_each_series_highest_and_the_lowest_room_left() -> None:
    """SGLang-#18263's three lines: 56.98 GiB of weights, a 152.88 GiB KV cache, and the room left falling from
    230.20 GiB (after the weights) to 74.01 GiB (after the pool): the lowest is the one that matters. Two ranks'
    lines stay two series; memory_summary()'s allocation retries are named."""
    pool = analyze_log(LOGS / "sglang_memory_pool_18263.log").memory_highs
    assert len(pool) == 1 and pool[0]["readings"] == 3
    assert pool[0]["bytes"]["available"] == 79467632394 < 247175367885     # the lower of the two
    assert pool[0]["bytes"]["weights"] == 61181809132 and pool[0]["bytes"]["kv_cache"] == 164153650054
    ranks = analyze_log(LOGS / "sglang_kv_cache_18039.log")
    assert [(h["rank"], h["bytes"]) for h in ranks.memory_highs] == [(1, {"kv_cache": 15000173281}),
                                                                    (2, {"kv_cache": 15000173281})]
    assert "2 series of memory lines" in ranks.verdict
    readings = [Reading(line=i, source="deepspeed", bytes={"allocated": b}) for i, b in enumerate((3 * GiB, 5 * GiB, 4 * GiB), 1)]
    assert trends.memory_highs(readings)[0]["bytes"] == {"allocated": 5 * GiB}
    summary = analyze_log(LOGS / "reserved_summary_pytorch_35901.log").memory_highs[0]
    assert summary["counts"]["alloc_retries"] == 1 and "1 allocation retry" in summary["summary"]
    smi = analyze_log(LOGS / "nvidia_smi_screen_550_rlinf_255.log")
    assert smi.memory_highs == [] and smi.gpu_peaks, "nvidia-smi's readings have their own summary"
