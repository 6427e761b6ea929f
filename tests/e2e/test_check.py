"""`analyze check`: real recordings against themselves and against budgets around their own peak, simulated
runs one known change apart (each failure names that change), every input kind a baseline can be, GitHub
Actions output, and bad input (one line, exit code 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.commands import main
from support.paths import REAL

GiB = 2**30
SMALL_REAL = REAL / "shreyansh26-mlsys-experiments" / "profile_grad.pkl"   # 22 KB, a plan at 90% of its peak
KINETO_REAL = REAL / "tracelens" / "gaunernst_bert-small-uncased__1016001.json.gz"
FIT_HEADROOM = 0.95


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def check_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code, out, _ = check(capsys, *args, "--format", "json")
    return code, json.loads(out)


def needs_real(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} is absent (the real recordings live in ../shared/real)")


# ---- real recordings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [SMALL_REAL, KINETO_REAL], ids=["snapshot", "kineto"])
def test_a_real_recording_holds_against_itself(capsys, path):
    needs_real(path)
    code, doc = check_json(capsys, path, "--baseline", path)
    assert code == 0 and doc["holds"] and doc["exit_code"] == 0
    for d in doc["devices"]:
        assert d["needed_bytes"] == d["baseline_bytes"] > 0 and d["categories"] == [] and d["likely"] == []


def test_a_real_recording_at_its_peak_holds_and_a_byte_under_fails_with_the_plan_for_that_budget(capsys):
    needs_real(SMALL_REAL)
    from analyzer.pipeline import analyze

    needed = analyze(SMALL_REAL).devices[0].diagnosis.demand_bytes
    assert check(capsys, SMALL_REAL, "--budget", str(needed))[0] == 0
    budget = int(needed * 0.9)
    code, out, _ = check(capsys, SMALL_REAL, "--budget", str(budget))
    assert code == 1
    expected = analyze(SMALL_REAL, budget).devices[0].diagnosis.plan   # the plan made for this budget
    assert expected is not None and expected["fits"]
    first = expected["steps"][0]
    assert first["predicted_peak_allocated_bytes"] <= FIT_HEADROOM * budget
    assert f"cheapest fix that brings it under: {first['title']}" in out
    assert f"over its budget: needs {needed / GiB:.2f} GiB" in out
    code, doc = check_json(capsys, SMALL_REAL, "--budget", str(budget))
    fix = doc["devices"][0]["fix"]
    assert fix["source"] == "plan" and [s["id"] for s in fix["steps"]] == [s["remedy"] for s in expected["steps"]]


def test_a_baseline_file_is_small_versioned_and_sums_to_its_peaks(capsys, tmp_path):
    needs_real(KINETO_REAL)
    out = tmp_path / "baseline.json"
    assert check(capsys, KINETO_REAL, "--write-baseline", out)[0] == 0
    document = json.loads(out.read_text())
    assert document["schema"] == "analyzer-baseline/1" and out.stat().st_size < 64 * 1024
    assert document["devices"] and all(d["device"] >= 0 for d in document["devices"])   # GPUs, not host memory
    for d in document["devices"]:
        for split in ("by_category", "by_phase", "by_module"):
            assert sum(d[split].values()) == d["peak_bytes"], split
        assert "events" not in d and d["steps"]
    # the baseline says what the recording says
    code, from_file = check_json(capsys, KINETO_REAL, "--baseline", out)
    _, from_run = check_json(capsys, KINETO_REAL, "--baseline", KINETO_REAL)
    assert code == 0
    assert [d["baseline_bytes"] for d in from_file["devices"]] == [d["baseline_bytes"] for d in from_run["devices"]]


def test_an_earlier_json_result_is_a_baseline_and_a_run(capsys, tmp_path):
    needs_real(SMALL_REAL)
    result = tmp_path / "result.json"
    assert main([str(SMALL_REAL), "--format", "json", "-o", str(result), "-q"]) == 0
    capsys.readouterr()
    code, doc = check_json(capsys, SMALL_REAL, "--baseline", result)
    assert code == 0 and doc["baseline_kind"] == "analysis"
    code, doc = check_json(capsys, result, "--budget", "1GiB")
    assert code == 1 and doc["devices"][0]["needed_bytes"] == json.loads(result.read_text())["devices"][0]["demand_bytes"]


def golden_values(path: Path, values: dict[str, object]) -> Path:
    """A golden-values file in Megatron-LM's layout (tests/functional_tests/test_cases/*/*/golden_values_*.json:
    metric -> start_step, end_step, step_interval, values by step), numbers made here."""
    steps = [int(s) for s in values]
    metric = {"start_step": min(steps), "end_step": max(steps), "step_interval": 1, "values": values}
    path.write_text(json.dumps({"lm loss": {**metric, "values": {s: 10.0 for s in values}},
                                "mem-max-allocated-bytes": metric}, indent=4))
    return path


def test_megatron_golden_values_are_a_baseline_within_its_tolerance(capsys, tmp_path):
    needs_real(SMALL_REAL)
    from analyzer.pipeline import analyze

    needed = analyze(SMALL_REAL).devices[0].diagnosis.demand_bytes
    at = needed / 1.05   # the run is exactly 5% above it: holds; one more percent below it fails
    golden = golden_values(tmp_path / "golden_values_dev_dgx_h100.json",
                           {"1": float(int(at) - GiB), "2": float(int(at) + 1), "3": "nan"})
    code, doc = check_json(capsys, SMALL_REAL, "--baseline", golden)
    assert code == 0 and doc["baseline_kind"] == "megatron" and doc["devices"][0]["baseline_bytes"] == int(at) + 1
    golden_values(golden, {"1": float(int(needed / 1.06)), "2": "nan"})
    code, out, _ = check(capsys, SMALL_REAL, "--baseline", golden)
    assert code == 1
    assert "the baseline (megatron) has the peak but not its breakdowns" in out
    assert "new findings" not in out   # golden values have none to compare with


# ---- logs ----------------------------------------------------------------------------------------------------------
LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "logs"


def test_a_log_with_an_oom_is_gated_on_what_the_oom_needed(capsys):
    """lerf#73: 12.09 GiB allocated by PyTorch and 3.00 GiB asked for: the step needed 15.09 GiB."""
    log = LOGS / "ofwhich_fragmentation_lerf_73.log"
    code, doc = check_json(capsys, log, "--budget", "15.09GiB")
    assert code == 0 and doc["devices"][0]["needed_bytes"] == round(12.09 * GiB) + 3 * GiB
    code, out, _ = check(capsys, log, "--budget", "15GiB")
    assert code == 1 and "at the OOM" in out and "expandable segments" in out.lower()


def test_a_log_of_memory_lines_is_gated_on_their_largest_allocated_peak(capsys, tmp_path):
    """DeepSpeed's see_memory_usage: Max_MA 4.89 then 5.31 (GiB, printed as GB); a baseline of the same log
    holds, one of a smaller peak does not."""
    log = LOGS / "deepspeed_see_memory_usage_522.log"
    code, doc = check_json(capsys, log, "--budget", "6GiB")
    assert code == 0 and doc["devices"][0]["needed_bytes"] == round(5.31 * GiB)
    assert check(capsys, log, "--baseline", log)[0] == 0
    smaller = tmp_path / "smaller.log"
    smaller.write_text(log.read_text().replace("Max_MA 5.31 GB", "Max_MA 4.99 GB"))
    assert check(capsys, log, "--baseline", smaller)[0] == 1


def test_a_log_with_only_nvidia_smi_gates_nothing(capsys):
    """nvidia-smi's used memory is the process's, not PyTorch's allocations: nothing to gate, exit 2."""
    code, _, err = check(capsys, LOGS / "nvidia_smi_screen_pytorch_5434.log", "--budget", "16GiB")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nvidia-smi" in err


# ---- simulated runs one change apart ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small GPT trained 4 steps (FakeTensorMode), and runs of it with one change each."""
    pytest.importorskip("torch")
    from analyzer.simulate.allocator import AllocatorSettings
    from analyzer.simulate.gpt import GPTConfig
    from analyzer.simulate.runner import simulate_to_files, trace_training
    from analyzer.simulate.scenarios import LossLogger, gpt_loop

    folder = tmp_path_factory.mktemp("pairs")
    config = GPTConfig(d_model=512, layers=4, heads=8, max_seq=1024)
    deeper = GPTConfig(d_model=512, layers=5, heads=8, max_seq=1024)
    runs = {"base": gpt_loop(config, batch=4, seq_lens=[512]),
            "longer_sequence": gpt_loop(config, batch=4, seq_lens=[1024]),
            "larger_batch": gpt_loop(config, batch=8, seq_lens=[512]),
            "one_layer_deeper": gpt_loop(deeper, batch=4, seq_lens=[512]),
            "leak": gpt_loop(config, batch=4, seq_lens=[512], loss_fn=LossLogger(leaky=True))}
    paths = {}
    for name, loop in runs.items():
        paths[name] = folder / f"{name}.pickle"
        simulate_to_files(trace_training(loop, 4, fake=True), paths[name], 24 * GiB, AllocatorSettings(),
                          scenario=name)
    paths["baseline"] = folder / "base.baseline.json"
    assert main(["check", str(paths["base"]), "--write-baseline", str(paths["baseline"])]) == 0
    return paths


@pytest.mark.parametrize("change, cause, says", [
    ("longer_sequence", "sequence", "likely change: a longer sequence (inputs x2.00"),
    ("larger_batch", "inputs", "likely change: a larger batch (inputs x2.00"),
    ("one_layer_deeper", "model", "likely change: a larger model (parameters x"),
    ("leak", "leak", "likely change: a leak"),
])
def test_each_change_fails_the_baseline_and_is_named(capsys, simulated, change, cause, says):
    code, out, _ = check(capsys, simulated[change], "--baseline", simulated["baseline"])
    assert code == 1 and "grew past its baseline" in out and says in out
    code, doc = check_json(capsys, simulated[change], "--baseline", simulated["baseline"])
    d = doc["devices"][0]
    assert [x["cause"] for x in d["likely"]] == [cause]
    assert d["needed_bytes"] > d["limit_bytes"] == int(d["baseline_bytes"] * 1.05)
    assert d["first_step_over"] is not None


def test_the_deeper_model_names_its_new_layer_and_the_longer_sequence_its_attention_scores(capsys, simulated):
    _, doc = check_json(capsys, simulated["one_layer_deeper"], "--baseline", simulated["baseline"])
    d = doc["devices"][0]
    assert {m["name"] for m in d["modules"] if m["before"] == 0} >= {"layers.4.attn"}
    assert all(name.startswith("layers.4.") for name in d["likely"][0]["evidence"])
    _, doc = check_json(capsys, simulated["longer_sequence"], "--baseline", simulated["baseline"])
    evidence = doc["devices"][0]["likely"][0]
    assert evidence["evidence"][0].endswith("gpt.py:39 forward")   # q @ kᵀ: the b·h·s² scores
    assert evidence["evidence_ratio"] >= 2.0 ** 1.5


def test_the_leak_is_a_new_finding_and_the_unchanged_run_holds(capsys, simulated):
    _, doc = check_json(capsys, simulated["leak"], "--baseline", simulated["baseline"])
    assert doc["devices"][0]["new_findings"] == ["leak"]
    code, doc = check_json(capsys, simulated["base"], "--baseline", simulated["baseline"])
    assert code == 0 and doc["devices"][0]["needed_bytes"] == doc["devices"][0]["baseline_bytes"]


def test_a_budget_failure_names_the_fix_for_the_leak(capsys, simulated):
    from analyzer.pipeline import analyze

    needed = analyze(simulated["leak"]).devices[0].diagnosis.demand_bytes
    code, doc = check_json(capsys, simulated["leak"], "--budget", str(needed - 1))
    fix = doc["devices"][0]["fix"]
    assert code == 1 and fix["source"] == "remedy" and fix["steps"][0]["id"] == "fix_leak"   # no plan for a leak
    assert fix["predicted_bytes"] <= FIT_HEADROOM * (needed - 1)


# ---- GitHub Actions -------------------------------------------------------------------------------------------

def test_in_github_actions_errors_are_annotated_and_the_summary_appended(simulated, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    env = {**os.environ, "GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)}
    done = subprocess.run([sys.executable, "-m", "analyzer", "check", str(simulated["larger_batch"]), "--baseline",
                           str(simulated["baseline"])], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("::error")]
    assert len(errors) == 1 and errors[0].startswith("::error title=GPU memory check failed on cuda%3A0::cuda:0 grew")
    assert "%0A  " not in errors[0] and "%0Alikely change: a larger batch" in errors[0]
    text = summary.read_text()
    assert text.startswith("# earlier step\n### GPU memory check: FAILED") and "| cuda\\:0 | " in text   # md_text escapes a colon before a non-space
    done = subprocess.run([sys.executable, "-m", "analyzer", "check", str(simulated["base"]), "--baseline",
                           str(simulated["baseline"])], capture_output=True, text=True,
                          env={**env, "GITHUB_ACTIONS": "false"}, timeout=300)
    assert done.returncode == 0 and "::" not in done.stdout and summary.read_text() == text


# ---- bad input: one line, exit code 2 ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["missing.pickle", "--budget", "1GiB"], "missing.pickle: no such file"),
    (["{real}", "--budget", "forty"], "--budget forty: not a size"),
    (["{real}", "--budget", "0"], "a budget must be more than nothing"),
    (["{real}"], "check needs --budget SIZE or --baseline OLD"),
    (["{real}", "--budget", "1GiB", "--baseline", "{real}"], "pass one of them"),
    (["{real}", "--baseline", "{real}", "--tolerance", "five"], "--tolerance five: not a percentage"),
    (["{real}", "--baseline", "{future}"], "a baseline of version 'analyzer-baseline/99'"),
    (["{real}", "--baseline", "{broken}"], "not valid JSON"),
    (["{real}", "--baseline", "{golden_without_memory}"], "without 'mem-max-allocated-bytes' values"),
    (["{real}", "--baseline", "{result_without_peak}"], "an analyzer/1 result whose devices are malformed (the field 'peak' is missing)"),
    (["{real}", "--baseline", "{infinite}"], "a baseline whose devices are malformed (cannot convert float infinity"),
    (["{empty}", "--budget", "1GiB"], "no GPU memory to check"),   # a gate never passes on a run it missed
    (["{real}", "--baseline", "{empty}"], "no GPU memory to check"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, args, says):
    needs_real(SMALL_REAL)
    files = {"real": SMALL_REAL, "empty": REAL / "angelolmn-hitsbe" / "my_snapshot.pickle", "future": tmp_path / "future.json", "broken": tmp_path / "broken.json",
             "golden_without_memory": tmp_path / "golden.json", "result_without_peak": tmp_path / "result.json"}
    files["future"].write_text(json.dumps({"schema": "analyzer-baseline/99", "devices": []}))
    files["broken"].write_text('{"schema": "analyzer-baseline/1", "devices": [')
    files["golden_without_memory"].write_text(json.dumps(
        {"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 10.0, "2": 9.0}}}))
    files["infinite"] = tmp_path / "infinite.json"
    files["infinite"].write_text('{"schema": "analyzer-baseline/1", "devices": [{"device": 0, "needed_bytes": 1e400}]}')
    files["result_without_peak"].write_text(json.dumps({"schema": "analyzer/1", "devices": [{"device": 0}]}))
    code, out, err = check(capsys, *[a.format(**files) for a in args])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("analyze: error: ") and says in err
