"""Issue 37: the run log, the Dask cluster, the files beside the report, archive headers and quadratic paths. Each
hostile input ends in exit 0 with the safe behaviour or in one exit-2 line; scaling is measured by sizes and
operation counts at N and 2N, never by wall time alone."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analyzer.core.printable import printable, visible
from analyzer.report import run_pairs
from analyzer.report.markdown import md_text
from analyzer.report.run_log import MAX_LINE_BYTES, read_log
from tests.hostile import round2, round3
from tests.hostile.test_round2 import FIXTURE, _cli, _one_error_line
from tests.support.paths import REAL, ROOT as REPO


# ---- the run log: planted links, special files, huge lines, numbers ----------------------------------------
def _log_line(i: int = 0, **change: object) -> str:
    return json.dumps({**round3.run_record(i), **change})


@pytest.mark.parametrize("dangling", [False, True])
def test_a_planted_link_at_the_log_is_not_followed(tmp_path: Path, dangling: bool) -> None:
    victim = tmp_path / "bashrc"
    if not dangling:
        victim.write_text("keep\n")
    (tmp_path / "runs.jsonl").symlink_to(victim)
    _one_error_line(_cli(FIXTURE, "-q", "-o", tmp_path / "r.json", "--log", tmp_path / "runs.jsonl"),
                    "runs.jsonl", "symbolic link", "nothing was appended")
    assert victim.read_text() == "keep\n" if not dangling else not victim.exists()
    assert not (tmp_path / "r.json").exists()   # refused before the analysis
    plain = tmp_path / "plain.jsonl"            # the other side: a regular file is appended to
    assert _cli(FIXTURE, "-q", "-o", tmp_path / "r.json", "--log", plain).returncode == 0
    assert len(plain.read_text().splitlines()) == 1


def test_a_fifo_as_the_log_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "runs.jsonl"
    os.mkfifo(fifo)
    _one_error_line(_cli(FIXTURE, "-q", "-o", tmp_path / "r.json", "--log", fifo), "runs.jsonl", "not a regular file")
    _one_error_line(_cli("log", fifo), "runs.jsonl", "not a regular file")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_as_the_log_is_refused(device: str) -> None:
    _one_error_line(_cli("log", device), device, "not a regular file")


def test_a_line_past_the_cap_is_skipped_unread(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    with path.open("w") as f:
        f.write(_log_line(0) + "\n")
        f.write('{"note": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n')
        f.write(_log_line(2) + "\n")
    log = read_log(path)
    assert [r.line for r in log.runs] == [1, 3]
    assert log.skipped == [f"line 2: longer than {MAX_LINE_BYTES} bytes"]
    path.write_text(_log_line(0) + "\n" + "y" * MAX_LINE_BYTES + "\n")   # the other side: at the cap, read (not JSON)
    assert read_log(path).skipped == ["line 2: not JSON (a cut or edited line)"]


@pytest.mark.parametrize("value,problem", [("1" + "0" * 400, "a number beyond 64 bits"),
                                           ("NaN", "not JSON"), ("Infinity", "not JSON"), ("1e400", "beyond 64 bits")])
def test_numbers_no_analysis_writes_are_skipped(tmp_path: Path, value: str, problem: str) -> None:
    bad = _log_line(1).replace('"needed_bytes": 8589934592', f'"needed_bytes": {value}', 1)
    assert bad != _log_line(1)
    path = tmp_path / "runs.jsonl"
    path.write_text(_log_line(0) + "\n" + bad + "\n")
    log = read_log(path)
    assert [r.line for r in log.runs] == [1] and problem in log.skipped[0]
    run = _cli("log", path, "--format", "json")
    assert run.returncode == 0, run.stderr
    json.loads(run.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    edge = _log_line(1).replace('"needed_bytes": 8589934592', f'"needed_bytes": {2**63 - 1}', 1)
    path.write_text(_log_line(0) + "\n" + edge + "\n")   # the other side: the largest int64 is read
    assert len(read_log(path).runs) == 2


@pytest.mark.parametrize("fmt", ["text", "json", "html"])
def test_a_lone_surrogate_in_a_note_is_shown_escaped(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text(_log_line(0, note="a\\udc80b" + "".join(round3.INVISIBLE)).replace("\\\\udc80", "\\udc80") + "\n")
    assert read_log(path).runs[0].record["note"].startswith("a\udc80b")
    run = _cli("log", path, "--format", fmt, "-o", tmp_path / f"out.{fmt}")
    assert run.returncode == 0, run.stderr
    text = (tmp_path / f"out.{fmt}").read_text(encoding="utf-8")
    if fmt == "json":
        assert json.loads(text)["runs"][0]["note"].startswith("a\udc80b")
    else:
        assert "a\\udc80b\\u200b" in text and not set(text) & set("".join(round3.INVISIBLE))


def _pairing_calls(n: int, monkeypatch: pytest.MonkeyPatch) -> int:
    calls = [0]
    real = run_pairs._one_apart

    def counting(before: tuple, after: tuple) -> bool:
        calls[0] += 1
        return real(before, after)

    monkeypatch.setattr(run_pairs, "_one_apart", counting)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"runs-{os.getpid()}-{n}.jsonl"
    try:
        path.write_bytes(round3.many_runs(n))
        assert run_pairs.pair_runs(read_log(path).runs) == []
    finally:
        path.unlink()
    return calls[0]


def test_pairing_runs_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    window = run_pairs.PAIR_WINDOW
    for n in (4 * window, 8 * window):   # each run compared with the window before it: was n²/2 (24 s for 4,000)
        assert _pairing_calls(n, monkeypatch) == n * window - window * (window + 1) // 2


def test_a_pair_is_found_within_the_window_and_not_beyond(tmp_path: Path) -> None:
    window = run_pairs.PAIR_WINDOW
    for gap, pairs in ((window, 1), (window + 1, 0)):
        lines = [round3.run_record(0, gpus=1)] + [round3.run_record(i, gpus=None) for i in range(1, gap)] + \
            [round3.run_record(gap, gpus=2)]   # between them, runs that know no GPU count: one change from neither
        path = tmp_path / f"gap{gap}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        runs = read_log(path).runs
        found = run_pairs.pair_runs(runs)
        assert len([p for p in found if p.after is runs[-1]]) == pairs, gap


# ---- strings: lone surrogates, invisible characters, GH-1 ------------------------------------------------
def test_invisible_characters_and_surrogates_are_escaped() -> None:
    for char in [*round3.INVISIBLE, round3.SURROGATE]:
        for shown in (printable(f"a{char}b"), visible(f"a{char}b")):
            assert not set(shown) & set(char) and shown.startswith("a\\") and shown.endswith("b"), repr(shown)
    assert printable("naïve café → 東京 🙂") == "naïve café → 東京 🙂"


def test_gh_references_are_not_linked_in_markdown() -> None:
    assert md_text("see GH-12 and gh-3") == "see GH-\u200b12 and gh-\u200b3"
    assert md_text("GHX-1 and GH-x") == "GHX-1 and GH-x"


@pytest.mark.parametrize("fmt", ["html", "md", "json"])
def test_a_lone_surrogate_and_invisible_characters_in_a_snapshot(tmp_path: Path, fmt: str) -> None:
    text = "a" + round3.SURROGATE + "".join(round3.INVISIBLE) + "b"
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(round3.snapshot_with(text)))
    out = tmp_path / f"r.{fmt}"
    run = _cli(path, "-o", out, "--format", fmt, env={"COLUMNS": "300"})
    assert run.returncode == 0, run.stderr
    report = out.read_text(encoding="utf-8")
    assert not set(report + run.stdout) & set("".join([*round3.INVISIBLE, round3.SURROGATE]).replace("\u200b", "")
                                              if fmt == "md" else text[1:-1])
    if fmt == "json":
        json.loads(report, parse_constant=lambda c: pytest.fail(c))
    elif fmt == "html":   # shown, escaped (the Markdown summary names no frame)
        assert "a\\udc80\\u200b" in report


# ---- the Dask cluster --------------------------------------------------------------------------------------
def test_the_local_cluster_is_on_loopback_and_refuses_clients_without_its_credentials() -> None:
    import socket
    import ssl

    import psutil
    from dask.distributed import Client
    from distributed.security import Security

    from analyzer.job import local_cluster

    cluster, security = local_cluster(1)
    try:
        me = psutil.Process()
        listening = [c.laddr for p in [me, *me.children(recursive=True)] for c in p.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 3 and {a.ip for a in listening} == {"127.0.0.1"}, listening  # scheduler, HTTP, worker
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        host, port = address.removeprefix("tls://").rsplit(":", 1)
        with pytest.raises(OSError):                         # plain TCP
            Client(address.replace("tls://", "tcp://"), timeout=3)
        with pytest.raises(OSError):                         # other credentials: neither side trusts the other
            Client(address, security=Security.temporary(), timeout=3)
        anyone = ssl.create_default_context()                # TLS that trusts the server but shows no certificate
        anyone.check_hostname, anyone.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection((host, int(port)), timeout=3) as raw:
            try:
                with anyone.wrap_socket(raw) as tls:
                    tls.sendall(b"\0" * 64)
                    answer = tls.recv(64)
            except OSError:   # ssl.SSLError: the handshake refused
                answer = b""
        assert answer == b""   # not a byte of the scheduler's protocol came back
        with Client(cluster, security=security) as client:  # the other side: the analyzer's own client works
            assert client.submit(sum, [6, 36]).result() == 42
        import dask

        from analyzer.job import _connect

        tls = {"distributed.comm.tls.ca-file": security.tls_ca_file,   # --scheduler tls://... with Dask's
               "distributed.comm.tls.client.cert": security.tls_client_cert,   # TLS settings (PEM text here)
               "distributed.comm.tls.client.key": security.tls_client_key}
        with dask.config.set(tls), _connect(address) as client:
            assert client.submit(sum, [1, 2]).result() == 3
    finally:
        cluster.close()


@pytest.mark.parametrize("address", ["not a url", "[::1", "tcp://127.0.0.1:" + "9" * 5000, "inproc://x",
                                     "tcp://127.0.0.1:0", "ucx://127.0.0.1:8786"])
def test_an_address_that_does_not_parse_is_refused(address: str) -> None:
    from analyzer.errors import AnalyzerError
    from analyzer.job import check_scheduler

    with pytest.raises(AnalyzerError, match="is not a Dask scheduler address"):
        check_scheduler(address)
    for good in ("tcp://127.0.0.1:8786", "tls://[::1]:8786", "scheduler.example:65535"):   # the other side
        assert check_scheduler(good) == good


def test_the_cli_refuses_an_address_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "rank0.pickle").write_bytes(FIXTURE.read_bytes())
    line = _one_error_line(_cli(tmp_path / "job", "-q", "-o", tmp_path / "r.json", "--scheduler", "[::1"),
                           "is not a Dask scheduler address")
    assert len(line) < 300


def test_a_silent_scheduler_is_told_within_seconds() -> None:
    import socket

    from analyzer.errors import AnalyzerError
    from analyzer.job import CONNECT_SECONDS, _connect

    with socket.socket() as silent:   # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        with pytest.raises(AnalyzerError, match=f"did not answer as one within {CONNECT_SECONDS} s"):
            _connect(f"tcp://127.0.0.1:{silent.getsockname()[1]}")
        assert time.monotonic() - started < CONNECT_SECONDS + 5   # Dask alone waited for its handshake forever


# ---- files beside the report ----------------------------------------------------------------------------------
def test_the_chart_never_replaces_a_file_beside_the_report(tmp_path: Path) -> None:
    recording = tmp_path / "notes.png"   # formats are told by their bytes: a snapshot may be called notes.png
    recording.write_bytes(FIXTURE.read_bytes())
    (tmp_path / "other.png").write_bytes(b"keep")
    for target, chart in (("notes.md", "notes-1.png"), ("other.md", "other-1.png"), ("fresh.md", "fresh.png")):
        run = _cli(recording, "-o", tmp_path / target, env={"COLUMNS": "1000"})
        assert run.returncode == 0, run.stderr
        assert f"report written to {tmp_path / chart}\n" in run.stdout
        assert f"`{chart}`" in (tmp_path / target).read_text()   # the report names the chart it wrote beside it
        assert (tmp_path / chart).read_bytes()[:4] == b"\x89PNG"
    assert recording.read_bytes() == FIXTURE.read_bytes() and (tmp_path / "other.png").read_bytes() == b"keep"


def test_the_report_never_replaces_its_input(tmp_path: Path) -> None:
    recording = tmp_path / "notes.png"
    recording.write_bytes(FIXTURE.read_bytes())
    _one_error_line(_cli(recording, "-q", "-o", tmp_path / "." / "notes.png", "--format", "md"), "is the input itself")
    assert recording.read_bytes() == FIXTURE.read_bytes()


# ---- archives and folders of ranks ----------------------------------------------------------------------------
KINETO = FIXTURE.parents[1] / "kineto" / "train.pt.trace.json.gz"


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize("kind", ["L", "x"])
def test_an_archive_header_declaring_gigabytes_is_refused_unread(tmp_path: Path, kind: str) -> None:
    """A GNU long name ('L') or pax header ('x') declaring 4 GiB in an 8 KB .tar.gz: tarfile read it whole while
    sniffing (past 3 GB), so the parent runs here under a 3 GiB address-space limit."""
    import tarfile

    path = tmp_path / "ranks.tar.gz"
    path.write_bytes(round3.tar_with_huge_first_header(kind.encode(), 4 << 30, 8 << 20))
    assert path.stat().st_size < 20_000
    run = subprocess.run([sys.executable, "-m", "analyzer", str(path), "-q", "-o", str(tmp_path / "r.json")],
                         check=False, capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory)
    _one_error_line(run, "ranks.tar.gz", "declares 4294967296 bytes of name or attributes")
    (tmp_path / "job").mkdir()   # inside a folder of ranks, the archive is sniffed and skipped
    path.rename(tmp_path / "job" / "ranks.tar.gz")
    (tmp_path / "job" / "rank0.pickle").write_bytes(FIXTURE.read_bytes())
    from analyzer.ingest.ranks import find_rank_files

    assert [f.path.name for f in find_rank_files(tmp_path / "job").files] == ["rank0.pickle"]
    legit = tmp_path / "long.tar.gz"   # the other side: a long member name (a GNU long-name header) is read
    with tarfile.open(legit, "w:gz", format=tarfile.GNU_FORMAT) as archive:
        archive.add(KINETO, arcname="r" * 300 + ".pt.trace.json.gz")
    from analyzer.ingest import load

    assert len(load(legit).traces) == 1


def test_a_fifo_put_in_a_rank_files_place_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from analyzer.ingest import ranks

    (tmp_path / "rank0.pickle").write_bytes(FIXTURE.read_bytes())
    os.mkfifo(tmp_path / "rank1.pickle")
    listed = [tmp_path / "rank0.pickle", tmp_path / "rank1.pickle"]   # as if rank1 was a file when listed
    monkeypatch.setattr(ranks, "_walk", lambda root, warnings: listed)
    found = ranks.find_rank_files(tmp_path)   # opening the FIFO for reading blocked for ever
    assert [f.rank for f in found.files] == [0]
    assert found.warnings == ["skipped rank1.pickle: is not a regular file"]


def _skipped_warnings(n: int, folder: Path) -> list[str]:
    from analyzer.ingest.ranks import find_rank_files

    folder.mkdir()
    (folder / "rank0.pickle").write_bytes(FIXTURE.read_bytes())
    for i in range(n):
        (folder / f"e{i:06d}").touch()
    return find_rank_files(folder).warnings


def test_a_folder_of_empty_files_names_only_a_few(tmp_path: Path) -> None:
    from analyzer.ingest.limits import SKIPPED_NAMED

    for n in (2_000, 4_000):   # the report's warnings stay the same size: was one line a file (6 MB at 100,000)
        warnings = _skipped_warnings(n, tmp_path / str(n))
        assert len(warnings) == SKIPPED_NAMED + 1 and warnings[0] == "skipped e000000: empty"
        assert warnings[-1] == f"skipped {n - SKIPPED_NAMED} more files (not recordings of one rank, empty, or " \
            "unreadable)"
    assert len(_skipped_warnings(SKIPPED_NAMED, tmp_path / "few")) == SKIPPED_NAMED   # the other side: all named


def test_junk_members_of_an_archive_are_counted_not_named(tmp_path: Path) -> None:
    from analyzer.ingest import load
    from analyzer.ingest.limits import SKIPPED_NAMED

    for n, lines in ((2_000, SKIPPED_NAMED + 1), (SKIPPED_NAMED, SKIPPED_NAMED)):
        path = tmp_path / f"junk{n}.tar.gz"
        path.write_bytes(round3.junk_tar(n, KINETO.read_bytes()))
        loaded = load(path)
        assert len(loaded.traces) == 1
        assert len([w for w in loaded.warnings if w.startswith("skipped ")]) == lines, loaded.warnings[-1]


# ---- frame paths: deep, and one file spelled many ways -------------------------------------------------------
def _path_lookups(depth: int, monkeypatch: pytest.MonkeyPatch) -> int:
    from analyzer.attribute import module_paths
    from analyzer.ingest.snapshot import snapshot_to_trace

    calls = [0]
    real = module_paths._is_regular

    def counting(path: str) -> bool:
        calls[0] += 1
        return real(path)

    monkeypatch.setattr(module_paths, "_is_regular", counting)
    index = module_paths.SourceIndex(["/nonexistent-root"])
    trace = snapshot_to_trace(round3.deep_frames(depth), "deep")
    for frames in trace.stacks["frames"]:
        module_paths.call_path(frames, index)
    return calls[0]


def test_locating_a_deep_frame_path_is_linear_in_its_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,300 levels (a 1.4 KB file) took a minute: every suffix of the path was tried under every root."""
    shallow, deep = _path_lookups(650, monkeypatch), _path_lookups(1300, monkeypatch)
    assert deep == shallow, (shallow, deep)   # at most MAX_SUFFIX_PARTS suffixes a root, whatever the depth


def test_one_file_spelled_many_ways_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """6,000 spellings of one file (`/./`) were each parsed again: 161 s and 2 GB."""
    from analyzer.attribute import module_paths
    from analyzer.ingest.snapshot import snapshot_to_trace

    (tmp_path / "model.py").write_text("class Block(Module):\n    def forward(self, x):\n        return x\n")
    parses = [0]
    real = module_paths._parse

    def counting(data: bytes) -> object:
        parses[0] += 1
        return real(data)

    monkeypatch.setattr(module_paths, "_parse", counting)
    module_paths._parsed.cache_clear()
    trace = snapshot_to_trace(round3.respelled_frames(str(tmp_path), 2_000), "spellings")
    index = module_paths.SourceIndex([tmp_path])   # the folder named with --source-root
    paths = {module_paths.call_path(frames, index) for frames in trace.stacks["frames"]}
    assert parses[0] == 1
    assert {lv.label for p in paths for lv in p} == {"Block"}   # every spelling still reads its class


# ---- stacks sharing their frames; the CPU budget ---------------------------------------------------------------
def _frame_conversions(stacks: int, monkeypatch: pytest.MonkeyPatch) -> int:
    import gzip

    import analyzer.ingest.snapshot_history as history
    from analyzer.ingest.snapshot import snapshot_to_trace

    calls = [0]
    real = history.text

    def counting(value: object, what: str) -> str:
        calls[0] += what.startswith("frame ")
        return real(value, what)

    monkeypatch.setattr(history, "text", counting)
    data = pickle.loads(gzip.decompress(round3.shared_frame_stacks(stacks, 300)))   # the generator's own bytes
    assert len(snapshot_to_trace(data, "shared").stacks) == stacks + 1   # and the segments' own stack
    return calls[0]


def test_stacks_of_shared_frames_convert_each_frame_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 distinct stacks of the same 1,500 frames (a 51 KB .pickle.gz) took 100 s of CPU: every frame of
    every stack was converted."""
    for stacks in (200, 400):   # the 300 shared frames once, and the one frame of each block's own stack (2 strings
        assert _frame_conversions(stacks, monkeypatch) == 2 * (300 + stacks + 1)   # a frame); was 2 * 300 * stacks


def _frames_looked_at(stacks: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(frames attribution looked at, frames its stacks hold) for `stacks` stacks of 300 shared frames."""
    import gzip

    from analyzer.attribute import attribute, frames
    from analyzer.ingest.snapshot import snapshot_to_trace

    calls = [0]
    real = frames._frame_facts

    def counting(frame: tuple[str, int, str]) -> tuple[int, object]:
        calls[0] += 1
        return real(frame)

    monkeypatch.setattr(frames, "_frame_facts", counting)
    trace = snapshot_to_trace(pickle.loads(gzip.decompress(round3.shared_frame_stacks(stacks, 300))), "shared")
    attribute(trace)
    return calls[0], sum(len(f) for f in trace.stacks["frames"])


def test_stacks_of_shared_frames_are_attributed_once_per_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attribution looked at every frame of every stack (3,000 stacks of 1,500 shared frames: 15 s of CPU after
    the reader's fix): now each distinct frame once (the 300 shared ones and the segments' own), however many
    stacks hold them."""
    for stacks in (200, 400):
        looked_at, held = _frames_looked_at(stacks, monkeypatch)
        assert looked_at == 300 + 1 and held > 300 * stacks   # was `held`: over 60,000 and 120,000 frames


@pytest.mark.parametrize("depth", [64, 65, 1_500])
def test_a_call_path_keeps_the_innermost_64_levels(depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack of 1,500 modules' `forward` frames made a 1,500-level call path per stack, and labelling calls is
    quadratic in the depth (200 such stacks: 24 s of CPU). No model nests 64 modules deep: 64 levels are kept,
    the innermost, and looked for in the innermost frames only."""
    from analyzer.attribute import module_paths

    looked = [0]
    real = module_paths._level

    def counting(*args: object) -> object:
        looked[0] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(module_paths, "_level", counting)
    frames = tuple((f"/src/m{i}.py", i + 1, "forward") for i in range(depth))
    path = module_paths.call_path(frames)
    assert module_paths.MAX_LEVELS == 64 and len(path) == min(depth, 64)
    assert path[-1].line == 1 and path[0].line == min(depth, 64)   # outermost first: frames 64..1
    assert looked[0] == min(depth, 64)


def test_the_cpu_budget_scales_with_what_the_input_expands_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip

    from analyzer.ingest.confined import BASE_CPU_SECONDS, cpu_limit

    monkeypatch.delenv("ANALYZER_MAX_READ_SECONDS", raising=False)
    tiny = tmp_path / "keys.pickle"
    tiny.write_bytes(round2.tuple_keys(60))   # stopped after 20 s of CPU in round 2
    assert cpu_limit(tiny) == BASE_CPU_SECONDS == 5
    body = b"".join(b"%08d\n" % i for i in range((16 << 20) // 9 + 1))[: 16 << 20]
    packed = tmp_path / "big.pickle.gz"       # the other side: 16 MiB once decompressed has 16 s more
    packed.write_bytes(gzip.compress(body, 1))
    assert packed.stat().st_size < 8 << 20 and cpu_limit(packed) == BASE_CPU_SECONDS + 16


# ---- a bomb behind an incompressible prefix -------------------------------------------------------------------
def test_nones_behind_a_random_prefix_are_stopped_by_the_windowed_ratio(tmp_path: Path) -> None:
    """1 MiB of random bytes, then 100M pickled Nones: 1.1 MB that expand 90 times as a whole (under the limit of
    200), 1000 times after the prefix. The unpickler would hold 1.6 GB for the list; 600M took past 3 GB."""
    path = tmp_path / "nones.pickle.gz"
    path.write_bytes(round3.nones_behind_a_prefix(100 << 20, 1 << 20))
    assert path.stat().st_size * 200 > (101 << 20)
    _one_error_line(_cli(path, "-q", "-o", tmp_path / "r.json"), "nones.pickle.gz",   # its objects' memory first
                    "more than 400 bytes of memory per compressed byte", "ANALYZER_MAX_PICKLE_MEMORY_RATIO")
    _one_error_line(_cli(path, "-q", "-o", tmp_path / "r.json", env={"ANALYZER_MAX_PICKLE_MEMORY_RATIO": "10000000"}),
                    "nones.pickle.gz", "200 times its compressed size over 64 MiB", "ANALYZER_MAX_COMPRESSION_RATIO")


#: runs `analyze` in a child with the floor of the unpickled objects' memory at 8 MiB (so that the bound per
#: compressed byte decides on a file of a few MB), and prints the peak resident memory of the children
_WATCHED_CLI = ("import resource, subprocess, sys; run = subprocess.run([sys.executable, '-c', 'import sys; "
                "import analyzer.ingest.safe_pickle as p; p.MEMORY_FLOOR = 8 << 20; from analyzer.commands import main; "
                "sys.exit(main(sys.argv[1:]))', *sys.argv[1:]], check=False); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10); sys.exit(run.returncode)")


def _watched(path: Path, out: Path, ratio: int | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """(the run, with its printed peak taken off stdout; that peak in bytes)."""
    env = {**os.environ, **({"ANALYZER_MAX_PICKLE_MEMORY_RATIO": str(ratio)} if ratio else {})}
    run = subprocess.run([sys.executable, "-c", _WATCHED_CLI, str(path), "-q", "-o", str(out)], check=False,
                         capture_output=True, text=True, timeout=300, env=env, preexec_fn=_limit_memory)
    return run, int(run.stdout.split()[-1])


def test_references_compressed_under_the_ratio_limit_are_stopped_early(tmp_path: Path) -> None:
    """256M references (Nones and small integers) in a 1.4 MB gzip that expands 190 times, under the ratio limit:
    the list needed 2 GB (8 bytes a reference; 600M of them, past 3 GB), bounded only by the 3 GiB memory limit.
    Its objects take some 3,000 bytes per compressed byte read, a real snapshot's 61: past 400 it is refused,
    holding a few hundred MB."""
    path = tmp_path / "references.pickle.gz"
    path.write_bytes(round3.references(256 << 20))
    assert path.stat().st_size < (3 << 19)
    run, peak = _watched(path, tmp_path / "r.json")
    _one_error_line(run, "references.pickle.gz", "more than 400 bytes of memory per compressed byte",
                    "ANALYZER_MAX_PICKLE_MEMORY_RATIO")
    assert peak < 1 << 30


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/real (the real recordings) is absent")
def test_a_real_shaped_snapshot_is_under_the_memory_per_compressed_byte(tmp_path: Path) -> None:
    """The CS336 recording (C++ and Python frames) repeated to 100,000 entries, gzipped (1.3 MB, 13 times): its
    objects take 61 bytes per compressed byte, read whole under the bound of 400 and refused under one of 30."""
    import gzip
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_real_snapshot", REPO / "benchmarks" / "make_real_snapshot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    path = tmp_path / "real.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(module.make("cpp-frames", 100_000), protocol=4), 6))
    run, _ = _watched(path, tmp_path / "r.json")
    assert run.returncode == 0 and json.loads((tmp_path / "r.json").read_text())["devices"], run.stderr
    run, _ = _watched(path, tmp_path / "r.json", ratio=30)
    _one_error_line(run, "real.pickle.gz", "more than 30 bytes of memory per compressed byte")


def _gunzipped(body: bytes) -> int:
    import gzip
    import io

    from analyzer.ingest.sniff import gunzip

    with gunzip(io.BytesIO(gzip.compress(body, 6)), "window.gz") as stream:
        return sum(len(chunk) for chunk in iter(lambda: stream.read(1 << 16), b""))


def test_the_ratio_is_checked_over_every_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a scale of 1 MiB windows and a ratio limit of 10: random bytes then zeros expand 3 times as a whole
    and are refused at the second window; text that expands 2-3 times in every window is read whole."""
    from analyzer.errors import ResourceLimit
    from analyzer.ingest import sniff

    monkeypatch.setattr(sniff, "RATIO_FLOOR_BYTES", 1 << 20)
    monkeypatch.setenv("ANALYZER_MAX_COMPRESSION_RATIO", "10")
    prefix = os.urandom(1 << 20)
    with pytest.raises(ResourceLimit, match="10 times its compressed size over 1 MiB"):
        _gunzipped(prefix + bytes(2 << 20))
    text = os.urandom(3 << 19).hex().encode()   # 3 MiB of hex digits: 2 times in every window
    assert _gunzipped(prefix + text) == (1 << 20) + len(text)
