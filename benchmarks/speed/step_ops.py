"""Aten ops per target step on the Llama-3-8B shape, eager and captured (`target.compile: step`): what a GPU's
host launches from Python per step, counted without a GPU or the 8B weights. Used by host_overhead.py.

The model has the 8B's structure (configs/models/llama-3-8b-instruct.json: 32 layers, 32 query and 8 key/value
heads, the gated MLP), with small widths and vocabulary and random weights, bf16 on the CPU: the ops a step runs
do not depend on the widths, and its projections are made to run as on a GPU (`F.linear`, not oneDNN's packed
weights). A `TorchDispatchMode` counts every aten op that reaches Python dispatch (views included: each costs the
host a dispatch), over one `TargetBatch.step` from the trees to the results (drafting excluded), after a warm-up
step. The captured step is run as its uncompiled function (`captured="eager"`): the ops inside it are what its
graph holds, counted separately; launched from Python, the graph counts as one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.tree import DraftTree, build_tree, root_only
from taps_ray.drafting.tree_merge import merge_stack
from taps_ray.drafting.tree_stack import stack_means, stack_trees
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.target_forward import attach_forward, target_forward

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "models" / "llama-3-8b-instruct.json"
SMALL_WIDTHS = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 4, "vocab_size": 1024}
PAPER_TREE = (60, 5)  # total_token, depth (top_k 10 shapes which tokens, not the ops)


class OpCounter(TorchDispatchMode):
    """Counts aten ops, split into those inside a captured step's function and those outside."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = self.outside = self.graphs = 0
        self.capturing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.capturing:
            self.inside += 1
        else:
            self.outside += 1
        return func(*args, **(kwargs or {}))


def eight_b_shaped(seed: int = 0) -> transformers.PreTrainedModel:
    """A random bf16 Llama with the 8B's layers and heads and small widths, its projections as on a GPU."""
    data = json.loads(CONFIG.read_text())
    for key in ("torch_dtype", "bos_token_id", "eos_token_id"):  # token ids outside the small vocabulary
        data.pop(key)
    data.update(SMALL_WIDTHS)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def gpu_like(forward: FastLlama) -> None:
    """The projections' GPU path (`F.linear` over the weight as is), whose ops a GPU step launches."""
    for layer in forward.layers:
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            projection.cpu, projection.packed = False, None
    forward.lm_head.cpu, forward.lm_head.packed = False, None


def random_tree(size: int, depth: int, vocab: int, generator: torch.Generator, root: int | None = None
                ) -> DraftTree:
    """A tree of `size` nodes (root included, `root` its token if given) at most `depth` levels below the root,
    parents before children, random tokens."""
    parents, depths = [-1], [0]
    while len(parents) < size:
        parent = int(torch.randint(len(parents), (1,), generator=generator))
        if depths[parent] < depth:
            parents.append(parent)
            depths.append(depths[parent] + 1)
    tokens = torch.randint(3, vocab, (size,), generator=generator)
    if root is not None:
        tokens[0] = root
    return build_tree(tokens, torch.tensor(parents))


def count_step(model: transformers.PreTrainedModel, captured: str | None, batch: int, tree_size: int,
               context: int = 64) -> dict[str, int]:
    """Aten ops of one step (after a warm-up step) of `batch` sequences with trees of `tree_size` nodes (1: plain
    decoding), eager (`captured` None) or through the captured step's function."""
    forward = target_forward(model)
    forward.captured = captured
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    target = TargetBatch(model)
    prompts = torch.randint(3, vocab, (batch, context), generator=generator).tolist()
    roots = [c.tokens[-1] for c in target.start(prompts, SamplingParams(), list(range(batch)))]

    def trees() -> list[DraftTree]:
        if tree_size == 1:
            return [root_only(root, model.device) for root in roots]
        return [random_tree(tree_size, PAPER_TREE[1], vocab, generator) for _ in roots]

    roots = [r.tokens[-1] for r in target.step(trees())]
    counter = OpCounter()
    graphs = forward.__dict__.get("step_graphs", {}).values()  # made by the warm-up step
    for graph in graphs:
        graph.run = _counted(graph.run, counter)
    drafted = trees()
    try:
        with counter:
            target.step(drafted)
    finally:
        for graph in graphs:
            graph.run = graph.step
        forward.captured = None
    return {"outside": counter.outside, "inside": counter.inside, "graphs": counter.graphs,
            "launched": counter.outside + counter.graphs}


def _counted(run, counter: OpCounter):
    """`run` with its ops counted as inside a captured graph, and its calls as graphs."""
    def counted(*args, **kwargs):
        counter.graphs += 1
        counter.capturing = True
        try:
            return run(*args, **kwargs)
        finally:
            counter.capturing = False
    return counted


def step_ops() -> dict[str, dict[str, dict[str, int]]]:
    """Ops per step for plain decoding (batch 1) and the paper tree at batch 1 and 16, eager and captured."""
    model = eight_b_shaped()
    attach_forward(model, "fast")
    gpu_like(target_forward(model))
    runs = {"plain": (1, 1), "spec_b1": (1, PAPER_TREE[0]), "spec_b16": (16, PAPER_TREE[0])}
    return {mode: {name: count_step(model, captured, batch, size) for name, (batch, size) in runs.items()}
            for mode, captured in (("eager", None), ("captured", "eager"))}


def merge_ops(batch: int, mode: str, parts: int = 2) -> int:
    """Aten ops of a merged proposer's merge for `batch` sequences of `parts` paper-sized trees (drafting
    excluded): stacking the trees, reading their means and merging them (`Merged.combine`), budget merges with
    the single-tree budget."""
    generator = torch.Generator().manual_seed(0)
    drafted = [[random_tree(PAPER_TREE[0], PAPER_TREE[1], 64, generator, root=b) for _ in range(parts)]
               for b in range(batch)]
    budget = PAPER_TREE[0] - 1
    shares = [[budget // parts] * (parts - 1) + [budget - (parts - 1) * (budget // parts)]] * batch
    counter = OpCounter()
    with counter:
        stack = stack_trees(drafted)
        stack_means(stack)
        merge_stack(stack, mode, budget, shares if mode == "budget" else None)
    return counter.outside
