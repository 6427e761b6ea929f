"""A model's repeated blocks (a transformer's layers), as module names show them: one reading that the replays,
attention's rules and the remedies' counts all take.

- A qualified name: `model.layers.3.mlp`, `transformer.h.3`, `encoder.layer.3` (the list `layers`, `h`,
  `blocks` ... then the block's number): the block is `model.layers.3`, of the family `model.layers`.
- A call path (Python frames only): the first numbered call, `model.py:382 forward[3]` (the fourth call that
  line made: a loop over the layers): the block is the path to it, of the family of that line. Where the line is
  in torch.nn's own files (`torch/nn/modules/linear.py`), the calls are one torch.nn layer called again and
  again (a graph network's message passing over nn.Linear): a block to group a call's tensors by, not one to
  split over GPUs (`splittable` False).
- A profiler's module path (Kineto names each module by its class and instance, `Model_0 › DecoderLayer_3 ›
  Linear_7`): a class seen with children (not a leaf such as Linear) in two instances or more repeats; the
  blocks are the instances of a repeating class never seen inside another (`DecoderLayer_3`, not its
  `Attention_3`, nor the `LoRALinear_9` inside it, however many of those there are, nor a LoRALinear of the head
  outside any layer). This needs the names of the whole model: `blocks` reads them together.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR, NO_MODULE, UNATTRIBUTED

_QUALIFIED = re.compile(r"^((?:.*\.)?(?:layers|layer|h|blocks|block|encoder\.layer|decoder\.layers))\.(\d+)(?:\.|$)")
_CALL = re.compile(r"^(.*?)\[(\d+)\]")          # a call path's first numbered call: `model.py:382 forward[3]`
_INSTANCE = re.compile(r"^(\w+)_(\d+)$")         # a profiler's module: its class and instance (`TinyBlock_1`)
_TORCH_LAYER = "torch/nn/modules/"               # the files of torch.nn's own layers (Linear, Conv2d, LayerNorm ...)


@dataclass(frozen=True)
class Block:
    """The repeated block a module path is in."""

    family: str            # what repeats: `model.layers`, the line making the numbered calls, a profiler's class
    index: str             # which one of them
    path: str              # the module path down to the block: `model.layers.3`, `… forward[3]`, `Model_0 › Layer_3`
    splittable: bool = True  # False: the numbered calls of one torch.nn layer, nothing to split over GPUs
    named: bool = True     # False: a profiler's instance, told a block by the other names around it


def named_block(module: str) -> Block | None:
    """The block a qualified name or a call path names by itself (a profiler's instances need `blocks`)."""
    if (m := _QUALIFIED.match(module)) is not None:
        return Block(m.group(1), m.group(2), f"{m.group(1)}.{m.group(2)}")
    if (m := _CALL.match(module)) is not None:
        return Block(m.group(1), m.group(2), module[:m.end()],
                     splittable=_TORCH_LAYER not in m.group(1).rsplit(MODULE_PATH_SEPARATOR, 1)[-1])
    return None


def blocks(modules: Iterable[str]) -> dict[str, Block | None]:
    """The block each module path is in, read with the others (a profiler's repeated classes are told by them)."""
    paths = {m for m in modules if m not in (UNATTRIBUTED, NO_MODULE)}
    instances: dict[str, set[str]] = {}
    for path in paths:
        for level in path.split(MODULE_PATH_SEPARATOR)[1:-1]:       # below the root, with children
            if (m := _INSTANCE.match(level)) is not None:
                instances.setdefault(m.group(1), set()).add(m.group(2))
    repeated = {name for name, seen in instances.items() if len(seen) >= 2}
    inner: set[str] = set()                     # repeating classes seen inside another
    for path in paths:
        classes = [m.group(1) for level in path.split(MODULE_PATH_SEPARATOR)[1:]
                   if (m := _INSTANCE.match(level)) is not None and m.group(1) in repeated]
        inner.update(classes[1:])
    outer = repeated - inner
    out: dict[str, Block | None] = {}
    for path in paths:
        found = named_block(path)
        if found is None and outer:
            levels = path.split(MODULE_PATH_SEPARATOR)
            at = next((i for i, level in enumerate(levels[1:], 1)
                       if (m := _INSTANCE.match(level)) is not None and m.group(1) in outer), None)
            if at is not None and (m := _INSTANCE.match(levels[at])) is not None:
                found = Block(m.group(1), m.group(2), MODULE_PATH_SEPARATOR.join(levels[:at + 1]), named=False)
        out[path] = found
    return out


def block_paths(modules: pd.Series) -> pd.Series:
    """Each row's repeated block, as its path (`blocks`, read over these rows' modules; None outside one), read
    once per distinct module: matching every row took 2 s of a 1M-entry run's checkpointing."""
    if isinstance(modules.dtype, pd.CategoricalDtype):   # a replay's stream: its categories are the distinct modules
        codes, names = modules.cat.codes.to_numpy(), modules.cat.categories.astype(str)
    else:
        codes, names = pd.factorize(modules.astype(str))
    found = blocks(names)
    paths = np.array([None if (b := found.get(m)) is None else b.path for m in names] + [None],
                     dtype=object)     # code -1 (none here): None
    return pd.Series(paths[codes], index=modules.index, name=modules.name, dtype=object)


def most_blocks(found: Iterable[Block | None]) -> int:
    """The most blocks one family shows, of those that could be split over GPUs: qualified names and call paths
    first (they name blocks by themselves), a profiler's instances only where neither shows any."""
    families: dict[tuple[bool, str], set[str]] = {}
    for block in found:
        if block is not None and block.splittable:
            families.setdefault((block.named, block.family), set()).add(block.index)
    named = [len(seen) for (is_named, _), seen in families.items() if is_named]
    return max(named or [len(seen) for seen in families.values()] or [0])


def profiler_names(modules: Iterable[str]) -> bool:
    """The names are a profiler's module paths (`Model_0 › ...`): they show the structure, blocks or none."""
    return any(_INSTANCE.match(path.split(MODULE_PATH_SEPARATOR)[0]) for path in modules)


def torch_layer_loop(found: Iterable[Block | None]) -> bool:
    """A line called one torch.nn layer again and again: the names show the structure, and it is no block."""
    return any(block is not None and not block.splittable for block in found)
