"""The workload's thresholds at their boundaries, on hand-made recordings (stated here as the spec):

- a forward-only run keeps an autograd graph (or a cache) when its activations at the peak are above
  GRAPH_KEPT_SHARE = 5% of the peak: `no_grad` is then offered;
- a fine-tune's frozen part: trainable bytes (its gradients) under FROZEN_SHARE = half of the parameters;
- a run trains, with no backward, optimizer step or optimizer state seen, when its gradients are at least
  GRADIENT_SHARE = 5% of its parameters.

Sizes sit one allocator block (512 bytes) either side of a boundary, the closest they can get.
"""
from __future__ import annotations

import analyzer
from analyzer.core.vocabulary import Role, tensor_mark
from analyzer.diagnose import workload
from analyzer.result import WorkloadFacts
from support.snapshots import BLOCK, MiB, Recording

GRAPH_KEPT_SHARE = 0.05
FROZEN_SHARE = 0.5
GRADIENT_SHARE = 0.05


def _forward_only(weights: int, activations: int, **options) -> WorkloadFacts:
    """Weights loaded, then one forward whose activations are alive at the peak (weights + activations)."""
    rec = Recording()
    with rec.step(1):
        with rec.phase("load"):
            rec.alloc(weights, where="model.py:10")
        with rec.phase("forward"):
            rec.alloc(activations, where="model.py:40")
    d = analyzer.analyze(rec.trace(), world_size=1, **options).devices[0]
    assert d.diagnosis.workload.kind == "forward_only"
    return d.diagnosis.workload


def test_activations_just_above_the_share_of_the_peak_are_a_kept_graph():
    peak = 100 * MiB
    over = int(GRAPH_KEPT_SHARE * peak) + BLOCK
    assert _forward_only(peak - over, over).graph_kept


def test_activations_just_under_the_share_of_the_peak_are_not():
    peak = 100 * MiB
    under = int(GRAPH_KEPT_SHARE * peak) - BLOCK
    assert not _forward_only(peak - under, under).graph_kept


def test_the_share_is_a_threshold_of_the_python_api():
    peak = 100 * MiB
    under = int(GRAPH_KEPT_SHARE * peak) - BLOCK
    tuned = analyzer.Thresholds(graph_kept_share=0.02)
    assert _forward_only(peak - under, under, thresholds=tuned).graph_kept
    assert analyzer.Thresholds().graph_kept_share == GRAPH_KEPT_SHARE


def test_a_frozen_base_is_under_half_the_parameters_trainable():
    from analyzer.diagnose.workload import frozen_share

    parameters = 100 * MiB
    assert frozen_share(parameters, int(FROZEN_SHARE * parameters) - BLOCK, 0) is not None   # a frozen base
    assert frozen_share(parameters, int(FROZEN_SHARE * parameters), 0) is None               # all of it trains
    assert frozen_share(parameters, int(FROZEN_SHARE * parameters) - BLOCK, 0, below=0.4) is None
    assert analyzer.Thresholds().frozen_below == FROZEN_SHARE


def _gradients_without_a_backward(gradients: int, **options) -> WorkloadFacts:
    """An evaluation forward of a model whose gradients are alive but made by no backward the recording shows
    (kept from training, marked by `analyzer.tag_modules`): 100 MiB of weights loaded, `gradients` bytes that a
    `tensor::gradient` mark names, then a forward. No backward, no optimizer step, no optimizer state: only the
    gradients' share of the parameters says whether it trains."""
    rec = Recording()
    with rec.step(1):
        with rec.phase("load"):
            rec.alloc(100 * MiB, where="model.py:10")
            grad = rec.alloc(gradients, where="model.py:11")
        with rec.range(tensor_mark(Role.GRADIENT.value, "layer.weight", grad)):
            pass
        with rec.phase("forward"):
            rec.alloc(8 * MiB, where="model.py:40")
    d = analyzer.analyze(rec.trace(), world_size=1, **options).devices[0]
    assert d.by_category[0]["name"] == "parameter" and d.by_category[0]["bytes"] == 100 * MiB
    assert {r["name"]: r["bytes"] for r in d.by_category}["gradient"] == gradients
    return d.diagnosis.workload


def test_gradients_of_5_percent_of_the_parameters_show_training_without_a_backward():
    """GRADIENT_SHARE = 5%: 5 MiB of gradients beside 100 MiB of parameters is training."""
    assert GRADIENT_SHARE == workload.GRADIENT_SHARE
    assert _gradients_without_a_backward(int(GRADIENT_SHARE * 100 * MiB)).kind == "training"


def test_gradients_one_block_under_5_percent_do_not():
    under = _gradients_without_a_backward(int(GRADIENT_SHARE * 100 * MiB) - BLOCK)
    assert under.kind == "forward_only" and under.summary.startswith("forward only (no backward, no optimizer)")


def test_the_gradient_share_is_a_threshold_of_the_python_api():
    """The same 5% of gradients is no training when the share is tuned to 6%."""
    assert analyzer.Thresholds().gradient_share == GRADIENT_SHARE
    tuned = analyzer.Thresholds(gradient_share=0.06)
    assert _gradients_without_a_backward(int(GRADIENT_SHARE * 100 * MiB), thresholds=tuned).kind == "forward_only"
