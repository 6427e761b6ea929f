"""A model's repeated blocks, read once (analyzer.diagnose.blocks) for every rule that needs them: the replays'
blocks, attention's and the KV cache's blocks, and the counts that decide checkpointing's estimate and pipeline
and tensor parallelism. Each naming on both sides, with the names the recordings carry."""
from __future__ import annotations

import pandas as pd
import pytest

from analyzer.core.vocabulary import MODULE_PATH_SEPARATOR
from analyzer.diagnose.attention import block_paths
from analyzer.diagnose.blocks import Block, blocks, named_block
from analyzer.diagnose.remedies import blocks_alive, count_layers

LINEAR = "torch/nn/modules/linear.py:125 forward"


def _kineto(*paths: str) -> list[str]:
    return [p.replace(" › ", MODULE_PATH_SEPARATOR) for p in paths]


# the LoRA fixture's names (fixtures/traces/kineto/lora.pt.trace.json.gz): two TinyBlocks, each with a Sequential
# MLP of LoRALinear layers (six LoRALinear instances in all, each with a Linear child)
LORA = _kineto("Sequential_0 › LoRALinear_0 › Linear_0",
               "Sequential_0 › TinyBlock_0 › LayerNorm_0",
               "Sequential_0 › TinyBlock_0 › Sequential_1 › LoRALinear_1 › Linear_1",
               "Sequential_0 › TinyBlock_0 › Sequential_1 › LoRALinear_2 › Linear_2",
               "Sequential_0 › TinyBlock_1 › LayerNorm_2",
               "Sequential_0 › TinyBlock_1 › Sequential_2 › LoRALinear_3 › Linear_3",
               "Sequential_0 › TinyBlock_1 › Sequential_2 › LoRALinear_4 › Linear_4",
               "Sequential_0 › LoRALinear_5 › Linear_5")


def test_a_profilers_block_is_a_class_seen_twice_with_children_and_never_inside_another():
    """TinyBlock (2 instances) holds LoRALinear layers (6 in all, each with a Linear child): the block is the
    TinyBlock, however many layers repeat inside it; the LoRALinear layers of the embedding and the head, outside
    any TinyBlock, are in no block (their class is seen inside one)."""
    found = blocks(LORA)
    assert found[LORA[2]] == Block("TinyBlock", "0", MODULE_PATH_SEPARATOR.join(["Sequential_0", "TinyBlock_0"]),
                                   named=False)
    assert found[LORA[5]] is not None and found[LORA[5]].path.endswith("TinyBlock_1")
    assert found[LORA[0]] is None and found[LORA[-1]] is None
    assert count_layers(LORA) == blocks_alive(LORA) == 2
    paths = block_paths(pd.Series(LORA))
    assert paths.notna().sum() == 6 and paths.dropna().str.contains("TinyBlock").all()


def test_a_leaf_class_or_a_class_seen_once_is_no_block():
    """BERT's names: LayerNorm (a leaf, in every layer) and BertEmbeddings (one) are no blocks; BertLayer is."""
    bert = _kineto("BertModel_0 › BertEmbeddings_0 › LayerNorm_0",
                   "BertModel_0 › BertEncoder_0 › BertLayer_0 › BertAttention_0 › Linear_0",
                   "BertModel_0 › BertEncoder_0 › BertLayer_1 › BertAttention_1 › Linear_4",
                   "BertModel_0 › BertEncoder_0 › BertLayer_1 › LayerNorm_2")
    found = blocks(bert)
    assert found[bert[0]] is None
    assert {b.path.rsplit(MODULE_PATH_SEPARATOR, 1)[-1] for b in found.values() if b} == {"BertLayer_0", "BertLayer_1"}
    one = _kineto("Model_0 › TinyBlock_0 › Linear_1", "Model_0 › Linear_3")
    assert all(b is None for b in blocks(one).values()) and count_layers(one) is None and blocks_alive(one) == 0


@pytest.mark.parametrize(("module", "path", "splittable"), [
    ("model.layers.12.self_attn", "model.layers.12", True),
    ("transformer.h.3.mlp", "transformer.h.3", True),
    ("GPT › Block[3] › MLP", "GPT › Block[3]", True),
    (f"models.py:231 forward › {LINEAR}[2]", f"models.py:231 forward › {LINEAR}[2]", False),
    ("lm_head", None, True)])
def test_names_that_show_their_block_by_themselves(module: str, path: str | None, splittable: bool):
    """Qualified names and call paths; a torch.nn layer's numbered calls are a block to group a call's tensors by
    (the replays, attention) but none to split over GPUs."""
    found = named_block(module)
    assert (found.path if found else None) == path
    assert blocks([module])[module] == found
    assert found is None or found.splittable is splittable


def test_a_torch_layers_loop_is_counted_as_no_blocks():
    gcn = [f"models.py:231 forward › {LINEAR}[{i}]" for i in range(4)]
    assert count_layers(gcn) is None and blocks_alive(gcn) == 0
    assert block_paths(pd.Series(gcn)).nunique() == 4
