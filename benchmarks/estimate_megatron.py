"""Issue 35: how close `analyze estimate` comes to the peak Megatron-LM's CI measured, beside Megatron's own
estimator (megatron/training/theoretical_memory_usage.py) on the same cases.

Reads benchmarks/calibration/megatron_cases.json (made by benchmarks/megatron_cases.py; the held-out cases are not in
it), estimates each measurement's last pipeline stage (the rank that logs `mem-max-allocated-bytes`), and writes
benchmarks/results/megatron_accuracy.md: the error of every case, then median, 90th percentile and worst |error|
by family and feature. Every case gets an estimate or the reason it has none.

    python benchmarks/estimate_megatron.py [--table ...] [--out ...] [--show]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from analyzer.core.printable import printable
from analyzer.estimate import megatron_reference
from analyzer.estimate.config import Unsupported, from_megatron_args
from analyzer.estimate.device import Device
from analyzer.estimate.training import stages

HERE = Path(__file__).resolve().parent
TABLE = HERE / "calibration" / "megatron_cases.json"
OUT = HERE / "results" / "megatron_accuracy.md"
FAMILIES = ("gpt", "moe", "mixtral")
TRAINING = ("regular", "ckpt-resume", "frozen-resume", "frozen-start", "release")
GiB = 2**30
#: every gpt and moe recipe for A100 and H100 runs a case on one node of 8 GPUs: a case no recipe lists any more
#: is estimated at that size, and counted apart
ASSUMED_GPUS = 8


def measurements(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measurement with its case's arguments (the table keeps them once per case)."""
    return [{**row, "model_args": table["arguments"][row["case"]]} for row in table["cases"]]


def features(c: Any) -> list[str]:
    """The features a case exercises (a case counts under each of its features)."""
    names = []
    for flag, on in (("tp", c.tp > 1), ("pp", c.pp > 1), ("vp", c.vp > 1), ("cp", c.cp > 1), ("ep", c.ep > 1),
                     ("sp", c.sequence_parallel), ("dist-opt", c.distributed_optimizer),
                     ("recompute", c.recompute != "none"), ("unfused-attention", not c.flash_attention),
                     ("gqa", c.groups != c.heads), ("swiglu", c.swiglu), ("untied", c.untied), ("fp16", c.precision == "fp16"),
                     ("fp8", c.fp8)):
        if on:
            names.append(flag)
    return names or ["plain"]


def evaluate(row: dict[str, Any]) -> dict[str, Any]:
    """One measurement: the estimate of its last stage and Megatron's, or the reason there is none."""
    base = {"case": row["case"], "family": row["family"], "platform": row["platform"],
            "environment": row["environment"], "measured": row["measured_peak_allocated_bytes"],
            "source": row["source"]}
    if row["family"] not in FAMILIES:
        return {**base, "reason": f"{row['family']}: only decoder-only GPT and MoE models are modelled"}
    if row["test_type"] not in TRAINING or any(k.startswith(("--inference", "--grpo")) for k in row["model_args"]):
        return {**base, "reason": "an inference or RL test, not a training run"}
    assumed = not row["gpus_per_node"]
    if assumed and (row["platform"] == "dgx_gb200" or "release" in row["case"]):
        return {**base, "reason": "no CI recipe lists the case: GPU count unknown"}
    gpus = ASSUMED_GPUS if assumed else row["nodes"] * row["gpus_per_node"]
    try:
        config = from_megatron_args(row["model_args"], gpus).check()
    except Unsupported as reason:
        return {**base, "reason": str(reason)}
    except Exception as error:   # a configuration check's AnalyzerError: Megatron would refuse it too
        return {**base, "reason": str(error).splitlines()[0]}
    estimate = stages(config, Device(hopper=row["platform"] != "dgx_a100"))
    reference = megatron_reference.estimate(config)
    return {**base, "features": features(config), "moe": config.moe is not None, "gpus_assumed": assumed,
            "estimate": estimate[-1].per_gpu_bytes, "static": estimate[-1].weights + estimate[-1].gradients
            + estimate[-1].optimizer_state + estimate[-1].workspaces, "measured_allocated": row["measured_allocated_bytes"],
            "megatron": reference, "config": config}


def cell(text: str) -> str:
    """A reason as one Markdown table cell: its pipes escaped, control characters written out."""
    return printable(text).replace("|", "\\|")


def error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured


def summary(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float, int]:
    errors = sorted(abs(error(r[key], r["measured"])) for r in rows)
    if not errors:
        return (float("nan"),) * 3 + (0,)   # type: ignore[return-value]
    p90 = errors[min(len(errors) - 1, int(round(0.9 * (len(errors) - 1))))]
    return statistics.median(errors), p90, errors[-1], len(errors)


def render(results: list[dict[str, Any]], commit: str) -> str:
    listed = [r for r in results if "estimate" in r and not r["gpus_assumed"]]
    assumed = [r for r in results if "estimate" in r and r["gpus_assumed"]]
    lines = [f"Megatron-LM functional tests at commit {commit[:12]}: {len(results)} measurements; "
             f"{len(listed)} estimated with the GPU count of the CI recipe that lists the case "
             f"({len({r['case'] for r in listed})} distinct cases), {len(assumed)} more at an assumed "
             f"{ASSUMED_GPUS} GPUs (cases no recipe lists any more: counted apart); held-out cases (SHA-1 of the "
             "name begins with 0-3) are not in the table.",
             "", "| group | measurements | median \\|error\\| | p90 | worst | Megatron's median | Megatron's p90 | Megatron's worst |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in assumed:
        groups[f"{'dense' if not r['moe'] else 'MoE'}, {ASSUMED_GPUS} GPUs assumed"].append(r)
    for r in listed:
        groups["dense" if not r["moe"] else "MoE"].append(r)
        groups[f"family {r['family']}"].append(r)
        for f in r["features"]:
            groups[f"feature {f}"].append(r)
    head = ["dense", "MoE", f"dense, {ASSUMED_GPUS} GPUs assumed", f"MoE, {ASSUMED_GPUS} GPUs assumed"]
    for name in [g for g in head if g in groups] + sorted(g for g in groups if g not in head):
        ours, theirs = summary(groups[name], "estimate"), summary(groups[name], "megatron")
        lines.append(f"| {name} | {ours[3]} | {ours[0]:.1%} | {ours[1]:.1%} | {ours[2]:.1%} | {theirs[0]:.1%} | "
                     f"{theirs[1]:.1%} | {theirs[2]:.1%} |")
    lines += ["", "| case | platform | measured | estimate | error | Megatron's | error |", "|---|---|---|---|---|---|---|"]
    for r in sorted(listed + assumed, key=lambda r: (r["family"], r["case"], r["platform"], r["environment"])):
        lines.append(f"| {r['case']}{' (8 GPUs assumed)' if r['gpus_assumed'] else ''} | {r['environment']} {r['platform']} | {r['measured'] / GiB:.2f} GiB | "
                     f"{r['estimate'] / GiB:.2f} GiB | {error(r['estimate'], r['measured']):+.1%} | "
                     f"{r['megatron'] / GiB:.2f} GiB | {error(r['megatron'], r['measured']):+.1%} |")
    reasons = [r for r in results if "reason" in r]
    lines += ["", "Not estimated:", "", "| case | platform | reason |", "|---|---|---|"]
    for r in sorted(reasons, key=lambda r: (r["family"], r["case"], r["platform"])):
        lines.append(f"| {r['case']} | {r['environment']} {r['platform']} | {cell(r['reason'])} |")
    return "\n".join(lines) + "\n"


WORLD_SIZES = (64, 128)


def unknown_world(rows: list[dict[str, Any]]) -> list[str]:
    """The real-size cases no recipe gives a GPU count for, estimated at plausible world sizes: not counted in
    the error, shown as a check of the formulas at scale (DP changes the distributed optimizer's shard and the
    micro-batches in flight only)."""
    lines = ["", f"Real-size cases with no GPU count (not counted above): the last stage's estimate at "
                 f"{' and '.join(map(str, WORLD_SIZES))} GPUs.", "",
             "| case | platform | measured | " + " | ".join(f"at {g} GPUs" for g in WORLD_SIZES) + " |",
             "|---|---|---|" + "---|" * len(WORLD_SIZES)]
    for row in rows:
        if "release" not in row["case"] or row["gpus_per_node"] or row["family"] not in FAMILIES:
            continue
        cells = []
        for gpus in WORLD_SIZES:
            try:
                config = from_megatron_args(row["model_args"], gpus).check()
            except Exception as reason:   # Unsupported, or a layout this many GPUs cannot hold
                cells.append(cell(str(reason).splitlines()[0]))
                continue
            cells.append(f"{stages(config, Device(hopper=row['platform'] != 'dgx_a100'))[-1].per_gpu_bytes / GiB:.1f} GiB")
        lines.append(f"| {row['case']} | {row['environment']} {row['platform']} | "
                     f"{row['measured_peak_allocated_bytes'] / GiB:.1f} GiB | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--show", action="store_true", help="print each estimated case's error")
    args = parser.parse_args()
    table = json.loads(args.table.read_text())
    rows = measurements(table)
    results = [evaluate(row) for row in rows]
    if args.show:
        for r in results:
            if "estimate" in r:
                print(f"{error(r['estimate'], r['measured']):+7.1%} {error(r['megatron'], r['measured']):+7.1%} "
                      f"static {r['static'] / GiB:6.2f} alloc {(r['measured_allocated'] or 0) / GiB:6.2f} "
                      f"peak {r['measured'] / GiB:6.2f} {r['case']} {r['platform']}")
    args.out.write_text("# Megatron-LM functional tests: estimate against measured peak\n\n"
                        + render(results, table["commit"]) + "\n".join(unknown_world(rows)) + "\n")
    print(render(results, table["commit"]).split("\n\n")[1])


if __name__ == "__main__":
    main()
