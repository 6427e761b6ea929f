"""Issue 21 item 3: how close do `analyze estimate`'s formulas come to what recordings show, category by category?

Simulated runs: the built-in scenarios, the remedy runs' GPT configurations (written-out and fused attention,
full checkpointing, ZeRO-1/2 as rank 0 of 4, 2 x half accumulation, 8-bit Adam) and the zoo (transformers
models; model states only: their blocks are not the GPT layer the activation formula describes), each traced
fresh, its truth at the peak from the sidecar and its attribution from `analyze`. Real recordings: those whose
`shared/real/truth.json` entry gives the parameter count, dtype and workload (model states only: truth.json
gives no transformer shape). The estimate is `analyzer.evaluate.estimator_fidelity.estimate` of the workload read
off the code (simulated) or stated by truth.json (real).

`--before COMMIT` adds the formulas of `analyzer/diagnose/theory.py` at that commit, as `analyze estimate`
applied them (mixed-precision Adam 16Ψ split 2/2/12, activations at 2 bytes a value, model states plus
activations), and the fixes one at a time on the way from there.

    python benchmarks/estimator_fidelity.py [--before 694cd9e] [--cache /tmp/fidelity.json] [--out ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from analyzer.core.units import human_bytes
from analyzer.core.vocabulary import RemedyId
from analyzer.evaluate import estimator_fidelity as fidelity
from analyzer.evaluate.estimator_fidelity import (
    ACTIVATION,
    CATEGORIES,
    GRADIENT,
    OPTIMIZER,
    PARAMETER,
    TOTAL,
    Row,
    Workload,
)
from analyzer.evaluate.real_truth import load_truth

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "real"
RESULTS = Path(__file__).resolve().parent / "results" / "estimator_fidelity.md"
LEAKING = ("leak", "activation_cache")
LLMEM = 0.016      # LLMem's reported error of the peak on one GPU (Kim et al., IJCAI 2024)
VARIANTS = ("as is", RemedyId.ACTIVATION_CHECKPOINTING, RemedyId.ZERO1, RemedyId.ZERO2, RemedyId.GRADIENT_ACCUMULATION,
            RemedyId.OPTIMIZER_8BIT)

Estimator = Callable[[Workload], dict[str, float | None]]


class Case(NamedTuple):
    name: str
    run: Callable[[Path], Any]          # simulate into a snapshot path
    workload: Callable[[], Workload]
    leak: bool                          # the scenario keeps memory across steps on purpose


def simulated_cases() -> list[Case]:
    """Every simulated run of the benchmark."""
    from analyzer.simulate.gpt import GPTConfig
    from analyzer.simulate.remedy_runs import REMEDY_RUNS, STEPS, RemedySetup, simulate
    from analyzer.simulate.scenarios import ALL_SCENARIOS, generate

    cases = []
    for name, scenario in ALL_SCENARIOS.items():
        cases.append(Case(name, partial(generate, name),
                          partial(_scenario_workload, name, scenario.loop, scenario.steps), name in LEAKING))
    bases = [RemedySetup("eager d768 L6 s1024 b8", GPTConfig(d_model=768, layers=6, heads=12, max_seq=1024), 8, 1024),
             RemedySetup("eager d512 L4 s2048 b4", GPTConfig(d_model=512, layers=4, heads=8, max_seq=2048), 4, 2048),
             RemedySetup("sdpa d768 L6 s1024 b8", GPTConfig(d_model=768, layers=6, heads=12, max_seq=1024), 8, 1024,
                         fused_attention=True),
             RemedySetup("sdpa d1024 L12 s2048 b4", GPTConfig(d_model=1024, layers=12, heads=16, max_seq=2048), 4,
                         2048, fused_attention=True),
             RemedySetup("states d2048 L8 s256 b2", GPTConfig(d_model=2048, layers=8, heads=16, max_seq=256), 2, 256),
             RemedySetup("eager d256 L4 s1024 b2 v1024", GPTConfig(vocab=1024, d_model=256, layers=4, heads=4,
                                                                 max_seq=1024), 2, 1024)]
    for base in bases:
        for variant in VARIANTS:
            setup = base if variant == "as is" else REMEDY_RUNS[variant](base)
            name = f"{base.name}, {variant}"
            cases.append(Case(name, partial(simulate, setup),
                              partial(fidelity.workload_of, name, setup.loop(), STEPS, setup.zero_stage, setup.shards,
                                      "simulate/remedy_runs.py"), False))
    return cases


def _scenario_workload(name: str, loop: Callable[[], Any], steps: int) -> Workload:
    return fidelity.workload_of(name, loop(), steps, source=f"simulate/scenarios.py:{name}")


def measure(cache: Path | None) -> dict[str, Any]:
    """Truth and attribution at the peak of every simulated run, traced fresh (or read from `cache`)."""
    found: dict[str, Any] = json.loads(cache.read_text()) if cache and cache.exists() else {}
    with tempfile.TemporaryDirectory() as folder:
        for name, run, _, leak in simulated_cases():
            if name in found:
                continue
            out = Path(folder) / "run.pickle"
            run(out)
            truth, attributed, peak = fidelity.measure_simulated(out)
            sidecar = json.loads(out.with_name("run.truth.json").read_text())
            found[name] = {"truth": truth, "analysis": attributed, "peak": peak,
                           "modelled": fidelity.unmodelled(sidecar, leak)}
            print(f"  measured {name}", file=sys.stderr)
            if cache:
                cache.write_text(json.dumps(found))
    for name, truth in load_truth(REAL).items():
        if f"real:{name}" not in found and fidelity.real_workload(name, truth) is not None:
            found[f"real:{name}"] = {"truth": fidelity.real_truth(truth), "peak": truth.get("peak_bytes_file")
                                     if isinstance(truth.get("peak_bytes_file"), int) else None,
                                     "analysis": _real_attribution(name, truth), "modelled": ""}
            print(f"  measured {name}", file=sys.stderr)
            if cache:
                cache.write_text(json.dumps(found))
    return found


def _real_attribution(name: str, truth: dict[str, Any]) -> dict[str, int | None]:
    from analyzer.evaluate.real_truth import checks

    by: dict[str, int] = {}
    for check in checks(REAL, name, truth):            # one per device the truth names: their sum
        by[check.category] = by.get(check.category, 0) + check.measured_bytes
    return {PARAMETER: by.get(PARAMETER), GRADIENT: by.get(GRADIENT), OPTIMIZER: by.get(OPTIMIZER),
            ACTIVATION: None, TOTAL: None}


def workloads() -> dict[str, Workload]:
    out = {name: workload() for name, _, workload, _ in simulated_cases()}
    for name, truth in load_truth(REAL).items():
        w = fidelity.real_workload(name, truth)
        if w is not None:
            out[f"real:{name}"] = replace(w, name=f"real:{name}")
    return out


def rows(measured: dict[str, Any], ws: dict[str, Workload], estimator: Estimator) -> list[Row]:
    return [fidelity.compare(ws[name], m["truth"], m["analysis"], m["peak"],
                             m["modelled"], estimator)
            for name, m in measured.items() if name in ws]


# ---- the formulas before, and the fixes one at a time ------------------------------------------------------------
def old_theory(commit: str) -> types.ModuleType:
    """analyzer/diagnose/theory.py as it was at `commit`, as a module."""
    source = subprocess.run(["git", "show", f"{commit}:analyzer/diagnose/theory.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("theory_before")
    sys.modules[module.__name__] = module       # dataclasses look their module up
    exec(compile(source, "theory_before.py", "exec"), module.__dict__)   # our own file, from our own history
    return module


def before_estimator(old: types.ModuleType) -> Estimator:
    """What `analyze estimate` computed with the old formulas: mixed-precision Adam's 16Ψ (2Ψ weights, 2Ψ
    gradients, 12Ψ optimizer, as its docstring splits it), activations at 2 bytes a value, their sum."""
    def estimate(w: Workload) -> dict[str, float | None]:
        psi, n = w.params, w.gpus
        states = {PARAMETER: 2 * psi / (n if w.zero >= 3 else 1), GRADIENT: 2 * psi / (n if w.zero >= 2 else 1),
                  OPTIMIZER: 12 * psi / (n if w.zero >= 1 else 1)}
        assert abs(sum(states.values()) - old.model_states_bytes(psi, w.zero, n)) < 1
        s = w.shape
        if s is None:
            return {**states, ACTIVATION: None, TOTAL: None}
        acts = old.activation_bytes(s.layers, s.micro_batch, s.seq, s.hidden, s.heads, checkpointing=s.checkpointing,
                                    flash_attention=s.flash)
        return {**states, ACTIVATION: acts, TOTAL: sum(states.values()) + acts}
    return estimate


#: the fixes, in the order applied: (name, the workload as the estimator saw it before this fix, its terms)
FIXES: list[tuple[str, Callable[[Workload], Workload], dict[str, bool]]] = [
    ("fused attention keeps its fp32 logsumexp (Dao et al. 2022, §3.1)",
     lambda w: _paper_defaults(w), {"output_layer": False, "peak": False}),
    ("model states of the precision regime and optimizer (ZeRO §3.1: 16Ψ / 12Ψ / 8Ψ; trainable only)",
     lambda w: replace(_paper_defaults(w), precision=w.precision, optimizer=w.optimizer, trainable=w.trainable,
                       training=w.training), {"output_layer": False, "peak": False}),
    ("activations in the model's dtype (fp32: 4 bytes a value, masks 1)",
     lambda w: replace(w, shape=None if w.shape is None else replace(w.shape, dropout=True)),
     {"output_layer": False, "peak": False}),
    ("no dropout: no masks, no dropout output (Korthikanti et al. §4.1, the dropout terms taken out)",
     lambda w: w, {"output_layer": False, "peak": False}),
    ("final norm, fp32 log-probabilities (Korthikanti et al. §4, total activations) and cross-entropy's backward temporaries",
     lambda w: w, {"output_layer": True, "peak": False}),
    ("the peak is one moment (start of backward, recompute, optimizer step), not every state plus every activation",
     lambda w: w, {"output_layer": True, "peak": True, "inside_layers": False}),
    ("the moments inside written-out attention's backward (its s x s gradients)",
     lambda w: w, {"output_layer": True, "peak": True, "inside_layers": True}),
]


def _paper_defaults(w: Workload) -> Workload:
    """The workload as the old estimator read it: mixed-precision Adam on every parameter, 16-bit activations,
    Korthikanti's dropout."""
    return replace(w, precision="mixed", optimizer="adam", trainable=w.params, training=True, bytes_per_value=2,
                   foreach=False, shape=None if w.shape is None else replace(w.shape, dropout=True))


def fix_estimator(see: Callable[[Workload], Workload], terms: dict[str, bool]) -> Estimator:
    return lambda w: fidelity.estimate(see(w), **terms)


# ---- tables ---------------------------------------------------------------------------------------------------
def _gib(value: float | int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def _err(row: Row, category: str) -> str:
    error = row.error(category)
    if error is not None:
        return f"{error:+.1%}"
    miss = row.empty_miss(category)
    return "-" if miss is None else ("0 ✓" if not miss else f"0 ✗ ({human_bytes(int(row.estimate[category] or 0))})")


def table(found: list[Row]) -> str:
    head = ["run", *(f"{c} est / truth / ours GiB" for c in CATEGORIES), *(f"{c} error" for c in CATEGORIES)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in found:
        cells = [f"{r.workload.name}{' (not modelled: ' + r.modelled + ')' if r.modelled else ''}"]
        cells += [f"{_gib(r.estimate.get(c))} / {_gib(r.truth.get(c))} / {_gib(r.analysis.get(c))}" for c in CATEGORIES]
        cells += [_err(r, c) for c in CATEGORIES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def error_table(found: list[Row]) -> str:
    """The error of each category per run, with the total's estimate and truth: the table the docs publish."""
    lines = ["| run | total est / truth GiB | " + " | ".join(CATEGORIES) + " |", "|---|---:|" + "---:|" * len(CATEGORIES)]
    for r in found:
        note = f" (not modelled: {r.modelled})" if r.modelled else ""
        lines.append(f"| {r.workload.name}{note} | {_gib(r.estimate.get(TOTAL))} / {_gib(r.truth.get(TOTAL))} | "
                     + " | ".join(_err(r, c) for c in CATEGORIES) + " |")
    return "\n".join(lines)


def headline(found: list[Row]) -> str:
    def cell(s: dict[str, Any]) -> str:
        if not s["scored"] and not s["empty"]:
            return "-"
        text = f"{s['median']:.1%} / {s['max']:.1%} ({s['scored']})" if s["scored"] else ""
        if s["empty"]:
            text += f"{'; ' if text else ''}empty {s['empty'] - s['empty_missed']}/{s['empty']}"
        return text
    groups = {"simulated GPT": [r for r in found if r.workload.shape is not None],
              "simulated zoo (states)": [r for r in found if r.workload.shape is None and not r.workload.name.startswith("real:")],
              "real (states)": [r for r in found if r.workload.name.startswith("real:")]}
    lines = ["| runs | " + " | ".join(CATEGORIES) + " |", "|---|" + "---:|" * len(CATEGORIES)]
    for label, group in groups.items():
        s = fidelity.summary(group)
        lines.append(f"| {label} | " + " | ".join(cell(s[c]) for c in CATEGORIES) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cache", type=Path, help="keep the measurements here (and reuse them)")
    parser.add_argument("--before", help="a commit whose theory.py to compare with, fix by fix")
    args = parser.parse_args()
    measured = measure(args.cache)
    ws = workloads()
    after = rows(measured, ws, fidelity.estimate)
    text = ["# Estimator fidelity (benchmarks/estimator_fidelity.py)", "",
            "Median / largest absolute error per category (rows scored); `empty k/n`: of n runs where the truth "
            "has none of the category, k estimates put under 1% of the peak there. Runs whose peak the formulas do "
            "not model (out of memory, saving, a leak) are in the table, not the headline.", "", headline(after), ""]
    if args.before:
        text += [f"## Fix by fix, from the formulas at {args.before}", "", "### before", "",
                 headline(rows(measured, ws, before_estimator(old_theory(args.before)))), ""]
        for title, see, terms in FIXES:
            text += [f"### + {title}", "", headline(rows(measured, ws, fix_estimator(see, terms))), ""]
    within = [r for r in after if r.workload.shape is not None and not r.modelled]
    close = sum(abs(r.error(TOTAL) or 0) <= LLMEM for r in within)
    text += [f"Simulated GPT runs whose total is within LLMem's {LLMEM:.1%}: {close} of {len(within)}.", "",
             "## Error per run", "", error_table(after), "",
             "## Every run", "", "est: the estimate; truth: the simulator's sidecar or truth.json; ours: what the "
             "analysis attributes at the peak.", "", table(after), ""]
    args.out.write_text("\n".join(text), encoding="utf-8")
    print("\n".join(text))


if __name__ == "__main__":
    main()
