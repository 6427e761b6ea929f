"""One colour per category and per phase, shared by every chart and bar, so a colour means the same thing in the
timeline, the breakdown bars and the PNG pasted into an issue."""
from __future__ import annotations

#: categories in the order they are stacked in charts: what lives longest at the bottom
CATEGORY_ORDER = ("parameter", "optimizer_state", "gradient", "input", "activation", "temporary", "other",
                  "unattributed")

_CATEGORY_COLORS = {
    "parameter": "#4c72b0", "optimizer_state": "#8172b3", "gradient": "#55a868", "input": "#937860",
    "activation": "#dd8452", "temporary": "#c44e52", "other": "#8c8c8c", "unattributed": "#c7c7c7",
}
_PHASE_COLORS = {
    "load": "#4c72b0", "forward": "#dd8452", "backward": "#55a868", "optimizer": "#8172b3",
    "checkpoint_save": "#da8bc3", "compile": "#937860", "other": "#8c8c8c", "unattributed": "#c7c7c7",
}
# for names we do not know (a user's own phase tag): stable across runs, distinct from the named ones
_SPARE = ("#64b5cd", "#ccb974", "#17becf", "#bcbd22", "#9467bd", "#e377c2")


def _pick(table: dict[str, str], name: str) -> str:
    if name in table:
        return table[name]
    return _SPARE[sum(name.encode()) % len(_SPARE)]


def category_color(name: str) -> str:
    return _pick(_CATEGORY_COLORS, name)


def phase_color(name: str) -> str:
    return _pick(_PHASE_COLORS, name)


def category_rank(name: str) -> tuple[int, str]:
    """Sort key: known categories in stacking order, unknown ones after them by name."""
    return (CATEGORY_ORDER.index(name) if name in CATEGORY_ORDER else len(CATEGORY_ORDER), name)
