"""The target side of decoding: a batch of sequences sharing one right-padded KV cache.

Sequence b occupies cache slots 0..lengths[b]-1. A verification step appends every sequence's (padded)
tree after the longest sequence, runs one forward with a per-sequence 4-D mask and positions, then moves
each sequence's accepted slots down to its own length and crops the cache. When no mask is needed (every
sequence fills the cache and drafted a chain of the same size, as plain decoding does) the forward takes the
model's standard causal path and the commit only crops. Plain decoding is the same step
with a one-node tree, so speedups compare like with like. A finished sequence (tree None) leaves the cache, so
the forward of a batch's tail computes only the sequences still decoding. The Ray pool shares one batch
between sessions: it merges batches, steps only the rows whose trees arrived and evicts rows, through the
batch's own methods, so the cache invariant has one owner.

The cache is preallocated (`models/kv_cache.py`): forwards write into it in place, a commit gathers accepted
slots down in place and crops by moving a number, evicted rows are dropped by index. The forward is the
model's attached one (`models/target_forward.py`): taps' own Llama forward or transformers'.

Every tensor lives on the model's device; trees drafted elsewhere are moved here. What a step
hands back (`Committed`) owns its storage, never a view into the batch's tensors, so shipping one sequence's
result (pickling it to a Ray drafter) ships that sequence's rows only.
The features handed to proposers are the target's post-norm last layer (EAGLE-2, HASS) or, with
`feature_layers` (EAGLE-3 proposers, `proposers.feature_layers`), the hidden states of those layers
concatenated; the target then also returns its intermediate layers, which costs nothing otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from taps_ray.decoding.captured_step import StepGraph, bucket, step_graph
from taps_ray.decoding.verify import (
    POINT_MASS, AcceptanceRule, PointMass, SamplingParams, Verdict, position_uniforms, target_choices, verdicts_of,
)
from taps_ray.drafting.tree import DraftTree, PaddedTrees, pad_trees, packed_fields, trees_to
from taps_ray.models.kv_cache import KVCache
from taps_ray.models.target_forward import TargetForward, target_forward
from taps_ray.syncs import to_device

if TYPE_CHECKING:  # an annotation only: importing the class loads transformers' model code (a drafter imports this)
    from transformers import PreTrainedModel


# (ids [B, T], positions [B, T], boolean mask [B, 1, T, S] or None) -> (post-norm hidden, proposer features)
StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Committed:
    """What one sequence gained in a step, and what its proposer needs next."""

    tokens: list[int]  # output tokens produced: accepted drafts + bonus (the first token at start)
    features: torch.Tensor  # [m, d] target features of the newly committed positions
    next_tokens: torch.Tensor  # [m] the token after each of those positions; the last is the next root
    verdict: Verdict | None = None
    logits: torch.Tensor | None = None  # with `keep_logits`: [len(tokens), V] the target's logits at each token

    def target_logprobs(self) -> torch.Tensor:
        """[len(tokens), V] log-probabilities of the target's raw distribution at each committed token; computed
        only when asked (the batch must keep logits)."""
        if self.logits is None:
            raise ValueError("this batch did not keep the target's logits (TargetBatch(keep_logits=True))")
        return torch.log_softmax(self.logits.float(), dim=-1)


def results_to(results: list[Committed | None], device: torch.device | str) -> list[Committed | None]:
    """A step's results (None kept) on `device` in one copy per tensor field for all of them, not one per
    field and sequence: a GPU target worker shipping a session's results to its drafter syncs two or three times."""
    device = torch.device(device)
    moving = [c for c in results if c is not None and c.features.device != device]
    if not moving:
        return list(results)
    counts = [c.next_tokens.numel() for c in moving]
    features = torch.cat([c.features for c in moving]).to(device).split(counts)
    next_tokens = torch.cat([c.next_tokens for c in moving]).to(device).split(counts)
    logits = (torch.cat([c.logits for c in moving]).to(device).split(counts) if moving[0].logits is not None
              else [None] * len(moving))
    moved = {id(c): Committed(c.tokens, f, t, c.verdict, x)
             for c, f, t, x in zip(moving, features, next_tokens, logits)}
    return [None if c is None else moved.get(id(c), c) for c in results]


@dataclass
class TreeOutput:
    """What the target computed for one prompt at prefill."""

    logits: torch.Tensor  # [1, V]: the last token's only
    hidden: torch.Tensor  # [T, d] post-norm features, or [T, k*d] the batch's `feature_layers`


class TargetBatch:
    """Sequences are numbered in the order they joined: `start`'s prompts, then each `merge`d batch's.

    One way to step, `step(trees, rows=None)`, read two ways by its two callers:
    * without `rows` (the engine loop's): trees indexed by sequence; a None tree means the sequence is done for
      good and its row leaves the cache (`live` says which sequence each row holds).
    * with `rows` (the Ray pool's and the continuous batcher's): trees for those cache rows only; the other rows,
      and rows whose tree is None, sit this step out and keep their cache and length. `keep_rows` evicts.
    `forward_trees` is the step's forward alone (no acceptance, no commit): benchmarks and tests read every
    node's logits through it, then `commit` what they keep.

    Sequence b draws its tokens at T > 0 with the uniforms of its seed and each position (`position_uniforms`),
    so a row's tokens depend on its prompt, parameters and seed only, whoever shares the forward.

    Sampling parameters are per row (`row_params`), so requests with different parameters share one forward.
    `keep_logits`: every `Committed` carries the target's logits at its tokens, for callers that report
    log-probabilities.
    `feature_layers`: the `hidden_states` indices whose concatenation is every `Committed.features` (EAGLE-3);
    empty: the post-norm last layer. `forward`: the target forward to verify with instead of the model's
    attached one (a benchmark compares both on one model). `acceptance`: the rule that decides what a step keeps.
    """

    def __init__(
        self, model: PreTrainedModel, keep_logits: bool = False, feature_layers: Sequence[int] = (),
        forward: TargetForward | None = None, acceptance: AcceptanceRule = POINT_MASS,
    ) -> None:
        self.model = model
        self.device: torch.device = model.device  # read once: transformers' `device` walks the parameters
        self.acceptance = acceptance
        self.keep_logits = keep_logits
        self.feature_layers = tuple(feature_layers)
        # taps' fast forward or transformers' (`target.forward`, attached at load); `forward` overrides it
        self.target_forward = forward if forward is not None else target_forward(model)
        self.cache = KVCache(self.target_forward.num_layers)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.host_lengths: list[int] = []  # the same on the host: the step's bookkeeping reads these, no sync
        self.row_params: list[SamplingParams] = []
        self.seeds = torch.zeros(0, dtype=torch.long, device=self.device)
        self.live: list[int] = []  # the sequence (numbered as it joined) in each cache row
        self.joined = 0  # sequences numbered so far
        self.timings = {"forward": 0.0, "accept": 0.0, "commit": 0.0}  # seconds, summed over steps (profiling)

    @torch.no_grad()
    def start(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], seeds: list[int]
    ) -> list[Committed]:
        """Prefill and pick each sequence's first token; sequence b samples with its own seed and its own
        parameters (one `SamplingParams` for all, or one per prompt)."""
        self._take_requests(prompts, params, seeds)
        return self._first_tokens(prompts, self.prefill(prompts))

    def _take_requests(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                       seeds: list[int]) -> None:
        """The new sequences' sampling parameters and seeds, checked against the prompts."""
        row_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(row_params) != len(prompts):
            raise ValueError(f"got {len(row_params)} sampling parameters for {len(prompts)} prompts")
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        self.row_params = row_params
        self.seeds = to_device(seeds, self.device, torch.long)

    def _first_tokens(self, prompts: list[list[int]], outputs: list[TreeOutput]) -> list[Committed]:
        """Each prefilled sequence's first token, drawn from its last logits, and what its proposer needs."""
        self.live = list(range(len(prompts)))
        self.joined = len(prompts)
        last = torch.cat([out.logits for out in outputs])[:, None]  # [B, 1, V]
        uniforms = position_uniforms(self.seeds, self.lengths[:, None])  # the token at position len(prompt)
        roots = target_choices(last, self.row_params, uniforms)[:, 0].tolist()  # one read for the batch
        started = []
        for prompt, out, root in zip(prompts, outputs, roots, strict=True):
            logits = out.logits.clone() if self.keep_logits else None
            next_tokens = to_device(prompt[1:] + [root], self.device)
            started.append(Committed([root], out.hidden.clone(), next_tokens, logits=logits))  # clones: own storage
        return started

    @torch.no_grad()
    def step(self, trees: list[DraftTree | None], rows: list[int] | None = None) -> list[Committed | None]:
        """Verify the trees in one forward, accept, and commit the accepted tokens to the cache. Without `rows`,
        `trees` is indexed by sequence and the rows of sequences whose tree is None (finished) leave the cache
        first; with `rows`, `trees` belongs to those cache rows (None sits out) and the other rows keep their
        cache and length."""
        if rows is None:
            return self._step_sequences(trees)
        return self._step_rows(rows, trees)

    def _step_sequences(self, trees: list[DraftTree | None]) -> list[Committed | None]:
        """`step` by sequence: finished sequences' rows leave the cache, the rest step as one batch."""
        results: list[Committed | None] = [None] * len(trees)
        rows = [row for row, b in enumerate(self.live) if trees[b] is not None]
        if not rows:
            return results
        if len(rows) < len(self.live):
            self.keep_rows(rows)
        for b, result in zip(self.live, self._step([trees[b] for b in self.live])):
            results[b] = result
        return results

    def _step_rows(self, rows: list[int], trees: list[DraftTree | None]) -> list[Committed | None]:
        """`step` for the cache rows `rows` only. Two ways, whichever moves less: when at least half the rows
        step, one forward over the whole batch in place, the rows sitting out with no tree (a padding node each
        that attends only itself and is dropped at commit: no cache is copied); when fewer do, their caches are
        copied out, stepped as a batch of their own and written back (a copy of a few rows instead of padded
        rows for all the others)."""
        if len(rows) * 2 >= self.batch_size:
            by_row: list[DraftTree | None] = [None] * self.batch_size
            for row, tree in zip(rows, trees, strict=True):
                by_row[row] = tree
            results = self._step(by_row)
            return [results[row] for row in rows]
        sub = self._take_rows(rows)
        out = sub._step(trees)
        self._put_rows(rows, sub)
        return out

    def merge(self, other: TargetBatch, max_rows: int | None = None) -> None:
        """Append `other`'s sequences after these (a request joins a running batch between steps); rows keep
        their own sampling parameters and seeds. `max_rows`: the most sequences this batch will hold, the cap on
        its cache's growth (`KVCache.merge`).

        Slots beyond a sequence's length are never attended (the context is masked by `lengths`), so
        zero-padding the narrower cache keeps the invariant "cache width = longest sequence" and every value.
        """
        if self.model is not other.model or self.feature_layers != other.feature_layers:
            raise ValueError("only batches of the same model and feature layers can share a forward")
        if self.batch_size == 0:
            self.cache = other.cache
        else:
            self.cache.merge(other.cache, max_rows)
        self._set_lengths([*self.host_lengths, *other.host_lengths])
        self.seeds = torch.cat([self.seeds, other.seeds])
        self.row_params = [*self.row_params, *other.row_params]
        self.live = [*self.live, *(self.joined + b for b in other.live)]
        self.joined += other.joined

    @property
    def joins_in_step(self) -> bool:
        """Whether new sequences can be prefilled inside a step's forward (`step_joining`): taps' fast forward,
        eager, over a target without sliding windows."""
        return bool(getattr(self.target_forward, "joins_prompts", False)) and self._step_graph() is None

    @torch.no_grad()
    def step_joining(
        self, trees: list[DraftTree | None], newcomer: TargetBatch, prompts: list[list[int]],
        params: list[SamplingParams], seeds: list[int],
    ) -> tuple[list[Committed | None], list[Committed]]:
        """`step(trees, rows=every row)` and `newcomer.start(prompts, params, seeds)` in ONE target forward
        (`FastLlama.with_prompts`): a joining request's prefill costs its own tokens' compute rather than another
        pass over the weights, and the running rows do not wait for a prefill of their own. The caller then
        `merge`s the newcomer, as after `start`. Returns the step's results and the newcomers' first tokens."""
        if len(trees) != self.batch_size or all(tree is None for tree in trees):
            raise ValueError(f"got {len(trees)} trees for a batch of {self.batch_size} sequences (at least one tree)")
        if not self.joins_in_step:
            raise ValueError("this target's forward cannot prefill inside a step (transformers' forward, a compiled "
                             "or captured step, or sliding-window layers): prefill with `start`, then `merge`")
        if newcomer.model is not self.model or newcomer.feature_layers != self.feature_layers or newcomer.batch_size:
            raise ValueError("the newcomer must be an empty batch of the same model and feature layers")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        newcomer._take_requests(prompts, params, seeds)
        newcomer._set_lengths([len(p) for p in prompts])
        newcomer.cache.reset(len(prompts))
        prompt_ids = [to_device(p, self.device, torch.long) for p in prompts]
        outputs: list[TreeOutput] = []

        def forward(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            hidden, features, prompt_hidden, prompt_features = self.target_forward.with_prompts(
                ids, positions, mask, self.cache, prompt_ids, newcomer.cache, self.feature_layers)
            newcomer.cache.advance(max(len(p) for p in prompts))
            last = self.target_forward.logits(torch.stack([h[-1] for h in prompt_hidden]))  # [n, V]
            outputs.extend(TreeOutput(last[i : i + 1], f) for i, f in enumerate(prompt_features))
            return hidden, features

        results = self._step(trees, forward)
        return results, newcomer._first_tokens(prompts, outputs)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the cache rows `keep` (in that order), cropped to the longest sequence left."""
        if not keep:
            raise ValueError("keep at least one row (drop the whole batch instead)")
        index = to_device(keep, self.device, torch.long)
        lengths = [self.host_lengths[i] for i in keep]
        self.cache.keep_rows(keep, max(lengths))  # in place: the buffers are kept
        self._set_lengths(lengths)
        self.seeds = self.seeds[index]
        self.row_params = [self.row_params[i] for i in keep]
        self.live = [self.live[i] for i in keep]

    def _take_rows(self, rows: list[int]) -> TargetBatch:
        """A new batch holding copies of the caches of `rows`."""
        index = to_device(rows, self.device, torch.long)
        lengths = [self.host_lengths[i] for i in rows]
        width = max(lengths)
        sub = TargetBatch(self.model, self.keep_logits, self.feature_layers, self.target_forward, self.acceptance)
        sub.row_params = [self.row_params[i] for i in rows]
        sub.cache = self.cache.take_rows(index, width)
        sub._set_lengths(lengths)
        sub.seeds = self.seeds[index]
        return sub

    def _put_rows(self, rows: list[int], sub: TargetBatch) -> None:
        """Write a stepped sub-batch (from `_take_rows`) back into its rows; the other rows keep their caches.
        Only slots from the rows' shortest old length on can have changed (a commit moves nothing below a
        sequence's length), so only those are written back."""
        index = to_device(rows, self.device, torch.long)
        lengths = list(self.host_lengths)
        since = min(lengths[row] for row in rows)
        for row, length in zip(rows, sub.host_lengths, strict=True):
            lengths[row] = length
        self.cache.put_rows(index, sub.cache, since)
        self._set_lengths(lengths)

    def _step(self, trees: list[DraftTree | None], forward: StepForward | None = None) -> list[Committed | None]:
        """Verify, accept and commit; `forward`: the step's forward when it also prefills newcomers
        (`step_joining`), which the captured graph never does."""
        trees = trees_to(trees, self.device)
        if all(tree is None for tree in trees):
            return [None] * len(trees)
        graph = self._step_graph() if forward is None else None
        if graph is not None:
            return self._captured_step(graph, trees)
        t0 = time.perf_counter()
        logits, features, padded = self.forward_trees(trees, forward)
        t1 = time.perf_counter()
        uniforms = None
        if not all(row.greedy for row in self.row_params):  # the draws for positions length + 1 .. length + W
            after_root = torch.arange(1, logits.shape[1] + 1, device=self.device)
            uniforms = position_uniforms(self.seeds, self.lengths[:, None] + after_root)
        verdicts = self.acceptance.verdicts(padded, logits, self.row_params, uniforms)
        t2 = time.perf_counter()
        self.commit([v.nodes if v is not None else [] for v in verdicts])
        t3 = time.perf_counter()
        for key, seconds in (("forward", t1 - t0), ("accept", t2 - t1), ("commit", t3 - t2)):
            self.timings[key] += seconds
        return [  # indexing by a list copies: each result owns its rows
            None if verdict is None else self._committed(
                verdict, features[b, verdict.nodes], logits[b, verdict.nodes] if self.keep_logits else None)
            for b, verdict in enumerate(verdicts)
        ]

    def _committed(self, verdict: Verdict, features: torch.Tensor, logits: torch.Tensor | None) -> Committed:
        """A row's result from its verdict and the features (and logits) of its accepted nodes."""
        tokens = verdict.tokens[1:] + [verdict.bonus]
        return Committed(tokens, features, to_device(tokens, self.device), verdict, logits)

    def _step_graph(self) -> StepGraph | None:
        """The captured step (`target.compile: step`, decoding/captured_step.py) where it covers this step: taps'
        fast forward built for it, the point-mass acceptance, one `SamplingParams` for every row."""
        forward = self.target_forward
        if getattr(forward, "captured", None) is None or type(self.acceptance) is not PointMass:
            return None
        if len(set(self.row_params)) != 1:
            return None
        return step_graph(forward, self.row_params[0], self.feature_layers, self.keep_logits,
                          compiled=forward.captured == "compile")

    def _captured_step(self, graph: StepGraph, trees: list[DraftTree | None]) -> list[Committed | None]:
        """`_step` through the captured graph: the trees padded to the bucket, one launch, one read of the paths;
        the graph moved the accepted slots itself. A cache whose capacity a sliding window does not span steps
        eager."""
        t0 = time.perf_counter()
        batch, rows = len(trees), bucket(len(trees))
        width = bucket(max(t.size for t in trees if t is not None))
        keys, values = self.cache.reserve(rows, self.cache.width + width)
        if not graph.covers(keys[0].shape[2]):
            graph.forward.captured = None  # for good: the cache only grows
            return self._step(trees)
        tokens, parents, sizes = packed_fields(trees, rows, width, self.device)
        lengths = F.pad(self.lengths, (0, rows - batch))
        uniforms = None
        if not graph.params.greedy:  # the draws for positions length + 1 .. length + width
            seeds = F.pad(self.seeds, (0, rows - batch))
            uniforms = position_uniforms(seeds, lengths[:, None] + torch.arange(1, width + 1, device=self.device))
        start = to_device(self.cache.width, self.device, torch.long)
        packed, features, logits = graph(keys, values, tokens, parents, sizes, lengths, start, uniforms)
        t1 = time.perf_counter()
        verdicts = verdicts_of(packed, [tree is not None for tree in trees])  # the step's one read
        new_lengths = [length + (0 if v is None else len(v.nodes)) for length, v in zip(self.host_lengths, verdicts)]
        self.cache.stepped(max(new_lengths))
        self._set_lengths(new_lengths)
        results = [  # copies: a CUDA graph's next replay overwrites its outputs
            None if v is None else self._committed(
                v, features[b, : len(v.nodes)].clone(), None if logits is None else logits[b, : len(v.nodes)].clone())
            for b, v in enumerate(verdicts)
        ]
        self.timings["forward"] += t1 - t0
        self.timings["accept"] += time.perf_counter() - t1
        return results

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
        forward: StepForward | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-norm last layer [B, T, d], proposer features); the caller applies the LM head where it needs logits.
        `mask` None: plain causal attention over the whole cache; else a boolean [B, 1, T, S] (True = may attend).
        The forward writes its keys and values after the committed region, which then covers them. `forward`:
        one that does more in the same pass (`step_joining`); None: the target's own."""
        if forward is None:
            out = self.target_forward(input_ids, positions, mask, self.cache, self.feature_layers)
        else:
            out = forward(input_ids, positions, mask)
        self.cache.advance(input_ids.shape[1])
        return out

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> list[TreeOutput]:
        """Encode the prompts into the cache (row b: prompt b, right-padded); returns each prompt's features over its
        tokens and the logits of its last token only (the LM head over a whole prompt would cost more than the rest
        of the prefill).

        One forward per distinct length, each without a mask (plain causal attention, which the fast kernels
        take) and without padding, its keys and values written into its rows: on a CPU a padded forward computes
        every pad (one forward of prompts of 40 to 300 tokens took 1.7-1.8x the time of one per length,
        reports/ragged_prefill.md), and a padded one needs a mask, or its pads, to stay exact."""
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._set_lengths([len(p) for p in prompts])
        self.cache.reset(len(prompts))
        groups: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(row)
        if len(groups) == 1:
            return self._prefill_rows(prompts, self.cache)
        outputs: list[TreeOutput | None] = [None] * len(prompts)
        for rows in groups.values():
            part = KVCache(self.cache.num_layers, rows=len(rows))
            for row, out in zip(rows, self._prefill_rows([prompts[r] for r in rows], part), strict=True):
                outputs[row] = out
            self.cache.put_rows(to_device(rows, self.device, torch.long), part, 0)
        return outputs

    def _prefill_rows(self, prompts: list[list[int]], cache: KVCache) -> list[TreeOutput]:
        """Prompts of one length in one causal forward, written into `cache` (as many rows as prompts)."""
        ids = to_device(prompts, self.device, torch.long)
        positions = torch.arange(ids.shape[1], device=self.device).expand(len(prompts), -1)
        hidden, features = self.target_forward(ids, positions, None, cache, self.feature_layers)
        cache.advance(ids.shape[1])
        last = self.target_forward.logits(hidden[:, -1])  # [B, V]
        return [TreeOutput(last[b : b + 1], features[b]) for b in range(len(prompts))]

    @torch.no_grad()
    def forward_trees(self, trees: list[DraftTree | None], forward: StepForward | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, PaddedTrees]:
        """The forward of a step, alone: one per cache row's tree (None: the row sits out), as the batch's
        right-padded logits [B, W, V] and features [B, W, d] (W: the widest tree), which acceptance reads in one
        pass, and the padded trees both read. Nothing is accepted or committed: the trees' slots stay after the
        committed region until `commit` keeps some (a step does both; tests and benchmarks read every node)."""
        if len(trees) != self.batch_size:
            raise ValueError(f"got {len(trees)} trees for a batch of {self.batch_size} sequences")
        width = max((t.size for t in trees if t is not None), default=0)
        if width == 0:
            raise ValueError("a verification step needs at least one tree")
        padded = pad_trees(trees, width, self.device)
        past = self.cache.width
        if self._causal(trees, past):
            positions = torch.arange(past, past + width, device=self.device).expand(len(trees), -1)
            hidden, features = self._forward(padded.tokens, positions, None, forward)
        else:
            ids, positions, mask = self._tree_inputs(padded, past)
            hidden, features = self._forward(ids, positions, mask[:, None], forward)
        return self.target_forward.logits(hidden), features, padded

    def _tree_inputs(self, trees: PaddedTrees, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ids and positions [B, W] and the boolean mask [B, W, past + W] of padded trees, in a few batched ops: a
        tree's node sees its sequence's committed slots and its ancestors; padding nodes see only themselves (no
        all-masked row, no NaN)."""
        width = trees.width
        nodes = torch.arange(width, device=self.device)
        real = nodes[None, :] < trees.sizes[:, None]  # [B, W]
        context = torch.arange(past, device=self.device)[None, :] < self.lengths[:, None]  # [B, past]
        tree_masks = trees.mask | (torch.eye(width, dtype=torch.bool, device=self.device) & ~real[:, :, None])
        mask = torch.cat([real[:, :, None] & context[:, None, :], tree_masks], dim=-1)
        positions = torch.where(real, self.lengths[:, None] + trees.depth, 0)
        return trees.tokens.clamp(min=0), positions, mask

    def _causal(self, trees: list[DraftTree | None], past: int) -> bool:
        """True when the model's own causal mask is exact: every sequence fills the cache (no context padding)
        and has a chain of the same size (no tree padding). Plain decoding and chain drafts then skip building
        a 4-D mask, which the attention kernels also run slower with."""
        if any(t is None for t in trees) or len({t.size for t in trees}) > 1:
            return False
        return all(length == past for length in self.host_lengths) and all(t.is_chain for t in trees)

    def commit(self, accepted_nodes: list[list[int]]) -> None:
        """Keep each sequence's accepted tree slots (root first) right after its committed prefix: only those
        slots move (row b's node j from slot width + j to slot length_b + i), whatever the spread of lengths."""
        lengths = self.host_lengths
        start = max(lengths)  # invariant: the committed region is as wide as the longest sequence
        new_lengths = [length + len(n) for length, n in zip(lengths, accepted_nodes, strict=True)]
        high = max(new_lengths)
        in_place = min(lengths) == start and all(nodes == list(range(len(nodes))) for nodes in accepted_nodes)
        if not in_place:  # built on the host from what it already holds, then one upload each for the batch
            most = max(len(nodes) for nodes in accepted_nodes)
            source, target = [], []
            for length, nodes in zip(lengths, accepted_nodes):
                # a row without a tree (sitting the step out) moves slot 0 onto itself: nothing changes
                pairs = [(start + n, length + i) for i, n in enumerate(nodes)] or [(0, 0)]
                pairs += [pairs[-1]] * (most - len(pairs))  # repeated: the same value to the same slot
                source.append([p for p, _ in pairs])
                target.append([t for _, t in pairs])
            self.cache.move_slots(to_device(source, self.device, torch.long),
                                  to_device(target, self.device, torch.long), high)
        else:  # every sequence kept a prefix of its slots (a chain's): nothing moves, only crop
            self.cache.crop(high)
        self._set_lengths(new_lengths)

    def _set_lengths(self, lengths: list[int]) -> None:
        """The committed lengths, on the host (what the bookkeeping reads) and on the device (what the masks,
        positions and draws read): one upload, never a read back."""
        self.host_lengths = list(lengths)
        self.lengths = to_device(self.host_lengths, self.device, torch.long)
