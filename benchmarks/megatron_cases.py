"""Issue 35: the table of Megatron-LM functional-test runs (arguments → measured peak) the estimator is checked on.

NVIDIA Megatron-LM publishes, for each functional test case, its full arguments
(`tests/functional_tests/test_cases/<family>/<case>/model_config.yaml`, `MODEL_ARGS:`) and the values its CI
measured per step (`golden_values_<environment>_<platform>.json` beside it), among them `mem-max-allocated-bytes`
(`torch.cuda.memory_stats()["allocated_bytes.all.peak"]`, logged by the last global rank, never reset: the peak so
far) and `mem-allocated-bytes` (allocated at the log). The GPU count is the recipe's (`tests/test_utils/recipes/
<platform>/*.yaml` lists the case under a `spec` with `nodes` and `gpus`).

Held out: the cases whose directory name's SHA-1 begins with 0, 1, 2 or 3 are filtered out by name here, before
any golden value is read, and never opened: they are kept for an independent check of the estimator.

This reads a bare git mirror of Megatron-LM (the `fetch` tool's copy) with `git ls-tree`/`git show` and writes
facts only (arguments, measured bytes, source path and commit) to benchmarks/calibration/megatron_cases.json:

    python benchmarks/megatron_cases.py [--mirror /work/.mirror/NVIDIA+Megatron-LM/repo] [--out ...]

For the independent check only, `--held-out --out OTHER.json` builds the table of the held-out cases instead
(never written to the default path, never run while calibrating); `benchmarks/estimate_megatron.py --table
OTHER.json --out ...` then scores the estimator on them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
OUT = Path(__file__).resolve().parent / "calibration" / "megatron_cases.json"
CASES = "tests/functional_tests/test_cases"
RECIPES = "tests/test_utils/recipes"
HELD_OUT_PREFIXES = "0123"
GOLDEN = re.compile(r"golden_values_(?P<environment>dev|lts)_(?P<platform>dgx_a100|dgx_h100|dgx_gb200)\.json$")
RECIPE_DIR = {"dgx_a100": "h100", "dgx_h100": "h100", "dgx_gb200": "gb200"}   # a100 runs use the h100 recipes


def held_out(case: str) -> bool:
    """Kept for an independent check: never read, never calibrated on."""
    return hashlib.sha1(case.encode()).hexdigest()[0] in HELD_OUT_PREFIXES


def git(mirror: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror), *args], check=True, capture_output=True,
                          text=True).stdout


def recipes(mirror: Path, commit: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(recipe folder, case) → the recipe's path, nodes and gpus."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in git(mirror, "ls-tree", "-r", "--name-only", commit, RECIPES).split():
        if not path.endswith(".yaml"):
            continue
        recipe = yaml.safe_load(git(mirror, "show", f"{commit}:{path}"))
        spec = recipe.get("spec", {}) if isinstance(recipe, dict) else {}
        if not {"nodes", "gpus"} <= set(spec):
            continue
        folder = path.split("/")[3]
        for product in recipe.get("products", []) or []:
            names = product.get("test_case", [])
            for name in names if isinstance(names, list) else [names]:
                found.setdefault((folder, name), {"recipe": path, "nodes": spec["nodes"], "gpus": spec["gpus"]})
    return found


def series_max(golden: dict[str, Any], key: str) -> float | None:
    series = golden.get(key)
    values = ([v for v in series.get("values", {}).values() if isinstance(v, (int, float))]
              if isinstance(series, dict) else [])
    return max(values) if values else None


def build(mirror: Path, held_out_only: bool = False) -> dict[str, Any]:
    commit = git(mirror, "rev-parse", "HEAD").strip()
    files: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in git(mirror, "ls-tree", "-r", "--name-only", commit, CASES).split():
        parts = path.split("/")
        if len(parts) == 6:
            files[(parts[3], parts[4])].append(parts[5])
    kept = {key: names for key, names in files.items() if held_out(key[1]) == held_out_only}   # before any read
    where = recipes(mirror, commit)
    rows, arguments = [], {}
    for (family, case), names in sorted(kept.items()):
        if "model_config.yaml" not in names:
            continue
        base = f"{CASES}/{family}/{case}"
        config = yaml.safe_load(git(mirror, "show", f"{commit}:{base}/model_config.yaml")) or {}
        arguments[case] = config.get("MODEL_ARGS") or {}
        for name in sorted(names):
            match = GOLDEN.match(name)
            if not match:
                continue
            try:
                golden = json.loads(git(mirror, "show", f"{commit}:{base}/{name}"))
            except json.JSONDecodeError:   # an empty file in the repository
                continue
            peak = series_max(golden, "mem-max-allocated-bytes")
            if peak is None:
                continue
            recipe = where.get((RECIPE_DIR[match["platform"]], case))
            rows.append({
                "family": family, "case": case, "environment": match["environment"], "platform": match["platform"],
                "source": f"{base}/{name}", "config": f"{base}/model_config.yaml",
                "recipe": recipe["recipe"] if recipe else None,
                "nodes": recipe["nodes"] if recipe else None, "gpus_per_node": recipe["gpus"] if recipe else None,
                "test_type": config.get("TEST_TYPE"),
                "measured_peak_allocated_bytes": int(peak),
                "measured_allocated_bytes": (None if series_max(golden, "mem-allocated-bytes") is None
                                             else int(series_max(golden, "mem-allocated-bytes") or 0)),
            })
    return {"repository": "https://github.com/NVIDIA/Megatron-LM", "commit": commit,
            "held_out": (f"only the case directories whose name's SHA-1 begins with one of {HELD_OUT_PREFIXES}"
                         if held_out_only else
                         f"case directories whose name's SHA-1 begins with one of {HELD_OUT_PREFIXES}: not read"),
            "measurement": "mem-max-allocated-bytes: torch.cuda.memory_stats()['allocated_bytes.all.peak'] on the "
                           "last global rank, the largest value over the logged steps",
            "arguments": {case: arguments[case] for case in sorted({row["case"] for row in rows})}, "cases": rows}


def dump(table: dict[str, Any]) -> str:
    """The table as JSON with one line per case's arguments and per measurement (small, and diffs by line)."""
    head = {k: v for k, v in table.items() if k not in ("arguments", "cases")}
    arguments = ",\n".join(f"  {json.dumps(case)}: {json.dumps(args, sort_keys=True)}"
                            for case, args in table["arguments"].items())
    cases = ",\n".join(f"  {json.dumps(row, sort_keys=True)}" for row in table["cases"])
    return (json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "arguments": {\n' + arguments + '\n },\n'
            ' "cases": [\n' + cases + "\n ]\n}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=MIRROR)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--held-out", action="store_true", help="the held-out cases only, for the independent check")
    args = parser.parse_args()
    if args.held_out and args.out.resolve() == OUT.resolve():
        parser.error("--held-out needs its own --out: the calibration table never holds the held-out cases")
    table = build(args.mirror, args.held_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(table))
    print(f"{len(table['cases'])} measurements of {len({r['case'] for r in table['cases']})} cases -> {args.out}")


if __name__ == "__main__":
    main()
