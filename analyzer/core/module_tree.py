"""The memory at the peak as a tree of modules, nested by FQN prefix (`layers` > `4` > `attn`) or, for the
module call paths read from stacks, by level (`GPT › Block[3] › MLP`: `GPT` > `Block[3]` > `MLP`).

A flat top-20 list hides that forty `layers.N.attn` rows are one transformer block repeated; the tree shows the
block once with its total and lets the reader open it. Every node's bytes equal the sum of its children, so the
tree sums to the peak exactly, like every other split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import pandas as pd

from analyzer.core.stacks import short_frame
from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR

#: a module FQN (`encoder.layers.3.mlp`); other module labels (a frame such as `train.py:12 forward`, `(root module)`,
#: `unattributed`) are leaves at the top, and a call path's levels nest by MODULE_PATH_SEPARATOR
_FQN = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")
_CLASS = re.compile(r"^[A-Za-z_]\w*(\[\d+\])?$")   # a call path's level: a class, numbered where it repeats
OWN = "(own allocations)"


SENTENCE_LEVELS = 3  # a call path in a sentence: its innermost levels, the outer ones folded into "…"


def module_in_sentence(name: str) -> str:
    """A module as a sentence names it: an FQN as it is; a call path by its innermost SENTENCE_LEVELS levels,
    each frame-like level by its file's name (`… › model.py:382 forward[23] › model.py:520 forward`)."""
    levels = name.split(MODULE_PATH_SEPARATOR)
    shown = [level if _FQN.match(level) or _CLASS.match(level) else _file_level(level)
             for level in levels[-SENTENCE_LEVELS:]]
    return ("… › " if len(levels) > SENTENCE_LEVELS else "") + MODULE_PATH_SEPARATOR.join(shown)


def _file_level(level: str) -> str:
    location, _, function = level.partition(" ")
    return f"{location.replace(chr(92), '/').rsplit('/', 1)[-1]} {function}".strip()


def module_label(name: str) -> str:
    """A module as a person reads it: a frame-like label (`/long/path/train.py:12 forward`) by the end of its path,
    in a call path level by level."""
    if MODULE_PATH_SEPARATOR in name:
        return MODULE_PATH_SEPARATOR.join(module_label(part) for part in name.split(MODULE_PATH_SEPARATOR))
    return name if _FQN.match(name) or _CLASS.match(name) else short_frame(name)


#: levels a tree nests at most: the levels past it stay one name in the deepest node (models nest a few dozen
#: levels; a hostile FQN of thousands of parts would otherwise recurse past Python's limit)
MAX_TREE_DEPTH = 64


def _levels(name: str) -> tuple[list[str], str]:
    """The parts a module name nests by (at most MAX_TREE_DEPTH), and what joins them."""
    if MODULE_PATH_SEPARATOR in name:
        parts, joiner = name.split(MODULE_PATH_SEPARATOR), MODULE_PATH_SEPARATOR
    elif _FQN.match(name):
        parts, joiner = name.split("."), "."
    else:
        return [name], "."
    if len(parts) > MAX_TREE_DEPTH:
        parts = [*parts[:MAX_TREE_DEPTH - 1], joiner.join(parts[MAX_TREE_DEPTH - 1:])]
    return parts, joiner


@dataclass
class ModuleNode:
    label: str          # this node's part of the name
    path: str           # the full name
    bytes: int          # this node and everything under it
    share: float        # of the total at the peak
    children: list[ModuleNode] = field(default_factory=list)


@dataclass
class _Draft:
    own: int = 0
    children: dict[str, _Draft] = field(default_factory=dict)
    joiner: str = "."     # between this node's name and its children's

    def total(self) -> int:
        return self.own + sum(c.total() for c in self.children.values())


def module_tree(live: pd.DataFrame, min_share: float = 0.01, max_children: int = 12) -> list[ModuleNode]:
    """Roots of the tree for the allocations in `live`; nodes under `min_share` of the total are folded per
    parent into one "other (N modules)" node, and so are children beyond `max_children`."""
    sums = live.groupby(live["module"].astype(str), observed=True)["allocated_bytes"].sum()
    root = _Draft()
    for name, size in sums.items():
        node = root
        parts, joiner = _levels(str(name))
        for depth, part in enumerate(parts):
            if depth:
                node.joiner = joiner
            node = node.children.setdefault(part, _Draft())
        node.own += int(size)
    total = root.total()
    return _finish(root, "", total, min_share, max_children)


def _finish(draft: _Draft, prefix: str, total: int, min_share: float, max_children: int) -> list[ModuleNode]:
    nodes = []
    for label, child in draft.children.items():
        path = f"{prefix}{draft.joiner}{label}" if prefix else label
        label = module_label(label)
        while child.own == 0 and len(child.children) == 1:  # a chain with nothing of its own reads as one name
            joiner = child.joiner
            (only, child), = child.children.items()
            label, path = f"{label}{joiner}{module_label(only)}", f"{path}{joiner}{only}"
        kids = _finish(child, path, total, min_share, max_children) if child.children else []
        if kids and child.own:
            kids.append(ModuleNode(OWN, path, child.own, child.own / total))
            kids.sort(key=lambda n: -n.bytes)
        size = child.total()
        nodes.append(ModuleNode(label, path, size, size / total if total else 0.0, kids))
    nodes.sort(key=lambda n: (-n.bytes, n.path))
    # largest first, so the nodes kept are a prefix
    kept = sum(1 for i, n in enumerate(nodes) if n.share >= min_share and i < max_children)
    keep, rest = nodes[:kept], nodes[kept:]
    if len(rest) > 1:
        size = sum(n.bytes for n in rest)
        keep.append(ModuleNode(f"other ({len(rest)} modules)", prefix, size, size / total if total else 0.0))
    else:
        keep.extend(rest)
    return keep
