"""Test proposers that know the target: they make acceptance paths non-trivial on random models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from taps_ray.decoding.verify import Verdict
from taps_ray.drafting.proposer import Proposer
from taps_ray.drafting.tree import DraftTree, build_tree
from taps_ray.models.draft_head import DraftHead, new_head


@dataclass
class OracleState:
    history: list[int] = field(default_factory=list)
    step: int = 0


@dataclass
class GreedyOracle(Proposer):
    """Drafts the target's true greedy chain, wrong from a per-step depth on, with a wrong sibling per level.

    `first_token` is the prompt's first token (the loop only passes the tokens after it).
    """

    model: torch.nn.Module
    first_token: int
    depth: int = 4
    name: str = "oracle"
    head_names: list[str] = field(default_factory=lambda: ["oracle"])

    def init_state(self) -> OracleState:
        return OracleState(history=[self.first_token])

    def propose(self, state: OracleState, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, OracleState]:
        history = state.history + next_tokens.tolist()
        device = self.model.device
        chain, ids = [], torch.tensor([history], device=device)
        for _ in range(self.depth):
            token = int(self.model(ids).logits[0, -1].argmax())
            chain.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        correct = state.step % (self.depth + 1)  # 0..depth correct tokens, cycling over steps
        vocab = self.model.config.vocab_size
        tokens, parents = [history[-1]], [-1]
        parent = 0
        for level, token in enumerate(chain):
            drafted = token if level < correct else (token + 1) % vocab
            sibling = (token + 2 + level) % vocab
            tokens += [drafted, sibling]
            parents += [parent, parent]
            parent = len(tokens) - 2
        tree = build_tree(torch.tensor(tokens, device=device), torch.tensor(parents, device=device),
                          confidence=torch.rand(len(tokens) - 1, device=device))
        return tree, OracleState(history=history, step=state.step + 1)


@dataclass
class FixedTree(Proposer):
    """Always proposes the same token tree under the current root (duplicates allowed, as merged trees have)."""

    tokens: list[int]
    parents: list[int]
    name: str = "fixed"
    head_names: list[str] = field(default_factory=lambda: ["fixed"])

    def init_state(self) -> None:
        return None

    def propose(self, state: None, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[DraftTree, None]:
        device = next_tokens.device
        tokens = torch.tensor([int(next_tokens[-1])] + self.tokens, device=device)
        return build_tree(tokens, torch.tensor([-1] + self.parents, device=device)), None


@dataclass
class Recording(Proposer):
    """Wraps a proposer and keeps, per sequence (in `init_state` order), every `next_tokens` it was handed."""

    inner: object
    name: str = "recording"
    seen: list[list[int]] = field(default_factory=list)

    @property
    def head_names(self) -> list[str]:
        return self.inner.head_names

    def init_state(self) -> tuple[object, list[int]]:
        self.seen.append([])
        return self.inner.init_state(), self.seen[-1]

    def propose(self, state, features: torch.Tensor, next_tokens: torch.Tensor):
        inner, seen = state
        if features.shape[0] != next_tokens.shape[0]:
            raise AssertionError("one feature per next token")
        seen.extend(next_tokens.tolist())
        tree, inner = self.inner.propose(inner, features, next_tokens)
        return tree, (inner, seen)


def greedy_path(tree: DraftTree, target_next: torch.Tensor) -> Verdict:
    """A per-tree reference for greedy acceptance, written apart from the engine's vectorised rule to check it:
    over the root-to-leaf rows (`DraftTree.retrieve`, in DFS preorder), the first row with the most leading
    drafted tokens equal to the target's next token after their parent (`target_next` [T] long)."""
    padded = torch.cat([tree.tokens, torch.tensor([-1], device=tree.tokens.device)])
    candidates = padded[tree.retrieve]  # -1 index picks the pad slot
    predicted = target_next[tree.retrieve.clamp(min=0)]
    match = (candidates[:, 1:] == predicted[:, :-1]) & (tree.retrieve[:, 1:] >= 0)
    accepted = match.int().cumprod(dim=1).sum(dim=1)
    best = int(accepted.argmax())
    nodes = tree.retrieve[best, : int(accepted[best]) + 1].tolist()
    return Verdict(nodes=nodes, tokens=tree.tokens[nodes].tolist(), bonus=int(target_next[nodes[-1]]))


def fit_head(target, sequences: list[list[int]], seed: int = 0, steps: int = 60, lr: float = 3e-3,
             fc_bias: bool = True) -> DraftHead:
    """A draft head over-fitted to the target's own next tokens on `sequences` (e.g. the greedy continuations a
    test decodes), so real heads, and the combinations built from them, get drafts accepted on a random target.

    The head learns position p -> the target's argmax at p + 1 from (feature h_p, token x_{p+1}), as EAGLE does.
    Heads fitted from the same `seed` start from the same weights, so their average drafts sensibly too.
    The head keeps an `fc` bias unless told otherwise (heads train without one by default): on a random target
    the 60-step fit drafts with much more confidence with it, which the side-by-side tests compare at fp32
    tolerances. A head for vLLM (tests/test_interop.py) has none, as vLLM's EAGLE `fc` has none.
    """
    model, device = target.model, target.model.device
    head = new_head(model.config, seed=seed, device=device, fc_bias=fc_bias)
    embed, lm_head = model.get_input_embeddings(), model.lm_head
    batch = []
    with torch.no_grad():
        for sequence in sequences:
            ids = torch.tensor([sequence], device=device)
            features = model.model(ids).last_hidden_state
            labels = lm_head(features).argmax(-1)
            batch.append((embed(ids[:, 1:]), features[:, :-1], labels[0, 1:]))
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for tokens, features, labels in batch:
            n = labels.numel()
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
            out, _ = head(tokens, features, torch.arange(n, device=device)[None], mask)
            logits = torch.nn.functional.linear(out[0], lm_head.weight.detach())
            loss = loss + torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
    return head.eval()
