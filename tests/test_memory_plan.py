"""`taps plan`'s memory terms against what the actor kinds' work really allocates, on the tiny config on the CPU.

Each test runs one actor kind's work in-process at shapes where the terms the plan sizes matter (long answers,
several replay sessions per worker, a benchmark's traces), measures the peak bytes its tensors held (weights
and other state it had before, plus torch's allocator peak while it worked: tests/memory_peak.py), and checks
the plan's GPU need for that config (its held terms plus its largest transient; the CUDA context aside) within
20%. The plan's one data assumption, the prompt length, is set to the prompts the test decodes.
"""

from __future__ import annotations

import random

import pytest
import torch

from taps_ray import plan
from taps_ray.decoding.continuous import ContinuousBatcher, Request
from taps_ray.decoding.replay import GreedyTrace, record_traces, replay
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.registry import build_proposer, draft_reach, proposer_names
from taps_ray.drafting.tree import build_tree, root_only
from taps_ray.models.draft_head import DraftHead, DraftHeadConfig
from taps_ray.models.target import load_target
from taps_ray.training.features import target_features
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes

from memory_peak import peak_allocated

PROMPT, NEW = 300, 400  # prompt tokens (the plan's PROMPT_TOKENS here) and answer tokens
DRAFT_NEW = 120  # answer tokens of the drafter's benchmark
DRAFTERS, REPLAY_BATCH, MAX_BATCH = 4, 4, 16  # 4 drafters' replay sessions of 4 rows merge into one group
SAMPLED = SamplingParams(temperature=1.0)  # sampling verifies with a softmax beside the logits: the larger transient
TOLERANCE = 0.20


# a tiny Llama whose KV cache, not its vocabulary, dominates: 8 layers of 4 KV heads (4 KiB a token), 8,192 tokens
SHAPE = {"num_hidden_layers": 8, "num_key_value_heads": 4, "vocab_size": 8192}


@pytest.fixture(scope="module")
def cfg(tiny_config):
    target = tiny_config.target.model_copy(update={"tiny": tiny_config.target.tiny.model_copy(update=SHAPE)})
    evaluation = tiny_config.eval.model_copy(update={
        "benchmarks": {"gsm8k": 8}, "max_new_tokens": NEW, "replay_batch": REPLAY_BATCH, "batch_size": 1})
    ray = tiny_config.ray.model_copy(update={"num_drafters": DRAFTERS, "num_target_workers": 1,
                                             "max_batch": MAX_BATCH})
    return tiny_config.model_copy(update={"target": target, "eval": evaluation, "ray": ray})


@pytest.fixture(scope="module")
def target(cfg):
    return load_target(cfg.target)


@pytest.fixture(autouse=True)
def prompt_length(monkeypatch):
    monkeypatch.setattr(plan, "PROMPT_TOKENS", PROMPT)


def _need(cfg, kind: str) -> plan.Need:
    return plan.needs(cfg, plan.shapes(plan.model_config(cfg), cfg.train.kinds))[kind]


def _predicted(need: plan.Need) -> float:
    """What the plan says the actor's tensors need on its GPU, the fixed CUDA context aside."""
    return plan.total(need.gpu, (plan.HELD, plan.TRANSIENT))


def _prompts(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(rows)]


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def _close(measured: float, predicted: float, what: str) -> None:
    print(f"{what}: measured {measured / 1e6:.1f} MB, planned {predicted / 1e6:.1f} MB")
    assert abs(predicted - measured) <= TOLERANCE * measured, (
        f"{what}: the plan says {predicted / 1e6:.1f} MB, the work held {measured / 1e6:.1f} MB")


def test_target_worker_replay_sessions_and_a_full_verification(cfg, target, tmp_path):
    """A worker with its drafters' replayed cells in flight: one session of `eval.replay_batch` rows per drafter,
    merged up to `ray.max_batch` as the pool does, each decoding its whole answer and lookahead (the KV cache
    grows by doubling), then one verification forward of full trees over every row, then a drafter's features
    forward over prompt + answer."""
    model, vocab = target.model, target.model.config.vocab_size
    steps = NEW + draft_reach(cfg.tree) - 1
    nodes = cfg.tree.total_token + 1

    def work() -> list[TargetBatch]:
        groups: list[TargetBatch] = []
        roots: dict[int, list[int]] = {}
        for drafter in range(DRAFTERS):
            batch = TargetBatch(model)
            started = batch.start(_prompts(vocab, REPLAY_BATCH, PROMPT, drafter), SAMPLED, [0] * REPLAY_BATCH)
            group = next((g for g in groups if g.batch_size + REPLAY_BATCH <= MAX_BATCH), None)
            if group is None:
                groups.append(batch)
                group = batch
            else:
                group.merge(batch)
            roots.setdefault(id(group), []).extend(c.tokens[-1] for c in started)
        for group in groups:
            tokens = roots[id(group)]
            for _ in range(steps):
                tokens = [c.tokens[-1] for c in group.step([root_only(t, "cpu") for t in tokens])]
            star = torch.tensor([-1] + [0] * (nodes - 1))
            group.step([build_tree(torch.tensor([t] + [t] * (nodes - 1)), star) for t in tokens])
        groups[0].keep_rows(list(range(groups[0].batch_size - REPLAY_BATCH)))  # a drafter closed its session
        longest = _prompts(vocab, REPLAY_BATCH, PROMPT + NEW + draft_reach(cfg.tree), 99)
        TargetBatch(model).start(longest, SAMPLED, [0] * REPLAY_BATCH)  # its features forward
        return groups

    peak, groups = peak_allocated(work, tmp_path)
    need = _need(cfg, "target_worker")
    _close(_bytes(model) + peak, _predicted(need), "target worker")
    kv = sum(t.nbytes for g in groups for t in [*g.cache._keys, *g.cache._values] if t is not None)
    _close(kv, next(t.bytes for t in need.gpu if t.label.startswith("KV cache")), "its KV cache")


def test_drafter_holding_a_benchmarks_traces_and_every_heads_trees(cfg, target, tmp_path):
    """A drafter's replayed cells over one benchmark: the traces stay (eval.traces_on_host off: on its device) and
    every head of the kind being evaluated keeps the trees it drafted along them for the next proposer (held,
    counted tensor by tensor once each head replayed the benchmark); then a combination drafting a fresh batch
    (its stacked heads and its drafting), measured."""
    evaluation = cfg.eval.model_copy(update={"benchmarks": {"gsm8k": 16}, "max_new_tokens": DRAFT_NEW})
    dcfg = cfg.model_copy(update={"eval": evaluation})
    model, vocab, tree = target.model, target.model.config.vocab_size, cfg.tree
    questions = evaluation.benchmarks["gsm8k"]
    traces = []
    for start in range(0, questions, REPLAY_BATCH):  # the worker's part
        prompts = _prompts(vocab, REPLAY_BATCH, PROMPT, start)
        traces += record_traces(lambda: TargetBatch(model), prompts, DRAFT_NEW, [], draft_reach(tree))
    heads = {m: DraftHead(DraftHeadConfig.from_target(model.config, kind="hass")).eval()
             for m in dcfg.head_mixtures()}  # a drafter holds one kind's heads at a time
    for mixture in dcfg.head_mixtures():  # each head drafts along every trace once
        proposer = build_proposer(mixture, target, heads, tree)
        for start in range(0, questions, REPLAY_BATCH):
            replay(proposer, traces[start : start + REPLAY_BATCH], DRAFT_NEW, [])
    fresh = [GreedyTrace(t.prompt, t.tokens, t.features, t.lookahead) for t in traces[:REPLAY_BATCH]]
    merged = build_proposer("merged", target, heads, tree)
    peak, _ = peak_allocated(lambda: replay(merged, fresh, DRAFT_NEW, []), tmp_path)

    parts = sum(t.nbytes for t in {model.get_input_embeddings().weight, model.get_output_embeddings().weight})
    held = parts + sum(_bytes(h) for h in heads.values())
    drafted = sum(x.nbytes for t in traces for memo in t.drafted.values() for trees in memo.values()
                  for x in (trees.tokens, trees.parents, trees.confidence, trees.entropy))
    kept = sum(t.features.nbytes for t in traces) + drafted
    need = _need(dcfg, "drafter")
    _close(kept, next(t.bytes for t in need.gpu if t.label.startswith("greedy traces")), "its traces and trees")
    _close(held + kept + peak, _predicted(need), "drafter")


def test_tune_trial_one_optimizer_step_of_the_largest_head(cfg, target, tmp_path):
    """A trial's step on cached features: the frozen fp32 embeddings and LM head, the head with its gradients and
    AdamW moments (created by the first step), and the passes' activations kept for backward (HASS: 3)."""
    model, t = target.model, cfg.train
    kind = "hass"
    frozen = FrozenTarget.from_model(model, torch.float32, None)
    head = DraftHead(DraftHeadConfig.from_target(model.config, kind=kind))
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    settings = LossSettings.for_kind(kind, t)
    rows, length, k = t.batch_size, cfg.features.max_len, cfg.features.top_k
    vocab, d = model.config.vocab_size, model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(rows, length, k, generator=generator)
    batch = Batch(input_ids=torch.randint(0, vocab, (rows, length), generator=generator),
                  loss_mask=torch.ones(rows, length), hidden=torch.randn(rows, length, d, generator=generator),
                  lengths=torch.full((rows,), length), topk_probs=probs / probs.sum(-1, keepdim=True),
                  topk_ids=torch.randint(0, vocab, (rows, length, k), generator=generator))

    def work() -> None:
        optimizer.zero_grad(set_to_none=True)
        run_passes(head, batch, frozen, settings, backward=True, generator=generator)
        optimizer.step()

    peak, _ = peak_allocated(work, tmp_path)
    held = frozen.embed.nbytes + (0 if frozen.lm_head is frozen.embed else frozen.lm_head.nbytes) + _bytes(head)
    _close(held + peak, _predicted(_need(cfg, "tune_trial")), "tune trial")


def test_features_task_one_batch_of_the_longest_conversations(cfg, target, tmp_path):
    """A features task's forward: `features.batch_size` conversations of `features.max_len` tokens through the
    whole target, then each one's LM head, softmax and top-K."""
    rows, length = cfg.features.batch_size, cfg.features.max_len
    sequences = _prompts(target.model.config.vocab_size, rows, length, 7)
    peak, _ = peak_allocated(lambda: target_features(target, sequences, cfg.features.top_k), tmp_path)
    _close(_bytes(target.model) + peak, _predicted(_need(cfg, "features_task")), "features task")


def test_serve_replica_a_full_batch_of_the_longest_requests(cfg, target, tmp_path):
    """A replica's decode loop: `serve.max_batch_size` requests of `serve.max_prompt_tokens` each decoding
    `serve.max_tokens_limit` tokens by sampling, drafted by the merged heads of `serve.head_kind`."""
    serve = cfg.serve.model_copy(update={"max_batch_size": 4, "max_prompt_tokens": 200, "max_tokens_limit": 100})
    scfg = cfg.model_copy(update={"serve": serve})
    heads = {m: DraftHead(DraftHeadConfig.from_target(target.model.config, kind=serve.head_kind)).eval()
             for m in scfg.head_mixtures(serve.head_kind)}
    proposer = build_proposer("merged", target, heads, cfg.tree)
    batcher = ContinuousBatcher(target.model, stop_ids=[], max_batch_size=serve.max_batch_size)
    prompts = _prompts(target.model.config.vocab_size, serve.max_batch_size, serve.max_prompt_tokens, 5)

    def work() -> None:
        for i, prompt in enumerate(prompts):
            batcher.submit(Request(prompt=prompt, proposer=proposer, params=SAMPLED,
                                   max_tokens=serve.max_tokens_limit, seed=i))
        while batcher.busy:
            batcher.step()

    peak, _ = peak_allocated(work, tmp_path)
    held = _bytes(target.model) + sum(_bytes(h) for h in heads.values())
    _close(held + peak, _predicted(_need(scfg, "serve_replica")), "serve replica")
