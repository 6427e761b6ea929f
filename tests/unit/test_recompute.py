"""Activation checkpointing's recomputation (analyzer.attribute.category.recomputed_activations): what it makes
and keeps past its end is the segment's activations again; what it frees before it ends is temporaries."""
from __future__ import annotations

import numpy as np

from analyzer.attribute.category import RECOMPUTE_SIGNAL, recomputed_activations


def test_what_outlives_the_recomputation_is_an_activation() -> None:
    source = np.asarray(["frames:module.forward", RECOMPUTE_SIGNAL, RECOMPUTE_SIGNAL, RECOMPUTE_SIGNAL,
                         "frames:torch.autograd"], dtype=object)
    t_alloc = np.asarray([10.0, 20.0, 21.0, 22.0, 30.0])
    # row 1 freed inside the run (before its last allocation at 22): a temporary of the recomputed forward;
    # row 2 freed just at the run's end is not past it; row 3 freed by the segment's backward, later: an activation
    t_free = np.asarray([40.0, 21.5, 22.0, 35.0, 50.0])
    assert recomputed_activations(source, t_alloc, t_free).tolist() == [False, False, False, True, False]


def test_without_recomputation_nothing_changes() -> None:
    source = np.asarray(["frames:module.forward", None], dtype=object)
    assert not recomputed_activations(source, np.asarray([1.0, 2.0]), np.asarray([np.inf, np.inf])).any()
