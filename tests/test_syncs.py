"""The decoding loop's host-sync budget (taps_ray/syncs.py), and the batched pieces that keep it: drafting S
sequences in one pass gives each sequence's own tree, and greedy acceptance of a batch in one pass gives each
tree's own verdict."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from taps_ray.config import TreeConfig
from taps_ray.decoding.generate import run_loop
from taps_ray.decoding.target_batch import TargetBatch, results_to
from taps_ray.decoding.verify import POINT_MASS, SamplingParams
from taps_ray.drafting.combine import ConfidenceRouted, Merged, single_heads
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, draft_eagle2
from taps_ray.drafting.tree import build_tree, trees_to
from taps_ray.models.draft_head import new_head
from taps_ray.models.stacked_head import StackedHead
from taps_ray.syncs import SyncCounter, to_device

from numerics import assert_same_tree, rounding_rtol, tree_rtol
from oracles import greedy_path

TREE = TreeConfig(total_token=8, depth=3, top_k=3)
# The budget: syncs per step of the in-process loop, whatever the batch and temperature (measured: 3 — acceptance,
# the trees' node values, drafting; reports/host_overhead.md).
SYNC_BUDGET = 4


def test_counter_counts_what_would_sync_on_a_gpu():
    x, mask = torch.arange(6), torch.tensor([True, False] * 3)
    with SyncCounter() as counter:
        int(x[0]), float(x[1]), bool(x[2]), x.tolist(), x[1].item(), x.nonzero(), x[mask], x.cpu()
        y = x * 2 + x.sum()  # device work only
        torch.tensor([1, 2], device=x.device)  # a blocking copy on a GPU
        torch.tensor([1, 2])  # a host tensor
        z = to_device([3, 4], x.device)  # pinned and non-blocking on a GPU
    assert counter.syncs == 9 and counter.uploads == 2, counter.by_name
    assert counter.by_name["bool index"] == 1 and counter.by_name["upload"] == 1 and y.shape == (6,)
    assert z.tolist() == [3, 4] and z.device == x.device


class _Steps:
    """A `TargetBatch` that counts its steps and keeps the prefill's syncs out of the count."""

    def __init__(self, batch: TargetBatch, counter: SyncCounter) -> None:
        self.batch, self.counter, self.steps, self.start_syncs = batch, counter, 0, 0

    def start(self, prompts, params, seeds):
        before = self.counter.syncs
        out = self.batch.start(prompts, params, seeds)
        self.start_syncs = self.counter.syncs - before
        return out

    def step(self, trees):
        self.steps += 1
        return self.batch.step(trees)


def _syncs_per_step(target, proposer, batch: int, params: SamplingParams) -> float:
    prompts = [[10 + b, 20 + 3 * b, 30, 40 + b, 50][: 3 + b % 3] for b in range(batch)]  # ragged lengths
    counter = SyncCounter()
    verifier = _Steps(TargetBatch(target.model), counter)
    with counter:
        run_loop(verifier, proposer, prompts, params, 6, stop_ids=[])
    return (counter.syncs - verifier.start_syncs) / verifier.steps


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)])
def test_syncs_per_step_do_not_grow_with_the_batch(tiny_target, params):
    """Greedy and sampled steps alike: acceptance is one vectorised pass for the batch at every temperature."""
    head = new_head(tiny_target.model.config, seed=0)
    proposer = SingleHead("random", head, DraftContext(tiny_target.model.get_input_embeddings(),
                                                       tiny_target.model.lm_head), TREE)
    one, eight = (_syncs_per_step(tiny_target, proposer, batch, params) for batch in (1, 8))
    assert one <= SYNC_BUDGET and eight <= SYNC_BUDGET and eight <= one + 2, (one, eight)


@pytest.mark.parametrize(("mode", "extra"), [(None, 0), ("concat", 0), ("dedup", 1), ("budget", 1)])
def test_routed_and_merged_syncs_per_step_do_not_grow_with_the_batch(tiny_target, mode, extra):
    """Two heads routed (`mode` None) or merged: the trees are stacked, their means read and merged for the batch
    on the device, so a step syncs as a single head's does, plus the merged trees' sizes where a trie merge
    decides them (before: 16 and 100 syncs per step at batch 1 and 8 merged, 28 and 196 budget-merged)."""
    heads = [(name, new_head(tiny_target.model.config, seed=seed)) for name, seed in (("a", 1), ("b", 2))]
    context = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    parts = single_heads(heads, context, TREE)
    proposer = ConfidenceRouted(parts) if mode is None else Merged(parts, mode=mode, budget=TREE.total_token - 1)
    one, eight = (_syncs_per_step(tiny_target, proposer, batch, SamplingParams()) for batch in (1, 8))
    assert one == eight <= SYNC_BUDGET + extra, (one, eight)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("min_confidence", [0.0, 0.05])
def test_batched_drafting_gives_each_sequence_its_own_trees(tiny_target, stacked, min_confidence):
    """Sequences of different cache lengths and different numbers of new positions, drafted together over two
    steps, get the trees each drafts alone (up to rounding: batched rows run other kernels)."""
    config = tiny_target.model.config
    heads = [new_head(config, seed=1), new_head(config, seed=2)]
    ctx = DraftContext(tiny_target.model.get_input_embeddings(), tiny_target.model.lm_head)
    head = StackedHead(heads) if stacked else heads[0]
    generator = torch.Generator().manual_seed(0)
    counts = [[5, 2], [3, 4], [7, 1]]  # per sequence: new positions at the first and the second call
    inputs = [[(torch.randn(m, config.hidden_size, generator=generator),
                torch.randint(0, config.vocab_size, (m,), generator=generator)) for m in seq] for seq in counts]
    tree = TREE.model_copy(update={"min_confidence": min_confidence})
    batch_caches, alone_caches = [HeadCache() for _ in counts], [HeadCache() for _ in counts]
    for call in range(2):
        feats = [seq[call][0] for seq in inputs]
        tokens = [seq[call][1] for seq in inputs]
        together, batch_caches = draft_eagle2(head, ctx, batch_caches, feats, tokens, tree)
        for s in range(len(counts)):
            (alone,), (alone_caches[s],) = draft_eagle2(head, ctx, [alone_caches[s]], [feats[s]], [tokens[s]], tree)
            assert len(together[s]) == len(alone) == head.stacked
            for got, want in zip(together[s], alone):
                assert_same_tree(got, want, tree_rtol(config.hidden_size, TREE.depth))
                assert got.is_chain == bool((want.parents == torch.arange(-1, want.size - 1)).all())
            assert batch_caches[s].length == alone_caches[s].length
            rtol = rounding_rtol(config.hidden_size, chained=2)  # fc, then the key projection
            for got_kv, want_kv in zip(batch_caches[s].kv, alone_caches[s].kv):
                torch.testing.assert_close(got_kv, want_kv, rtol=rtol, atol=rtol)


def test_batched_greedy_acceptance_equals_per_tree_acceptance():
    """Random trees (duplicate tokens, so equal-depth ties happen) and logits: the vectorised verdicts are the
    per-tree reference walk's (`oracles.greedy_path`), nodes, tokens and bonus; rows padded to the widest tree."""
    generator = torch.Generator().manual_seed(0)
    trees, logits = [], []
    for _ in range(60):
        size = int(torch.randint(1, 12, (), generator=generator))
        parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, size)]
        trees.append(build_tree(torch.randint(0, 3, (size,), generator=generator), torch.tensor(parents)))
        logits.append(torch.randn(size, 3, generator=generator))
    padded = torch.nn.utils.rnn.pad_sequence(logits, batch_first=True)
    accepted = 0
    for tree, row_logits, verdict in zip(trees, logits, POINT_MASS.verdicts(trees, padded, [SamplingParams()] * 60)):
        want = greedy_path(tree, row_logits.argmax(-1))
        assert (verdict.nodes, verdict.tokens, verdict.bonus) == (want.nodes, want.tokens, want.bonus)
        accepted += want.accepted
    assert accepted > 20  # the comparison covered accepted paths, not only root-only verdicts


class _Copies(TorchFunctionMode):
    """Counts `Tensor.to` calls (device copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") == "to"
        return func(*args, **(kwargs or {}))


def test_trees_and_results_cross_devices_a_batch_at_a_time(tiny_target):
    """`trees_to` / `results_to` move a step's trees and results in one copy per field kind, not one per field and
    sequence, and give back every field as it was (None kept). `cpu:0` is another device name for the CPU, so the
    moving path runs here on real values; on a GPU the smoke test moves them for real."""
    head = new_head(tiny_target.model.config, seed=0)
    proposer = SingleHead("random", head, DraftContext(tiny_target.model.get_input_embeddings(),
                                                       tiny_target.model.lm_head), TREE)
    batch = TargetBatch(tiny_target.model, keep_logits=True)
    started = batch.start([[10, 20, 30], [40, 50], [60, 70, 80, 90]], SamplingParams(), [0, 1, 2])
    trees, _ = proposer.propose_batch([proposer.init_state() for _ in started], [c.features for c in started],
                                      [c.next_tokens for c in started])
    trees = [trees[0], None, trees[2]]
    with _Copies() as copies:
        moved = trees_to(trees, "cpu:0")
    assert moved[1] is None and copies.count == 3  # integer fields, float fields, masks
    for got, want in zip(moved, trees):
        if want is not None:
            for name in ("tokens", "parents", "depth", "mask", "confidence", "entropy", "source"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert got.chain == want.chain and got.retrieve.tolist() == want.retrieve.tolist()
    stepped = batch.step([trees[0], trees[1] or trees[0], trees[2]])
    results = [stepped[0], None, stepped[2]]
    with _Copies() as copies:
        back = results_to(results, "cpu:0")
    assert back[1] is None and copies.count == 3  # features, next tokens, logits
    for got, want in zip(back, results):
        if want is not None:
            assert got.tokens == want.tokens and got.verdict == want.verdict
            for name in ("features", "next_tokens", "logits"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert trees_to(trees, "cpu")[0] is trees[0] and results_to(results, "cpu")[0] is results[0]  # already there
