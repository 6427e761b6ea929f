"""Golden JSON: every input's `analyze --format json` output, pinned so that a refactor provably changes nothing.

    python tests/support/golden.py --update     # after a change of behaviour made on purpose; review the diff

Our own fixtures are pinned as whole (canonical) documents, so a diff shows what changed. The recordings in
../shared/real are pinned as one digest per field (some have no licence: nothing taken from them is stored
here), so a failure still names the fields that moved.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT.parent / "shared" / "real"
FIXTURES = ROOT / "fixtures" / "traces"
GOLDEN = ROOT / "tests" / "golden"
_NOT_INPUTS = (".md", ".truth.json")
_REAL_SETS = ("kineto-tb_plugin/resnet50_num_workers_0",)   # a folder of traces, read as one input
_PLACEHOLDER = "<input>"
_FOLDER = "<input folder>"


@dataclass(frozen=True)
class Case:
    """One `analyze` invocation: the input (and companion) as given on the command line, and where it comes from."""

    name: str
    argv: tuple[str, ...]
    real: bool


def cases() -> list[Case]:
    """Every fixture and every real recording (each file, and the folders read as one input)."""
    out = []
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file() and not p.name.endswith(_NOT_INPUTS)):
        out.append(Case(str(path.relative_to(FIXTURES)), (str(path),), real=False))
    nsys = FIXTURES / "nsys"
    out.append(Case("nsys/oom_with_nccl.pickle+sqlite",
                    (str(nsys / "oom_with_nccl.pickle"), str(nsys / "oom_with_nccl.sqlite")), real=False))
    if REAL.is_dir():
        files = sorted(p for p in REAL.rglob("*") if p.is_file() and not p.name.endswith(_NOT_INPUTS)
                       and p.name != "truth.json")
        out += [Case(str(p.relative_to(REAL)), (str(p),), real=True) for p in files]
        out += [Case(name + "/", (str(REAL / name),), real=True) for name in _REAL_SETS]
    return out


def run(case: Case) -> dict[str, Any]:
    """The exit code, the error line (if any) and the JSON document of one case, in canonical form."""
    from analyzer.commands import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "analysis.json"
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main([*case.argv, "--format", "json", "-o", str(out), "-q"])
        text = out.read_text(encoding="utf-8") if out.exists() else "null"
    for arg in case.argv:  # the paths depend on where the checkout is
        text = text.replace(json.dumps(arg)[1:-1], _PLACEHOLDER)
    error = stderr.getvalue().strip()
    for arg in case.argv:  # the input, and files the message names beside it (an export to run first)
        error = error.replace(arg, _PLACEHOLDER).replace(str(Path(arg).parent), _FOLDER)
    return {"exit_code": code, "error": error or None, "json": _canonical(json.loads(text))}


def _canonical(value: Any) -> Any:
    """Floats to 10 significant digits: the last bits of a float are not behaviour."""
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def pinned(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    """What is stored for a case: the whole result for a fixture, digests by field for a real recording."""
    return _digests(result) if case.real else result


def _digests(value: Any, path: str = "", depth: int = 0) -> dict[str, Any]:
    """'json.devices[0].peak.by_category' -> sha256 of its canonical JSON, down to five levels."""
    if depth < 5 and isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_digests(item, f"{path}.{key}" if path else str(key), depth + 1))
        return out
    if depth < 5 and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(_digests(item, f"{path}[{i}]", depth + 1))
        return out
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {path: hashlib.sha256(text.encode()).hexdigest()[:16]}


def golden_path(case: Case) -> Path:
    folder = "real" if case.real else "fixtures"
    return GOLDEN / folder / (case.name.replace("/", "__").rstrip("_") + ".json")


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """The fields whose values differ (top levels of the document), for a readable failure."""
    flat_expected, flat_actual = _digests(expected), _digests(actual)
    keys = sorted(set(flat_expected) | set(flat_actual))
    return [k for k in keys if flat_expected.get(k) != flat_actual.get(k)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the golden files from the current code")
    args = parser.parse_args(argv)
    changed = 0
    for case in cases():
        stored = pinned(case, run(case))
        path = golden_path(case)
        old = json.loads(path.read_text()) if path.exists() else None
        if old != stored:
            changed += 1
            fields = "new" if old is None else ", ".join(differences(old, stored)[:10])
            print(f"{'updated' if args.update else 'differs'}: {case.name}: {fields}")
            if args.update:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{changed} of {len(cases())} cases {'updated' if args.update else 'differ'}")
    return 1 if changed and not args.update else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
