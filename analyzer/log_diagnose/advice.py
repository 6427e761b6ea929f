"""What to change first for one OOM read from a log, cheapest first, with the bytes the text gives; and what to
record next so that the next run can be analysed in full."""
from __future__ import annotations

import math

from analyzer.core.log_records import AllocatorSetting, GpuProcess, LogFinding, LogRemedy, OomText, Reading
from analyzer.core.units import human_bytes
from analyzer.log_diagnose.cause import CAPACITY, FRAGMENTATION, OTHER_PROCESS, Cause

#: memory outside PyTorch's cache worth a remedy of its own (a CUDA context and NCCL's defaults are well under it)
OWN_OUTSIDE_WORTH_NAMING = 1 << 30

#: the lines that make the next run's OOM analysable in full (a snapshot with history and stacks)
RECORD_NEXT = """import torch

torch.cuda.memory._record_memory_history(max_entries=100_000)
try:
    train()  # your training loop
except torch.OutOfMemoryError:
    torch.cuda.memory._dump_snapshot("oom_snapshot.pickle")  # then: analyze oom_snapshot.pickle
    raise"""
RECORD_NEXT_CAPTURE = 'import analyzer\n\nwith analyzer.capture("run_dir"):  # dumps a snapshot on OOM\n    train()'


def _remedy(id: str, title: str, detail: str, saves: int | None = None, code: str | None = None) -> LogRemedy:
    return {"id": id, "title": title, "detail": detail, "bytes": saves, "code": code}


def expandable_segments_on(settings: list[AllocatorSetting]) -> AllocatorSetting | None:
    """The last allocator setting the log shows that turns expandable segments on, if any."""
    on = [s for s in settings if "expandable_segments:true" in s.value.lower()]
    return on[-1] if on else None


def remedies(o: OomText, cause: Cause, settings: list[AllocatorSetting], frameworks: list[str],
             gpu_processes: list[GpuProcess]) -> list[LogRemedy]:
    """The remedies the evidence supports, cheapest first (`gpu_processes`: what nvidia-smi listed elsewhere in
    the log, named when the message itself lists no process)."""
    out: list[LogRemedy] = []
    must = cause.must_free_bytes
    if cause.cause == FRAGMENTATION:
        on = expandable_segments_on(settings)
        if on is None:
            out.append(_remedy("expandable_segments", "Turn on expandable segments",
                               f"{human_bytes(o.unallocated_bytes)} sat reserved but unallocated; expandable segments let the "
                               "allocator grow one segment instead of needing a free block the size of the request "
                               "(the log does not show it on)", o.unallocated_bytes,
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py"))
        else:
            out.append(_remedy("max_split_size", "Stop large blocks from being split",
                               f"expandable segments are already on (line {on.line}: {on.value}); keep blocks of the "
                               "request's size whole, and release cached blocks earlier", o.unallocated_bytes,
                               f"PYTORCH_CUDA_ALLOC_CONF={on.value},garbage_collection_threshold:0.8"))
    if cause.cause == OTHER_PROCESS:
        listed = [f"{p['process']} ({human_bytes(p['used_bytes'])}, nvidia-smi)" for p in gpu_processes
                  if p["device"] in (o.device, None)]
        outside = f"memory outside PyTorch's cache ({human_bytes(cause.outside_bytes)}" + \
            (f"; the log's nvidia-smi lists {', '.join(listed)})" if listed else ")")
        holders = ", ".join(f"process {pid} ({human_bytes(b)})" for pid, b in cause.other_processes) or outside
        if "vllm" in frameworks:
            out.append(_remedy("gpu_memory_utilization", "Lower vLLM's gpu_memory_utilization",
                               "vLLM takes that fraction of the whole GPU up front for weights and KV cache; the other "
                               f"work on the GPU needed {human_bytes(must)} more", must, "vllm serve MODEL --gpu-memory-utilization 0.80"))
        if "sglang" in frameworks:
            out.append(_remedy("mem_fraction_static", "Lower SGLang's mem_fraction_static",
                               "SGLang reserves that fraction of the GPU for weights and KV cache; a lower one leaves "
                               f"the {human_bytes(must)} the request needed", must,
                               "python -m sglang.launch_server ... --mem-fraction-static 0.80"))
        out.append(_remedy("other_processes", "Free the GPU of the other work",
                           f"{holders} held the room; stop it, or run on a GPU of its own (CUDA_VISIBLE_DEVICES)", must,
                           "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv"))
        if cause.non_pytorch_bytes and cause.non_pytorch_bytes > OWN_OUTSIDE_WORTH_NAMING and not cause.other_processes:
            out.append(_remedy("non_pytorch_memory", "Look at this process's memory outside PyTorch",
                               f"{human_bytes(cause.non_pytorch_bytes)} of this process is not PyTorch's cache: NCCL buffers "
                               "(NCCL_BUFFSIZE), cuDNN/cuBLAS workspaces, another library's own allocations", cause.non_pytorch_bytes))
        elif cause.non_pytorch_bytes is None and not cause.other_processes and not listed:
            # the form prints no NVML split (torch <= 2.0, or no NVML); other_process means over CONTEXT_ALLOWANCE outside
            out.append(_remedy("non_pytorch_memory", "Or look at this process's own memory outside PyTorch",
                               f"this form of the message does not split the {human_bytes(cause.outside_bytes)} outside "
                               "PyTorch's cache between other processes and this one: if nvidia-smi shows no other "
                               "process, it is this process's own (NCCL buffers, cuDNN/cuBLAS workspaces, another "
                               "library's allocations, such as an embedding cache in managed memory)", cause.outside_bytes,
                               "nvidia-smi --query-compute-apps=pid,used_memory --format=csv   # then: torch.cuda.memory_stats()"))
    if cause.limit == "allowed":
        out.append(_remedy("memory_fraction", "Raise or remove the allowed fraction",
                           f"torch.cuda.set_per_process_memory_fraction capped this process at {human_bytes(o.allowed_bytes)} "
                           f"of {human_bytes(o.capacity_bytes)}", must, "torch.cuda.set_per_process_memory_fraction(0.95)"))
    if cause.cause in (CAPACITY, FRAGMENTATION) and cause.limit is None:
        if o.requested_bytes is not None and o.capacity_bytes is not None and o.requested_bytes > o.capacity_bytes:
            out.append(_remedy("split_operation", "Split the operation that asked for it",
                               f"one allocation of {human_bytes(o.requested_bytes)} cannot fit a {human_bytes(o.capacity_bytes)} device at "
                               "any batch size that keeps this shape: process it in chunks (smaller sequence or "
                               "image, chunked attention, a smaller batch)", o.requested_bytes - o.capacity_bytes))
        else:
            out.append(_remedy("reduce_memory", "Make the step need less memory",
                               f"at least {human_bytes(must)} of this process's GPU memory must go: a smaller micro-batch "
                               "(with gradient accumulation to keep the batch), activation checkpointing, bf16 "
                               "autocast", must, "model.gradient_checkpointing_enable()  # Hugging Face models"))
    return out


def serving_findings(readings: list[Reading]) -> list[LogFinding]:
    """vLLM's refusal to start: the GPU's free memory at start-up is under the fraction it was told to take, so
    other processes hold the difference; the highest gpu_memory_utilization that fits is free / total."""
    out: list[LogFinding] = []
    for r in readings:
        if r.label == "no_kv_cache":
            knob = "--gpu-memory-utilization" if r.source == "vllm" else "--mem-fraction-static"
            out.append({"kind": "serving_kv_cache", "cause": "capacity", "line": r.line, "device": r.device,
                        "summary": f"{r.source} found no room for the KV cache once the weights and the profiling "
                                   "run's activations were in place",
                        "remedy": f"raise {knob} if the GPU is the engine's alone, else a smaller model, "
                                  "quantized weights or more tensor parallelism"})
        if r.label == "kv_cache_too_small":
            need, have = r.counts["max_model_len"], r.counts["kv_cache_tokens"]
            out.append({"kind": "serving_kv_cache", "cause": "capacity", "line": r.line, "device": r.device,
                        "summary": f"vLLM's KV cache holds {have} tokens, fewer than one request of the model's "
                                   f"max seq len ({need})",
                        "remedy": f"--max-model-len {have} or lower, or raise --gpu-memory-utilization"})
        if r.source == "vllm" and r.label == "startup_refused":
            free, total, budget = r.bytes["free"], r.bytes["total"], r.bytes["budget"]
            fits = math.floor(free / total * 100) / 100
            device = f"cuda:{r.device}" if r.device is not None else "the GPU"
            out.append({"kind": "serving_startup", "cause": "other_process", "line": r.line, "device": r.device,
                        "free_bytes": free, "total_bytes": total, "wanted_bytes": budget, "held_elsewhere_bytes": total - free,
                        "summary": f"vLLM refused to start on {device}: {human_bytes(free)} free of {human_bytes(total)}, "
                                   f"it wants {human_bytes(budget)}; other processes hold {human_bytes(total - free)}",
                        "remedy": f"--gpu-memory-utilization {fits:.2f} (at most free / total), or free the GPU"})
    return out


def record_next() -> dict[str, str]:
    """Always: the lines that would let the next run's OOM be analysed in full."""
    return {"snapshot": RECORD_NEXT, "capture": RECORD_NEXT_CAPTURE}
