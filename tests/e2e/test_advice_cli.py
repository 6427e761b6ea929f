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
    paths = []
    for name, activations in (("before", 8 * GiB), ("after", 4 * GiB)):
        rec = Recording()
        with rec.step(1):
            with rec.phase("load"):
                rec.alloc(GiB, where="model.py:5")
            with rec.phase("forward"):
                kept = [rec.alloc(activations // 4, where="model.py:20") for _ in range(4)]
            with rec.phase("backward"):
                for addr in kept:
                    rec.free(addr)
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickle.dumps(rec.snapshot()))
        paths.append(str(path))
    return paths[0], paths[1]


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
