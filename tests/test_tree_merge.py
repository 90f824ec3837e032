"""The batched device merges (drafting/tree_merge.py) against the per-node Python reference they replaced, on
random trees with repeated tokens (so paths repeat within and across trees), and their host-sync budget."""

from __future__ import annotations

import math

import pytest
import torch

from taps_ray.drafting.tree import DraftTree, build_tree, path_scores, ranked_nodes, subtree
from taps_ray.drafting.tree_merge import merge_stack
from taps_ray.drafting.tree_stack import stack_means, stack_trees
from taps_ray.syncs import SyncCounter

# --- the reference: the merges as combine.py ran them, node by node on the host ------------------------------


def ref_merge(trees: list[DraftTree], dedup: bool) -> DraftTree:
    tokens, parents, confidence, entropy, source = [int(trees[0].tokens[0])], [-1], [], [], []
    existing: dict[tuple[int, int], int] = {}
    for index, tree in enumerate(trees):
        node_of = [0] * tree.size
        tree_tokens, tree_parents = tree.tokens.tolist(), tree.parents.tolist()
        for j in range(1, tree.size):
            key = (node_of[tree_parents[j]], tree_tokens[j])
            if dedup and key in existing:
                node_of[j] = existing[key]
                continue
            node_of[j] = len(tokens)
            existing.setdefault(key, node_of[j])
            tokens.append(tree_tokens[j])
            parents.append(key[0])
            confidence.append(float(tree.confidence[j - 1]))
            entropy.append(float(tree.entropy[j - 1]))
            source.append(index)
    return build_tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(confidence), torch.tensor(entropy),
                      torch.tensor(source, dtype=torch.long))


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[tuple[int, ...]] = [()]
    for j in range(1, tree.size):
        paths.append(paths[parents[j]] + (tokens[j],))
    return paths


def ref_budget(trees: list[DraftTree], budget: int, shares: list[int]) -> DraftTree:
    ranked, paths = [ranked_nodes(t) for t in trees], [_paths(t) for t in trees]
    taken, present = [0] * len(trees), set()

    def take(i: int) -> bool:
        path = paths[i][ranked[i][taken[i]]]
        taken[i] += 1
        if path in present:
            return False
        present.add(path)
        return True

    for i in range(len(trees)):
        added = 0
        while added < shares[i] and taken[i] < len(ranked[i]) and len(present) < budget:
            added += take(i)
    while len(present) < budget and any(taken[i] < len(ranked[i]) for i in range(len(trees))):
        for i in range(len(trees)):
            if len(present) < budget and taken[i] < len(ranked[i]):
                take(i)
    return ref_merge([subtree(t, ranked[i][: taken[i]]) for i, t in enumerate(trees)], dedup=True)


def ref_rank(trees: list[DraftTree], budget: int) -> tuple[DraftTree, tuple[int, ...]]:
    ranked, paths = [ranked_nodes(t) for t in trees], [_paths(t) for t in trees]
    entries = sorted((-path_scores(t)[j], i, position) for i, t in enumerate(trees)
                     for position, j in enumerate(ranked[i]))
    taken, added, present = [0] * len(trees), [0] * len(trees), set()
    for _, i, position in entries:
        if len(present) >= budget:
            break
        taken[i] = position + 1
        path = paths[i][ranked[i][position]]
        if path not in present:
            present.add(path)
            added[i] += 1
    return ref_merge([subtree(t, ranked[i][: taken[i]]) for i, t in enumerate(trees)], dedup=True), tuple(added)


# --- random trees --------------------------------------------------------------------------------------------


def random_tree(generator: torch.Generator, root: int, size: int, tokens: int = 3) -> DraftTree:
    """Parents before children, tokens from a tiny alphabet (paths repeat), confidences that shrink with depth
    but tie often (rounded), so the rankings' tie rules are exercised."""
    parents = [-1] + [int(torch.randint(0, j, (), generator=generator)) for j in range(1, size)]
    conf = [1.0]
    for j in range(1, size):
        conf.append(conf[parents[j]] * round(float(torch.rand((), generator=generator)) * 4) / 4)
    values = torch.randint(0, tokens, (size,), generator=generator)
    values[0] = root
    return build_tree(values, torch.tensor(parents), torch.tensor(conf[1:]),
                      torch.rand(size - 1, generator=generator))


def random_batch(seed: int, batch: int, parts: int) -> list[list[DraftTree]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batch):
        sizes = [int(torch.randint(1, 12, (), generator=generator)) for _ in range(parts)]
        out.append([random_tree(generator, root=7 + b, size=n) for n in sizes])
    return out


def assert_same(got: DraftTree, want: DraftTree) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert got.source.tolist() == want.source.tolist()
    assert torch.equal(got.confidence, want.confidence) and torch.equal(got.entropy, want.entropy)
    assert torch.equal(got.mask, want.mask) and torch.equal(got.depth, want.depth)
    assert got.is_chain == bool((want.parents == torch.arange(-1, want.size - 1)).all())


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_batched_merges_equal_the_reference(seed, parts):
    trees = random_batch(seed, batch=12, parts=parts)
    stack = stack_trees(trees)
    for mode in ("concat", "dedup"):
        merged, _ = merge_stack(stack, mode)
        for got, row in zip(merged, trees, strict=True):
            assert_same(got, ref_merge(row, dedup=mode == "dedup"))
    for budget in (1, 3, 7, 40):
        merged, added = merge_stack(stack, "rank", budget)
        for got, counts, row in zip(merged, added, trees, strict=True):
            want, want_counts = ref_rank(row, budget)
            assert_same(got, want)
            assert counts == want_counts
        shares = [[(budget * (b + p)) // (parts + 1) for p in range(parts)] for b in range(len(trees))]
        merged, _ = merge_stack(stack, "budget", budget, shares)
        for got, row, row_shares in zip(merged, trees, shares, strict=True):
            assert_same(got, ref_budget(row, budget, row_shares))


def test_means_are_the_trees_own():
    trees = random_batch(5, batch=6, parts=2)
    for row, means in zip(trees, stack_means(stack_trees(trees)), strict=True):
        for tree, (confidence, entropy) in zip(row, means, strict=True):
            assert math.isclose(confidence, tree.mean_confidence, rel_tol=1e-6, abs_tol=1e-12)
            assert math.isclose(entropy, tree.mean_entropy, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.parametrize(("mode", "budget", "reads"), [("concat", None, 0), ("dedup", None, 1), ("rank", 5, 1),
                                                       ("budget", 5, 1)])
def test_a_batch_merges_with_at_most_one_host_read(mode, budget, reads):
    """Whatever the batch: the reference merge reads nothing back, the others read the batch's sizes once."""
    for batch in (1, 16):
        trees = random_batch(9, batch=batch, parts=2)
        shares = [[3, 2]] * batch if mode == "budget" else None
        with SyncCounter() as counter:
            merge_stack(stack_trees(trees), mode, budget, shares)
        assert counter.syncs == reads, counter.by_name
