"""The log scan's fast paths read a log exactly as the plain path does: a Megatron line read from its bytes
(framework_lines.QUICK) gives the Reading the readers give it, in every context a reader can be in; readings past
MAX_READINGS are counted to the one, with every later line's number exact; and what is read does not depend on
where the blocks end (a table or a wrapped message that runs past a block end keeps its lines)."""
from __future__ import annotations

import io
import re

import pytest

import analyzer.ingest.log as log
import analyzer.ingest.log.lines as lines
from analyzer.core.log_records import LogReading, Reading
from analyzer.ingest.log import read_log
from analyzer.ingest.log.framework_lines import QUICK, FrameworkLinesReader
from tests.support.paths import ROOT

LOGS = ROOT / "fixtures" / "logs"
MiB = 2**20

MEGATRON = ("[Rank 3] (after 7 iterations) memory (MB) | allocated: 3270.16 | max allocated: 5670.39 | "
            "reserved: 6406.00 | max reserved: 6406.00")
LEGACY = ("after 5 iterations memory (MB) | allocated: 10250.5693359375 | max allocated: 12606.06201171875 | "
          "reserved: 17482.0 | max reserved: 17482")
#: lines QUICK takes, and lines a step away from it that the readers read (or not) on the plain path
TAKEN = [MEGATRON, LEGACY, LEGACY.replace(" memory", ") memory").replace("after", "(after"), "[rank2]: " + MEGATRON,
         "[rank2]:" + MEGATRON, "[rank2]" + MEGATRON, "[default4]: " + LEGACY, MEGATRON + "\r",
         "[Rank 12] (after 100 iterations) memory (MB) | allocated: 1 | max allocated: 2 | reserved: 3 | max reserved: 4",
         MEGATRON.replace("3270.16", "1" * 25)]
NOT_TAKEN = ["[rank2]:  " + MEGATRON, "[rank2]:\t" + MEGATRON, " " + MEGATRON, MEGATRON + " ", MEGATRON + "\r\r",
             "\x1b[32m" + MEGATRON + "\x1b[0m", MEGATRON.replace("|", "&#124;"), "0: " + MEGATRON,
             "[rank1]: [rank2]: " + MEGATRON, MEGATRON + " | extra", MEGATRON.replace("3270.16", "3,270.16"),
             MEGATRON.replace("7 iter", "\u0667 iter"), "(RayWorker pid=5) " + MEGATRON, "> " + MEGATRON,
             "[2024-01-01 12:00:00 TP3] " + MEGATRON, MEGATRON + " vllm", "sglang " + MEGATRON, "\u00e9" + MEGATRON,
             "(before training) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 4.0"]
#: what a reader may be inside when such a line comes: a message cut short (the line may be its rest), a whole
#: message (the next line may still be), a summary table, a headed CSV, a noheader query, a stats dict, DeepSpeed's
#: label and list_gpu_processes()
CONTEXTS = [
    [],
    ["RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 7.93 GiB total capacity;"],
    ["RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; 1 GiB already "
     "allocated; 0 bytes free; 2 GiB reserved in total by PyTorch)"],
    ["|                  PyTorch CUDA memory summary, device ID: 0                |",
     "|            CUDA OOMs: 1            |        cudaMalloc retries: 1         |",
     "| Allocated memory      |    1.00 GB |    2.00 GB |   10.00 GB |    9.00 GB |"],
    ["index, memory.used [MiB], memory.total [MiB]", "0, 1000 MiB, 81920 MiB"],
    ["nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits", "0, 1000, 81920"],
    ["{'allocated_bytes.all.current': 1024,", "'reserved_bytes.all.peak': 2048,"],
    ["[2022-02-21 23:37:48,850] [INFO] [utils.py:827:see_memory_usage] after forward"],
    ["GPU:0", "process      12345 uses     1024.000 MB GPU memory"],
]
DEEPSPEED_MA = ("[2022-02-21 23:37:48,850] [INFO] [utils.py:827:see_memory_usage] MA 4.89 GB         Max_MA 4.89 GB"
                "         CA 6.68 GB         Max_CA 7 GB")


def _contexts_log() -> bytes:
    out = []
    for context in CONTEXTS:
        for line in TAKEN + NOT_TAKEN:
            out += context + [line, line, "noise"] + context + [line, DEEPSPEED_MA]
    return ("\n".join(out) + "\n").encode()


def _plain(data: bytes, monkeypatch: pytest.MonkeyPatch, block: int | None = None) -> LogReading:
    """`data` read with no line read from its bytes (QUICK matches nothing), in one block unless told."""
    with monkeypatch.context() as patched:
        patched.setattr(log, "QUICK", re.compile(b"(?!)"))
        patched.setattr(lines, "BLOCK", block or len(data) + 1)
        return read_log(io.BytesIO(data), "log")


def _counting_quick(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The numbers of the lines read from their bytes, from now on."""
    taken: list[int] = []
    original = FrameworkLinesReader.quick

    def counted(self: FrameworkLinesReader, number: int, match: re.Match[bytes], keep: bool) -> Reading | None:
        taken.append(number)
        return original(self, number, match, keep)

    monkeypatch.setattr(FrameworkLinesReader, "quick", counted)
    return taken


def test_quick_takes_megatron_lines_and_nothing_a_step_away() -> None:
    assert all(QUICK.fullmatch(line.encode()) for line in TAKEN)
    assert not any(QUICK.fullmatch(line.encode()) for line in NOT_TAKEN)


@pytest.mark.parametrize("block", [1 << 20, 997, 150])
def test_a_line_read_from_its_bytes_reads_as_the_readers_read_it(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    data = _contexts_log()
    plain = _plain(data, monkeypatch)
    taken = _counting_quick(monkeypatch)
    monkeypatch.setattr(lines, "BLOCK", block)
    assert read_log(io.BytesIO(data), "log") == plain
    crlf = data.replace(b"\n", b"\r\n")
    assert read_log(io.BytesIO(crlf), "log") == _plain(crlf, monkeypatch)
    # the quick path ran (on every taken line outside a reader's table or message, and only there), and the
    # plain path reads the same Megatron numbers from it
    assert len(taken) > 150 and len(taken) < sum(1 for r in plain.readings if r.source == "megatron")
    first = next(r for r in plain.readings if r.source == "megatron")
    assert (first.rank, first.step, first.bytes["allocated"]) == (3, 7, round(3270.16 * MiB))


def test_every_fixture_reads_the_same_with_the_quick_path_and_any_block(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [p.read_bytes() for p in sorted(LOGS.glob("*.log"))]
    whole = b"\n".join(texts)
    cases = texts + [whole + b"\n", whole.rstrip(b"\n"), whole.replace(b"\n", b"\r\n")]
    expected = [_plain(t, monkeypatch) for t in cases]
    for block in (1 << 20, 4096, 997, 150, 64):
        monkeypatch.setattr(lines, "BLOCK", block)
        assert [read_log(io.BytesIO(t), "log") for t in cases] == expected, block


def test_a_summary_table_across_a_block_end_keeps_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # its pool rows hold no anchor: they reach the reader only because it is inside the table, past the block end too
    data = (LOGS / "reserved_summary_pytorch_35901.log").read_bytes()
    whole = read_log(io.BytesIO(data), "log").readings
    assert "allocated_large" in whole[0].bytes
    for block in range(100, 400, 7):
        monkeypatch.setattr(lines, "BLOCK", block)
        assert read_log(io.BytesIO(data), "log").readings == whole, block


def test_readings_past_the_cap_are_counted_and_later_lines_keep_their_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = 40
    monkeypatch.setattr(log, "MAX_READINGS", cap)
    megatron = "".join(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: {i}.5 | max allocated: 2.0 | "
                       f"reserved: 3.0 | max reserved: 4.0\nnoise\n" for i in range(1, 101))
    oom = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; 1 GiB "
           "already allocated; 0 bytes free; 2 GiB reserved in total by PyTorch)\n")
    data = (megatron + oom + megatron).encode()
    taken = _counting_quick(monkeypatch)
    for block in (1 << 20, 300):
        monkeypatch.setattr(lines, "BLOCK", block)
        reading = read_log(io.BytesIO(data), "log")
        assert [r.step for r in reading.readings] == list(range(1, cap + 1))
        assert reading.readings[-1].line == 2 * cap - 1
        assert reading.warnings == [f"{200 - cap} memory readings after the first {cap} were not kept"]
        assert [o.line for o in reading.ooms] == [201] and reading.lines == 401
        assert reading == _plain(data, monkeypatch)
    # read from their bytes up to the cap; after it only matched and counted (in each of the two reads)
    assert taken == list(range(1, 2 * cap, 2)) * 2


def test_the_cap_reached_by_other_readings_still_counts_megatron_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log, "MAX_READINGS", 3)
    csv = "index, memory.used [MiB], memory.total [MiB]\n" + "0, 1000 MiB, 81920 MiB\n" * 3 + "\n"
    data = (csv + (MEGATRON + "\n") * 5).encode()
    reading = read_log(io.BytesIO(data), "log")
    assert [r.source for r in reading.readings] == ["nvidia_smi_csv"] * 3 and "megatron" in reading.frameworks
    assert reading.warnings == ["5 memory readings after the first 3 were not kept"]
    assert reading == _plain(data, monkeypatch)


def test_a_stream_without_readinto_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self._inner = io.BytesIO(data)

        def read(self, size: int) -> bytes:
            return self._inner.read(min(size, 77))   # short reads too

    data = (LOGS / "reserved_summary_pytorch_35901.log").read_bytes() + _contexts_log()
    monkeypatch.setattr(lines, "BLOCK", 997)
    assert read_log(ReadOnly(data), "log") == read_log(io.BytesIO(data), "log")  # type: ignore[arg-type]
