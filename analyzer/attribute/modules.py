"""Which module an allocation belongs to: an explicit tag (user_metadata, then module ranges), the user
forward frame, or, for gradients and
optimizer state, the module of the parameter of the same size (when that parameter's module is known and
no other parameter has that size)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.attribute.annotations import annotation_labels
from analyzer.core.vocabulary import Category


def assign_modules(a: pd.DataFrame, annotations: pd.DataFrame, times: np.ndarray, frame_module: np.ndarray,
                   category: np.ndarray, from_metadata: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    module, source = from_metadata
    module, source = module.copy(), source.copy()
    tagged, tag_source = annotation_labels(annotations, times, "tag", "module")
    unset = pd.isna(module)
    module[unset], source[unset] = tagged[unset], tag_source[unset]
    unset = pd.isna(module)
    from_frames = unset & ~pd.isna(frame_module)
    module[from_frames] = frame_module[from_frames]
    source[from_frames] = "frames:user-frame"
    _match_parameters(a, module, source, category)
    return module, source


def _match_parameters(a: pd.DataFrame, module: np.ndarray, source: np.ndarray, category: np.ndarray) -> None:
    """Gradients and optimizer states have their parameter's size: borrow its module when unambiguous."""
    sizes = a["requested_bytes"].to_numpy()
    is_param = (category == Category.PARAMETER) & ~pd.isna(module)
    if not is_param.any():
        return
    params = pd.DataFrame({"size": sizes[is_param], "module": module[is_param]})
    owners = params.groupby("size")["module"].agg(lambda m: m.iloc[0] if m.nunique() == 1 else None).dropna()
    wanted = np.isin(category, [Category.GRADIENT, Category.OPTIMIZER_STATE]) & pd.isna(module)
    for i in np.flatnonzero(wanted):
        owner = owners.get(sizes[i])
        if owner is not None:
            module[i] = owner
            source[i] = "size-match:parameter"
