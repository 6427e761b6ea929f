"""The hostile corpus (tests/hostile/corpus, see make_corpus.py) through the CLI, and truncations of real-layout
inputs at every cut point.

Every input ends in one clear error (an AnalyzerError subclass, exit code 2, one line on stderr naming the file)
or in a complete analysis (exit code 0; with the expected warning where the input is inconsistent), within a
subprocess timeout and a 2 GiB address-space limit, and no payload creates anything.
"""
from __future__ import annotations

import copyreg
import gzip
import json
import os
import pickle
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.errors import AnalyzerError, CorruptInput
from analyzer.ingest import load
from hostile import make_corpus
from hostile.pipeline import outcome
from support.paths import FIXTURES, ROOT

CORPUS = make_corpus.CORPUS
MANIFEST: dict[str, dict] = json.loads((CORPUS / "MANIFEST.json").read_text())
BATCH = Path(make_corpus.__file__).with_name("cli_batch.py")
MEMORY_LIMIT = 2 << 30
SECONDS_PER_FILE = 10


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _env() -> dict[str, str]:
    """This environment, with the checkout and the corpus scripts importable and one BLAS thread (whose
    buffers would otherwise count against the memory limit)."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(BATCH.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture
def extensions_registered():
    """The EXT payloads' codes registered, as an imported library might have done; removed afterwards."""
    make_corpus.register_extensions()
    yield
    for code, (module, name) in make_corpus.EXTENSIONS.items():
        copyreg.remove_extension(module, name, code)


def _cli_batch(files: list[Path], cwd: Path) -> dict[str, dict]:
    """Run the CLI on `files` in one subprocess (see cli_batch.py); name -> its result."""
    try:
        run = subprocess.run([sys.executable, str(BATCH), str(cwd), *map(str, files)], capture_output=True, text=True,
                             cwd=cwd, timeout=120, preexec_fn=_limit_memory, env=_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or b""
        output = output.decode() if isinstance(output, bytes) else output
        started = [json.loads(line)["start"] for line in output.splitlines() if line.startswith('{"start"')]
        pytest.fail(f"the CLI hung on {started[-1] if started else 'its first file'}")
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"file"')]
    assert run.returncode == 0 and len(results) == len(files), f"the batch died:\n{run.stderr[-3000:]}"
    return {Path(r["file"]).name: r for r in results}


def test_corpus_is_what_its_script_writes() -> None:
    cases = {c.name: c for c in make_corpus.cases()}
    on_disk = {p.name for p in CORPUS.iterdir()} - {"MANIFEST.json"}
    assert set(MANIFEST) == set(cases) == on_disk, "run python tests/hostile/make_corpus.py"
    assert MANIFEST == make_corpus.manifest(list(cases.values()))
    for name, case in cases.items():  # gzip and SQLite bytes may differ between library versions; the rest may not
        if not name.endswith((".gz", ".sqlite")):
            assert (CORPUS / name).read_bytes() == case.data, name


def test_every_corpus_file_through_the_cli(tmp_path: Path) -> None:
    files = sorted(CORPUS / name for name in MANIFEST)
    results = _cli_batch(files, tmp_path)
    for name, expected in MANIFEST.items():
        r = results[name]
        assert r["seconds"] < SECONDS_PER_FILE, f"{name} took {r['seconds']} s"
        if expected["expect"] == "ok":
            assert r["code"] == 0 and r["stderr"] == "", f"{name}: {r['stderr']}"
            if expected["warning"]:
                assert any(expected["warning"] in w for w in r["warnings"]), f"{name}: {r['warnings']}"
        else:
            lines = r["stderr"].splitlines()
            assert r["code"] == 2, f"{name}: exit {r['code']}: {r['stderr']}"
            assert len(lines) == 1 and lines[0].startswith("analyze: error: ") and str(CORPUS / name) in lines[0], name
    assert not list(tmp_path.glob("pwned_*")), "a payload ran"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_error_class(name: str, extensions_registered: None) -> None:
    """The exact AnalyzerError subclass each file ends in (in-process, so the class is visible)."""
    expected = MANIFEST[name]["expect"]
    result = outcome(CORPUS / name)
    if expected == "ok":
        assert isinstance(result, list), result
    elif expected == "error":
        assert isinstance(result, AnalyzerError)
    else:
        assert type(result).__name__ == expected, result


def test_payloads_would_run_under_plain_pickle(tmp_path: Path) -> None:
    """Proof that the code payloads are live: plain pickle.load makes each one's directory (in a scratch folder
    per payload), where the analyzer made nothing."""
    payloads = sorted(name for name, m in MANIFEST.items() if m["creates"])
    families = {name.split(".")[0] for name in payloads}
    assert {"code_global_reduce", "code_stack_global_reduce", "code_inst", "code_obj", "code_newobj_build",
            "code_newobj_ex_build", "code_reduce_build", "code_ext1", "code_ext2", "code_ext4"} <= families
    script = ("import gzip, os, pickle, sys; from make_corpus import register_extensions; register_extensions()\n"
              "for path in sys.argv[1:]:\n"
              "    os.mkdir(os.path.basename(path)); os.chdir(os.path.basename(path))\n"
              "    data = open(path, 'rb').read()\n"
              "    pickle.loads(gzip.decompress(data) if path.endswith('.gz') else data)\n"
              "    os.chdir('..')\n")
    subprocess.run([sys.executable, "-c", script, *(str(CORPUS / n) for n in payloads)], cwd=tmp_path, check=True,
                   timeout=60, env=_env())
    for name in payloads:
        assert [p.name for p in (tmp_path / name).iterdir()] == [MANIFEST[name]["creates"]], name


def test_the_installed_entry_point(tmp_path: Path) -> None:
    """`python -m analyzer.commands.analyze` itself (default HTML report) on a payload, a bomb and deep JSON."""
    for name in ("code_global_reduce.pickle", "bomb_pickle.pickle.gz", "chrome_deep_nesting_in_event.json.gz"):
        out = tmp_path / "report.html"
        run = subprocess.run([sys.executable, "-m", "analyzer", str(CORPUS / name), "-o", str(out)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=60, preexec_fn=_limit_memory,
                             env=_env())
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1 and name in run.stderr, run.stderr
        assert not out.exists() and not list(tmp_path.glob("pwned_*"))


# ---- truncations ------------------------------------------------------------------------------------------------
SNAPSHOT = FIXTURES / "nsys" / "oom_with_nccl.pickle"  # a small snapshot in the torch 2.13 layout (ours)


@pytest.mark.parametrize("protocol", [2, 4])
def test_snapshot_cut_at_every_byte(tmp_path: Path, in_process: None, protocol: int) -> None:
    """Protocol 4 fails at a frame boundary; protocol 2 has no frames, so every opcode is a possible cut."""
    data = pickle.dumps(pickle.loads(SNAPSHOT.read_bytes()), protocol=protocol)
    path = tmp_path / "cut.pickle"
    for n in range(1, len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(CorruptInput, match=str(path)):
            load(path)


def test_gzipped_snapshot_cut_at_every_byte(tmp_path: Path, in_process: None) -> None:
    data = gzip.compress(SNAPSHOT.read_bytes(), mtime=0)
    path = tmp_path / "cut.pickle.gz"
    for n in range(1, len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(AnalyzerError, match=str(path)):
            load(path)


def test_chrome_trace_cut_at_every_byte(tmp_path: Path, in_process: None) -> None:
    data = json.dumps(make_corpus.chrome_trace()).encode()
    path = tmp_path / "cut.json"
    for n in range(1, len(data)):
        path.write_bytes(data[:n])
        result = outcome(path)
        assert isinstance(result, AnalyzerError) or n >= len(data) - 1, n


def test_nsys_export_cut_at_every_page(tmp_path: Path, in_process: None) -> None:
    data = (FIXTURES / "nsys" / "oom_with_nccl.sqlite").read_bytes()
    path = tmp_path / "cut.sqlite"
    for n in [*range(16, len(data), 512), len(data) - 1]:
        path.write_bytes(data[:n])
        assert isinstance(outcome(path), (AnalyzerError, list)), n
