"""The command-line papercuts of issue 18: sizes need units, a partial shape is an error, no 'ZeRO on 1 GPU',
and `analyze diff` credits only a remedy whose memory shrank and refuses an unknown remedy."""
from __future__ import annotations

import pickle

from analyzer.commands import main
from support.snapshots import GiB, Recording


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_bare_gpu_memory_is_an_error_naming_the_units(capsys):
    code, out, err = _run(["estimate", "--params", "7e9", "--gpu-memory", "80"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "80GiB" in err and "80GB" in err


def test_gib_is_binary_and_gb_decimal(capsys):
    assert _run(["estimate", "--params", "7e9", "--gpu-memory", "80GiB"], capsys)[1].count("of 80.00 GiB") == 1
    assert "of 74.51 GiB" in _run(["estimate", "--params", "7e9", "--gpu-memory", "80GB"], capsys)[1]


def test_a_micro_batch_without_the_shape_is_an_error(capsys):
    code, _, err = _run(["estimate", "--params", "7e9", "--micro-batch", "8", "--gpu-memory", "80GiB"], capsys)
    assert code == 2 and "--seq, --layers, --hidden missing" in err


def test_without_gpus_no_zero_on_one_gpu_is_listed(capsys):
    out = _run(["estimate", "--params", "7e9", "--gpu-memory", "80GiB"], capsys)[1]
    assert "GPU(s)" not in out and "ZeRO-1" not in out and "ZeRO-3 on 2 GPUs" in out
    with_gpus = _run(["estimate", "--params", "7e9", "--gpu-memory", "80GiB", "--gpus", "8"], capsys)[1]
    assert "ZeRO-2 on 8 GPUs: 24.45 GiB per GPU, fits" in with_gpus


def _pair(tmp_path) -> tuple[str, str]:
    """Before: 1 GiB of parameters and 8 GiB of activations kept to the backward; after: the activations halved
    (what bf16 does), the parameters as they were."""
    return _pair_of(tmp_path, GiB, GiB)


def test_diff_credits_no_sharding_for_halved_activations(tmp_path, capsys):
    before, after = _pair(tmp_path)
    code, out, _ = _run(["diff", before, after], capsys)
    assert code == 0
    assert "zero3" not in out and "tensor_parallel" not in out
    assert "-0%" not in out


def test_diff_refuses_an_unknown_remedy(tmp_path, capsys):
    before, after = _pair(tmp_path)
    code, out, err = _run(["diff", before, after, "--remedy", "nonsense"], capsys)
    assert code == 2 and out == "" and "--remedy nonsense: no such remedy" in err and "micro_batch" in err


def _pair_of(tmp_path, unit: int, after_parameters: int) -> tuple[str, str]:
    """Before: 1 unit of parameters and 8 of activations kept to the backward; after: the activations halved
    and `after_parameters` units of parameters."""
    paths = []
    for name, parameters, activations in (("before", unit, 8 * unit), ("after", after_parameters, 4 * unit)):
        rec = Recording()
        with rec.step(1):
            with rec.phase("load"):
                rec.alloc(parameters, where="model.py:5")
            with rec.phase("forward"):
                kept = [rec.alloc(activations // 4, where="model.py:20") for _ in range(4)]
            with rec.phase("backward"):
                for addr in kept:
                    rec.free(addr)
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickle.dumps(rec.snapshot()))
        paths.append(str(path))
    return paths[0], paths[1]


def test_diff_writes_each_size_in_the_unit_it_fills(tmp_path, capsys):
    """Issue 33.2: two 9 MiB runs read in MiB, not '0.00 GiB -> 0.00 GiB' on every row."""
    MiB = 2**20
    code, out, _ = _run(["diff", *_pair_of(tmp_path, MiB, MiB)], capsys)
    assert code == 0 and "0.00 GiB" not in out
    assert "memory needed 9.00 MiB -> 5.00 MiB (-4.00 MiB, -44%)" in out
    assert "activation          8.00 MiB    4.00 MiB  -4.00 MiB (-50%)" in out


def test_diff_credits_no_remedy_when_the_peak_went_up(tmp_path, capsys):
    """Issue 33.2: the activations halved (what bf16 names is visible) but the parameters grew by more: the need
    went up, so neither the best guess nor a given --remedy is credited, and the output says what changed."""
    before, after = _pair_of(tmp_path, GiB, 6 * GiB)
    for extra in ([], ["--remedy", "bf16"]):
        code, out, _ = _run(["diff", before, after, *extra], capsys)
        assert code == 0 and "explains it" not in out and "measured" not in out
        assert "no remedy explains this change: the memory needed went up; what changed most: " \
               "parameter +5.00 GiB, activation -4.00 GiB" in out


def test_diff_credits_a_given_remedy_only_when_its_change_is_visible(tmp_path, capsys):
    """Issue 33.2: the activations halved and the need went down: bf16 (acts on activations) explains it, ZeRO-3
    (acts on the model states, unchanged) does not; short names resolve to the ids."""
    before, after = _pair_of(tmp_path, GiB, GiB)
    out = _run(["diff", before, after, "--remedy", "BF16"], capsys)[1]
    assert "bf16 explains it (given): saving" in out
    out = _run(["diff", before, after, "--remedy", "zero-3"], capsys)[1]
    assert "no remedy explains this change: parameter or gradient or optimizer_state, what zero3 shrinks, did not " \
           "shrink; what changed most: activation -4.00 GiB" in out


def test_remedy_short_names_and_help(capsys):
    from analyzer.diagnose.remedies import BY_ID
    from analyzer.diagnose.remedy_names import resolve_remedy

    assert [resolve_remedy(n) for n in ("bf16", "checkpointing", "zero-3", "fsdp", "Micro-Batch", "accumulation")] \
        == ["bf16", "activation_checkpointing", "zero3", "zero3", "micro_batch", "gradient_accumulation"]
    code, out, err = _run(["diff", "a", "b", "--remedy", "quantization"], capsys)
    assert code == 2 and "could be weight_quantization, weight_quantization_4bit" in err
    try:
        main(["diff", "--help"])
    except SystemExit:
        pass
    helped = " ".join(capsys.readouterr().out.split())
    assert all(i in helped for i in BY_ID)
