"""Build the Nsight Systems fixtures: one fake training run seen by both recorders.

    python scripts/make_nsys_fixtures.py        # writes fixtures/traces/nsys/oom_with_nccl.{sqlite,pickle}

The run (one process, pid 4242, on one 80 GiB GPU) reserves PyTorch segments, while NCCL cudaMallocs a 1.5 GiB
buffer outside the caching allocator and an extension holds 256 MiB for 50 ms; it ends in an OOM. The same
events become
- `oom_with_nccl.sqlite`: an `nsys export --type sqlite` database in the Nsight Systems 2025.1 schema (export
  schema 3.17): the documented columns of every table written, ENUM tables, nanoseconds since the session
  start, serialized globalTid/globalPid (VM id * 2**48 + PID * 2**24 + TID), StringIds for names and
  registered NVTX strings, NVTX from torch.cuda.nvtx, the `nvtx` package (custom domains, registered strings,
  start/end ranges, a mark), emit_nvtx and pyprof/DLProf markers;
- `oom_with_nccl.pickle`: the snapshot PyTorch would dump at the OOM, in the torch 2.13 `_snapshot()` layout
  (segments with blocks, device_traces with time_us in epoch microseconds), pickle protocol 4.

Planted truths the tests check: outside PyTorch at the OOM = 1.5 GiB (NCCL), at most 1.75 GiB (NCCL plus the
extension's 256 MiB), and 512 MiB of CUDA context that neither recording sees. Nsight timestamps each
cudaMalloc 30 µs before PyTorch records the segment, as the real pair would.
"""
from __future__ import annotations

import pickle
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "nsys"
NAME = "oom_with_nccl"

GiB, MiB = 1 << 30, 1 << 20
SESSION_START_NS = 1_767_225_600_000_000_000      # 2026-01-01T00:00:00Z, TARGET_INFO_SESSION_START_TIME
PID, MAIN_TID, LOADER_TID, NCCL_TID = 4242, 4242, 4243, 4250
VM = 1 << 48                                      # the VM/hardware part of every serialized id, as in real exports
CAPACITY = 80 * GiB
CONTEXT_BYTES = 512 * MiB                         # the CUDA context: in neither recording
NSYS_LEAD_NS = 30_000                             # cudaMalloc begins before PyTorch records the segment
OOM_MS, OOM_REQUEST = 4000.0, 40 * GiB
FRAMES = [{"filename": "/home/user/train.py", "line": 41, "name": "train_step"},
          {"filename": "/home/user/train.py", "line": 88, "name": "<module>"}]


@dataclass
class Allocation:
    """One cudaMalloc (a PyTorch segment, or memory PyTorch never sees) and the tensors carved from it."""

    owner: str                  # pytorch | nccl | extension | pinned (host memory: Nsight records it, not device)
    addr: int
    size: int
    alloc_ms: float
    free_ms: float | None = None
    thread: int = MAIN_TID
    tensors: list[tuple[int, float, float | None]] = field(default_factory=list)  # (requested bytes, alloc, free)


RUN = [
    Allocation("nccl", 0x7F00_0000_0000, 1536 * MiB, 1200.0, thread=NCCL_TID),
    Allocation("pinned", 0x7E00_0000_0000, 64 * MiB, 1250.0),
    Allocation("pytorch", 0x7F10_0000_0000, 2 * MiB, 1300.0, tensors=[(4096, 1300.001, None)]),
    Allocation("pytorch", 0x7F20_0000_0000, 8 * GiB, 1310.0, tensors=[(8 * GiB, 1310.001, None)]),
    Allocation("pytorch", 0x7F30_0000_0000, 20 * MiB, 1400.0, free_ms=3999.9, tensors=[(4 * MiB, 1400.001, 1500.0)]),
    Allocation("pytorch", 0x7F40_0000_0000, 12 * GiB, 2000.0, tensors=[(12 * GiB, 2000.001, None)]),
    Allocation("extension", 0x7F50_0000_0000, 256 * MiB, 2100.0, free_ms=2150.0),
    Allocation("pytorch", 0x7F60_0000_0000, 24 * GiB, 3000.0, tensors=[(24 * GiB, 3000.001, None)]),
]


def snapshot_us(ms: float) -> int:
    return SESSION_START_NS // 1000 + round(ms * 1000)


def nsys_ns(ms: float) -> int:
    return round(ms * 1_000_000)


def alive(a: Allocation, ms: float) -> bool:
    return a.alloc_ms <= ms and (a.free_ms is None or a.free_ms > ms)


def device_usage_at(ms: float) -> int:
    return sum(a.size for a in RUN if a.owner != "pinned" and alive(a, ms))


# ---- the snapshot ----------------------------------------------------------------------------------
def _entry(action: str, addr: int, size: int, ms: float) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": snapshot_us(ms), "frames": FRAMES,
            "compile_context": "N/A", "user_metadata": ""}


def _trace() -> list[dict]:
    entries = []
    for a in (a for a in RUN if a.owner == "pytorch"):
        entries.append(_entry("segment_alloc", a.addr, a.size, a.alloc_ms))
        for size, start, end in a.tensors:
            entries.append(_entry("alloc", a.addr, size, start))
            if end is not None:
                entries += [_entry("free_requested", a.addr, size, end), _entry("free_completed", a.addr, size, end + 0.001)]
        if a.free_ms is not None:
            entries.append(_entry("segment_free", a.addr, a.size, a.free_ms))
    oom = {k: v for k, v in _entry("oom", 0, OOM_REQUEST, OOM_MS).items() if k != "addr"}
    oom["device_free"] = CAPACITY - CONTEXT_BYTES - device_usage_at(OOM_MS)
    return sorted(entries, key=lambda e: e["time_us"]) + [oom]


def _segment(a: Allocation) -> dict:
    live = [size for size, _, end in a.tensors if end is None]
    blocks = [{"address": a.addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": FRAMES}
              for size in live]
    used = sum(live)
    if used < a.size:
        blocks.append({"address": a.addr + used, "size": a.size - used, "requested_size": 0, "state": "inactive",
                       "frames": []})
    return {"device": 0, "address": a.addr, "total_size": a.size, "allocated_size": used, "active_size": used,
            "requested_size": used, "stream": 0, "segment_type": "small" if a.size <= 2 * MiB else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": FRAMES, "blocks": blocks}


def snapshot() -> dict:
    """What torch.cuda.memory._snapshot() returns at the OOM (the cached 20 MiB segment was already released)."""
    phases = [("forward", 1900.0, 2900.0), ("backward", 2950.0, OOM_MS)]
    return {
        "segments": [_segment(a) for a in RUN if a.owner == "pytorch" and alive(a, OOM_MS)],
        "device_traces": [_trace()],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                               "expandable_segments": False, "pinned_num_register_threads": 1,
                               "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
                               "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}},
        "external_annotations": [{"stage": stage, "name": name, "device": 0, "time_us": snapshot_us(ms)}
                                 for name, start, end in phases for stage, ms in (("START", start), ("END", end))],
    }


# ---- the Nsight export -----------------------------------------------------------------------------
# Columns per table, as nsys 2025.1 exports them: "!" is NOT NULL, ":TEXT"/":REAL" the type (INTEGER otherwise).
SCHEMA = {
    "StringIds": "id!:PK value!:TEXT",
    "ThreadNames": "nameId! priority globalTid",
    "PROCESSES": "globalPid pid name:TEXT",
    "META_DATA_EXPORT": "name!:TEXT value:TEXT",
    "TARGET_INFO_SESSION_START_TIME": "utcEpochNs utcTime:TEXT localTime:TEXT",
    "TARGET_INFO_GPU": "vmId! id! name:TEXT busLocation:TEXT isDiscrete l2CacheSize totalMemory memoryBandwidth clockRate "
                       "smCount pwGpuId uuid:TEXT luid chipName:TEXT cuDevice ctxswDevPath:TEXT ctrlDevPath:TEXT revision "
                       "nodeMask constantMemory maxIPC maxRegistersPerBlock maxShmemPerBlock maxShmemPerBlockOptin "
                       "maxShmemPerSm maxRegistersPerSm threadsPerWarp asyncEngines maxWarpsPerSm maxBlocksPerSm "
                       "maxThreadsPerBlock maxBlockDimX maxBlockDimY maxBlockDimZ maxGridDimX maxGridDimY maxGridDimZ "
                       "computeMajor computeMinor smMajor smMinor",
    "ENUM_NSYS_EVENT_TYPE": "id!:PK name:TEXT label:TEXT",
    "ENUM_NSYS_EVENT_CLASS": "id!:PK name:TEXT label:TEXT",
    "ENUM_CUDA_MEM_KIND": "id!:PK name:TEXT label:TEXT",
    "ENUM_CUDA_DEV_MEM_EVENT_OPER": "id!:PK name:TEXT label:TEXT",
    "ENUM_CUDA_MEMCPY_OPER": "id!:PK name:TEXT label:TEXT",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start! end! eventClass! globalTid correlationId nameId! returnValue! callchainId",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start! end! deviceId! contextId! greenContextId streamId! correlationId globalPid "
                                  "demangledName! shortName! mangledName launchType cacheConfig registersPerThread! "
                                  "gridX! gridY! gridZ! blockX! blockY! blockZ! staticSharedMemory! dynamicSharedMemory! "
                                  "localMemoryPerThread! localMemoryTotal! gridId! sharedMemoryExecuted graphNodeId "
                                  "sharedMemoryLimitConfig",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start! end! deviceId! contextId! greenContextId streamId! correlationId globalPid bytes! "
                                  "copyKind! deprecatedSrcId srcKind dstKind srcDeviceId srcContextId dstDeviceId "
                                  "dstContextId migrationCause graphNodeId virtualAddress",
    "CUPTI_ACTIVITY_KIND_MEMSET": "start! end! deviceId! contextId! greenContextId streamId! correlationId globalPid value! "
                                  "bytes! graphNodeId memKind",
    "CUDA_GPU_MEMORY_USAGE_EVENTS": "start! globalPid! deviceId! contextId! address! pc! bytes! memKind! "
                                    "memoryOperationType! name:TEXT correlationId localMemoryPoolAddress "
                                    "localMemoryPoolReleaseThreshold localMemoryPoolSize localMemoryPoolUtilizedSize "
                                    "importedMemoryPoolAddress importedMemoryPoolProcessId",
    "NVTX_EVENTS": "start! end eventType! rangeId category color text:TEXT globalTid endGlobalTid textId domainId "
                   "uint64Value int64Value doubleValue:REAL uint32Value int32Value floatValue:REAL jsonTextId "
                   "jsonText:TEXT binaryData:TEXT",
}

# Enum rows as nsys 2025.1 writes them (the subset this run uses, plus their neighbours).
ENUMS = {
    "ENUM_NSYS_EVENT_TYPE": [(33, "NvtxCategory"), (34, "NvtxMark"), (59, "NvtxPushPopRange"),
                             (60, "NvtxStartEndRange"), (75, "NvtxDomainCreate"), (76, "NvtxDomainDestroy")],
    "ENUM_NSYS_EVENT_CLASS": [(0, "TRACE_PROCESS_EVENT_CUDA_RUNTIME", "CUDA runtime"),
                              (1, "TRACE_PROCESS_EVENT_CUDA_DRIVER", "CUDA driver")],
    "ENUM_CUDA_MEM_KIND": [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"), (1, "CUDA_MEMOPR_MEMORY_KIND_PINNED", "Pinned"),
                           (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device"), (3, "CUDA_MEMOPR_MEMORY_KIND_ARRAY", "Array"),
                           (4, "CUDA_MEMOPR_MEMORY_KIND_MANAGED", "Managed"),
                           (5, "CUDA_MEMOPR_MEMORY_KIND_DEVICE_STATIC", "Device Static"),
                           (6, "CUDA_MEMOPR_MEMORY_KIND_MANAGED_STATIC", "Managed Static"),
                           (7, "CUDA_MEMOPR_MEMORY_KIND_UNKNOWN", "Unknown")],
    "ENUM_CUDA_DEV_MEM_EVENT_OPER": [(0, "CUDA_DEV_MEM_EVENT_OPR_ALLOCATION", "Allocation"),
                                     (1, "CUDA_DEV_MEM_EVENT_OPR_DEALLOCATION", "Deallocation")],
    "ENUM_CUDA_MEMCPY_OPER": [(0, "CUDA_MEMCPY_KIND_UNKNOWN", "Unknown"), (1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"),
                              (2, "CUDA_MEMCPY_KIND_DTOH", "Device-to-Host"), (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device")],
}


def _ddl(table: str, spec: str) -> str:
    columns = []
    for item in spec.split():
        name, _, kind = item.partition(":")
        required = name.endswith("!")
        name = name.rstrip("!")
        kind = {"": "INTEGER", "TEXT": "TEXT", "REAL": "REAL", "PK": "INTEGER"}[kind]
        key = "   PRIMARY KEY" if item.endswith(":PK") else ""
        columns.append(f"    {name:<28}{kind:<10}{'NOT NULL' if required else ''}{key}")
    return f"CREATE TABLE {table} (\n" + ",\n".join(columns) + "\n)"


class _Db:
    """Rows go in by column name; what a row leaves out is NULL, as in a real export."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.db = sqlite3.connect(path)
        self.db.execute("PRAGMA page_size = 1024")
        for table, spec in SCHEMA.items():
            self.db.execute(_ddl(table, spec))
        self.strings: dict[str, int] = {}
        self.correlation = 0

    def insert(self, table: str, **row: object) -> None:
        self.db.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))

    def string(self, value: str) -> int:
        if value not in self.strings:
            self.strings[value] = len(self.strings) + 1
            self.insert("StringIds", id=self.strings[value], value=value)
        return self.strings[value]

    def api_call(self, name: str, ms: float, thread: int, failed: bool = False) -> int:
        self.correlation += 1
        self.insert("CUPTI_ACTIVITY_KIND_RUNTIME", start=nsys_ns(ms) - NSYS_LEAD_NS, end=nsys_ns(ms) - 1000,
                    eventClass=0, globalTid=gtid(thread), correlationId=self.correlation, nameId=self.string(name),
                    returnValue=2 if failed else 0)
        return self.correlation

    def close(self) -> None:
        self.db.commit()
        self.db.execute("VACUUM")
        self.db.close()


def gtid(tid: int, pid: int = PID) -> int:
    return VM + pid * (1 << 24) + tid


def gpid(pid: int = PID) -> int:
    return VM + pid * (1 << 24)


def _metadata(db: _Db) -> None:
    for name, value in (("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"), ("EXPORT_PRODUCT_VERSION", "2025.1.1.110"),
                        ("EXPORT_SCHEMA_VERSION", "3.17.1"), ("EXPORT_PARAM_TIME_NORMALIZE", "false"),
                        ("EXPORT_PARAM_TIME_SHIFT", "0")):
        db.insert("META_DATA_EXPORT", name=name, value=value)
    db.insert("TARGET_INFO_SESSION_START_TIME", utcEpochNs=SESSION_START_NS, utcTime="2026-01-01T00:00:00",
              localTime="2026-01-01T00:00:00")
    db.insert("TARGET_INFO_GPU", vmId=VM, id=0, name="NVIDIA H100 80GB HBM3", busLocation="0000:18:00.0", isDiscrete=1,
              totalMemory=CAPACITY, smCount=132, chipName="GH100", cuDevice=0, computeMajor=9, computeMinor=0)
    db.insert("PROCESSES", globalPid=gpid(), pid=PID, name="python3")
    for tid, name in ((MAIN_TID, "python3"), (LOADER_TID, "pt_data_worker"), (NCCL_TID, "NCCL main")):
        db.insert("ThreadNames", nameId=db.string(name), priority=20, globalTid=gtid(tid))
    for table, rows in ENUMS.items():
        for row in rows:
            db.insert(table, id=row[0], name=row[1], label=row[-1])


def _memory(db: _Db) -> None:
    """One memory event per cudaMalloc/cudaFree, tied to its API call by correlationId; two failed retries at the OOM."""
    for a in RUN:
        kind, (alloc_api, free_api) = (1, ("cudaHostAlloc_v3020", "cudaFreeHost_v3020")) if a.owner == "pinned" \
            else (2, ("cudaMalloc_v3020", "cudaFree_v3020"))
        moments = [(a.alloc_ms, 0, alloc_api)] + ([(a.free_ms, 1, free_api)] if a.free_ms is not None else [])
        for ms, operation, api in moments:
            correlation = db.api_call(api, ms, a.thread)
            db.insert("CUDA_GPU_MEMORY_USAGE_EVENTS", start=nsys_ns(ms) - NSYS_LEAD_NS, globalPid=gpid(), deviceId=0,
                      contextId=1, address=a.addr, pc=0, bytes=a.size, memKind=kind, memoryOperationType=operation,
                      correlationId=correlation)
    for ms in (OOM_MS - 0.2, OOM_MS - 0.05):
        db.api_call("cudaMalloc_v3020", ms, MAIN_TID, failed=True)


def _gpu_work(db: _Db) -> None:
    kernels = [("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n", 2000.5, 2010.0, 7),
               ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3500.0, 3600.0, 13),
               ("vectorized_elementwise_kernel", 3999.0, 3999.5, 7)]
    for i, (name, start, end, stream) in enumerate(kernels):
        db.insert("CUPTI_ACTIVITY_KIND_KERNEL", start=nsys_ns(start), end=nsys_ns(end), deviceId=0, contextId=1,
                  streamId=stream, correlationId=db.api_call("cudaLaunchKernel_v7000", start, MAIN_TID),
                  globalPid=gpid(), demangledName=db.string(name + "(...)"), shortName=db.string(name),
                  registersPerThread=64, gridX=132, gridY=1, gridZ=1, blockX=256, blockY=1, blockZ=1,
                  staticSharedMemory=0, dynamicSharedMemory=0, localMemoryPerThread=0, localMemoryTotal=0, gridId=i + 1)
    db.insert("CUPTI_ACTIVITY_KIND_MEMCPY", start=nsys_ns(1320.0), end=nsys_ns(1500.0), deviceId=0, contextId=1, streamId=7,
              correlationId=db.api_call("cudaMemcpyAsync_v3020", 1320.0, MAIN_TID), globalPid=gpid(), bytes=8 * GiB,
              copyKind=1, srcKind=1, dstKind=2)
    db.insert("CUPTI_ACTIVITY_KIND_MEMSET", start=nsys_ns(2001.0), end=nsys_ns(2001.1), deviceId=0, contextId=1, streamId=7,
              correlationId=db.api_call("cudaMemsetAsync_v3020", 2001.0, MAIN_TID), globalPid=gpid(), value=0,
              bytes=4 * MiB, memKind=2)


def _nvtx(db: _Db) -> None:
    """Every way PyTorch users emit NVTX, each as nsys records it."""
    def event(kind: str, start: float, end: float | None, tid: int = MAIN_TID, **row: object) -> None:
        type_id = next(i for i, n in ENUMS["ENUM_NSYS_EVENT_TYPE"] if n == kind)
        db.insert("NVTX_EVENTS", start=nsys_ns(start), end=None if end is None else nsys_ns(end), eventType=type_id,
                  globalTid=gtid(tid), endGlobalTid=gtid(tid) if kind == "NvtxStartEndRange" else None, **row)

    event("NvtxDomainCreate", 1000.0, None, text="train_loop", domainId=1)        # nvtx.annotate(domain="train_loop")
    event("NvtxDomainCreate", 1190.0, None, tid=NCCL_TID, text="NCCL", domainId=2)
    event("NvtxPushPopRange", 1250.0, OOM_MS, text="train_step", domainId=0)       # torch.cuda.nvtx.range_push
    event("NvtxStartEndRange", 1260.0, 1290.0, tid=LOADER_TID, text="load_batch", domainId=1, rangeId=1)
    event("NvtxPushPopRange", 1900.0, 2900.0, text="forward", domainId=0)
    event("NvtxPushPopRange", 2000.0, 2001.0, text="aten::addmm, seq = 12, sizes = [[64, 1024], [64, 4096], [4096, 1024]]",
          domainId=0)                                                               # emit_nvtx(record_shapes=True)
    event("NvtxPushPopRange", 2002.0, 2003.0, domainId=0,
          text="{'mod': 'torch.nn.functional', 'op': 'linear', 'args': [{'name': '', 'type': 'tensor', "
               "'shape': (64, 4096), 'dtype': 'float16'}]}")                        # pyprof / DLProf
    event("NvtxPushPopRange", 2002.0, 2003.5, domainId=0,
          text="{'traceMarker': ['train.py:41'], 'funcStack': '/<module>/Net::forward/Linear::forward/linear'}")
    event("NvtxPushPopRange", 2950.0, OOM_MS, text="backward", domainId=0)
    event("NvtxPushPopRange", 3100.0, 3101.0, text="aten::mm, op_id = 40", domainId=0)
    event("NvtxPushPopRange", 3500.0, 3600.0, textId=db.string("optimizer.step"), domainId=1)  # registered string
    event("NvtxPushPopRange", 3500.0, 3600.0, tid=NCCL_TID, text="ncclAllReduce", domainId=2)
    event("NvtxMark", 3700.0, None, text="checkpoint_saved", domainId=0)


def nsys_export(path: Path) -> None:
    db = _Db(path)
    _metadata(db)
    _memory(db)
    _gpu_work(db)
    _nvtx(db)
    db.close()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    nsys_export(OUT / f"{NAME}.sqlite")
    (OUT / f"{NAME}.pickle").write_bytes(pickle.dumps(snapshot(), protocol=4))
    for path in sorted(OUT.glob(f"{NAME}.*")):
        print(f"{path.relative_to(OUT.parents[2])}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
