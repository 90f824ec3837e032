"""A CPU drafter's mapped embeddings and LM head (models/draft_parts.py) draft as the matrices read whole: the same
embeddings and LM-head rows bit for bit, and the same trees up to rounding (a matmul over a file-mapped matrix may
take another kernel path than over an allocated one: tests/numerics.py), in the file's dtype and cast to another,
tied or not, sharded or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2
from taps_ray.drafting.tree import DraftTree
from taps_ray.models.draft_head import new_head
from taps_ray.models.draft_parts import (
    EMBED, LM_HEAD, WEIGHTS, WEIGHTS_INDEX, MappedHead, load_draft_target, read_parts, tensor_files,
)
from taps_ray.models.target import SMOLLM2_ALIAS, Target, model_source

from numerics import assert_same_tree, rounding_rtol, tree_rtol

TREE = TreeConfig(total_token=16, depth=4, top_k=4)


def _checkpoint(folder: Path, target: Target, tied: bool, sharded: bool) -> Path:
    """The tiny target's embeddings (and, untied, a random LM head) as a HF folder of safetensors files."""
    folder.mkdir()
    embed = target.model.get_input_embeddings().weight.detach().clone()
    tensors = {EMBED: embed} if tied else {EMBED: embed, LM_HEAD: torch.randn(embed.shape)}
    if sharded:
        shards = {name: f"model-{i:05d}.safetensors" for i, name in enumerate(tensors)}
        for name, file in shards.items():
            save_file({name: tensors[name]}, str(folder / file))
        (folder / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": shards}))
    else:
        save_file(tensors, str(folder / WEIGHTS))
    (folder / "config.json").write_text(json.dumps({**target.model.config.to_dict(), "tie_word_embeddings": tied}))
    target.tokenizer.save_pretrained(folder)
    return folder


def _trees(target: Target, head_config, vocab: torch.Tensor | None) -> list[DraftTree]:
    """Trees a seeded head drafts over a short sequence with `target`'s embeddings and LM head."""
    head = new_head(head_config, dtype=target.dtype, seed=3)
    ctx = DraftContext(target.model.get_input_embeddings(), target.model.lm_head, vocab)
    generator = torch.Generator().manual_seed(0)
    cache, trees = HeadCache(), []
    for m in (7, 1, 3):
        features = torch.randn(m, head.config.hidden_size, generator=generator).to(target.dtype)
        tokens = torch.randint(0, 1000, (m,), generator=generator)
        ((tree,),), (cache,) = draft_eagle2(head, ctx, [cache], [features], [tokens], TREE)
        trees.append(tree)
    return trees


def _same_drafts(mapped: Target, read: Target, head_config, vocab: torch.Tensor) -> None:
    ids = torch.randint(0, mapped.model.get_input_embeddings().num_embeddings, (5, 9))
    assert torch.equal(mapped.model.get_input_embeddings()(ids), read.model.get_input_embeddings()(ids))
    for drafted_over in (vocab, None):
        for ours, theirs in zip(_trees(mapped, head_config, drafted_over), _trees(read, head_config, drafted_over)):
            rtol = tree_rtol(head_config.hidden_size, 4)  # _trees drafts 16/4/4
            entropy_rtol = rounding_rtol(head_config.vocab_size, chained=5)  # an entropy sums over the vocabulary
            assert not assert_same_tree(ours, theirs, rtol, entropy_rtol), "mapped and read rows part at a near-tie"


@pytest.mark.parametrize("tied,sharded", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mapped_parts_draft_as_the_matrices_read_whole(tmp_path, tiny_target, tied, sharded, dtype):
    folder = _checkpoint(tmp_path / "target", tiny_target, tied, sharded)
    mapped = load_draft_target(TargetConfig(name=str(folder), dtype=dtype, device="cpu"))
    files = tensor_files(folder, {EMBED} if tied else {EMBED, LM_HEAD})
    read = Target(read_parts(files, tied, getattr(torch, dtype), torch.device("cpu")), mapped.tokenizer, "read")
    assert mapped.dtype == read.dtype == getattr(torch, dtype) and mapped.device == torch.device("cpu")
    assert list(mapped.model.parameters()) == []  # nothing read whole yet
    vocab = torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:300].sort().values
    head = mapped.model.lm_head
    assert isinstance(head, MappedHead)
    ctx = DraftContext(mapped.model.get_input_embeddings(), head, vocab)
    assert head.matrix._whole is None  # a draft vocabulary reads its rows only ...
    assert DraftContext(mapped.model.get_input_embeddings(), head, vocab.clone())._projection is ctx._projection  # ... once
    assert torch.equal(ctx._projection.row_weight(), read.model.lm_head.weight[vocab])
    _same_drafts(mapped, read, tiny_target.model.config, vocab)
    assert torch.equal(head.weight, read.model.lm_head.weight)  # the full vocabulary reads it all


def test_smollm2_mapped_parts_draft_as_the_matrices_read_whole():
    name = SMOLLM2_ALIAS
    mapped = load_draft_target(TargetConfig(name=name, dtype="bfloat16", device="cpu"))
    read = Target(read_parts(tensor_files(model_source(name), {EMBED}), True, torch.bfloat16, torch.device("cpu")),
                  mapped.tokenizer, name)
    vocab = torch.randperm(len(mapped.tokenizer), generator=torch.Generator().manual_seed(1))[:8192].sort().values
    context = DraftContext(mapped.model.get_input_embeddings(), mapped.model.lm_head, vocab)
    assert torch.equal(context._projection.row_weight(), read.model.lm_head.weight[vocab])
    _same_drafts(mapped, read, transformers.AutoConfig.from_pretrained(model_source(name)), vocab)
