"""Online adaptation (taps_ray/adapt): the traffic buffer, recording, publishing, swapping and rolling back.

Lossless is the law here too: whatever head version drafts, and whenever it is swapped in, a sequence's output at
T=0 is the target's greedy output (fp32).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError
from ray import serve

from taps_ray.adapt.buffer import TrafficBuffer
from taps_ray.adapt.duty import DutyCycle
from taps_ray.adapt.heads import HeadSet
from taps_ray.adapt.record import Recorder
from taps_ray.adapt.replica import ReplicaAdaptation
from taps_ray.adapt.spawn import SpawnRule
from taps_ray.adapt.spawner import SpawnRound
from taps_ray.adapt.swap import LiveStats, ServedModel, should_roll_back
from taps_ray.adapt.trainer_actor import OnlineTrainer, RoutedTrainer, model_buffer, model_heads, model_store
from taps_ray.adapt.versions import VersionStore
from taps_ray.config import AdaptConfig, TreeConfig, load_config
from taps_ray.data.mixtures import build_mixture
from taps_ray.decoding.continuous import ContinuousBatcher, Request, Result
from taps_ray.decoding.generate import generate
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.registry import build_proposer
from taps_ray.models.draft_head import DraftHead, new_head
from taps_ray.ray_runtime import start_serve
from taps_ray.serve.app import build_app
from taps_ray.serve.scheduler import DecodeLoop
from taps_ray.training.features import Example
from taps_ray.workdir import head_checkpoint

from oracles import fit_head
from test_serve import _free_port, _text, _wait_healthy

GREEDY = SamplingParams()
MAX_NEW = 12


def _example(i: int, length: int, d: int = 8) -> Example:
    return Example(f"ex{i}", torch.arange(length) + i, (torch.arange(length) >= 2).float(),
                   torch.randn(length, d).to(torch.bfloat16), None, None)


def test_buffer_is_bounded_atomic_resumable_and_ages_out(tmp_path):
    now = [1000.0]
    buffer = TrafficBuffer(tmp_path / "buf", max_tokens=25, max_age_s=100.0, clock=lambda: now[0])
    for i in range(5):  # 10 positions a shard: only the newest two fit 25
        buffer.add([_example(i, 10)])
        now[0] += 1
    shards = buffer.shards()
    assert [s.tokens for s in shards] == [10, 10] and buffer.tokens <= 25
    assert sorted(p.name for p in (tmp_path / "buf").iterdir()) == sorted(["index.json", *(s.file for s in shards)])
    assert [e.id for e in buffer.read()] == ["ex3", "ex4"]  # arrival order, the oldest aged out

    now[0] += 150  # older than max_age_s: the next write ages them out
    buffer.add([_example(9, 5)])
    assert [e.id for e in buffer.read()] == ["ex9"]

    before = buffer.shards()
    with pytest.raises(Exception):  # a write that fails leaves neither a file nor an index entry behind
        buffer.add([_example(10, 4), Example("bad", torch.arange(3), torch.ones(3), torch.randn(3, 5), None, None)])
    assert buffer.shards() == before
    assert not [p for p in (tmp_path / "buf").iterdir() if p.name.startswith(".")]

    # a killed writer's leftovers (a shard renamed in place but never listed, a temporary file) go on reopening
    orphan, temp = tmp_path / "buf" / "shard-orphan.safetensors", tmp_path / "buf" / ".shard-x.tmp-1"
    for path in (orphan, temp):
        path.write_bytes(b"half")
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    reopened = TrafficBuffer(tmp_path / "buf", max_tokens=25, max_age_s=100.0, clock=lambda: now[0])
    assert not orphan.exists() and not temp.exists()
    (again,) = reopened.read()
    assert again.id == "ex9" and torch.equal(again.hidden, buffer.read()[0].hidden)


@pytest.fixture(scope="module")
def expected(tiny_target, prompts) -> list[list[int]]:
    plain = build_proposer("plain", tiny_target, {}, _tree())
    return [g.tokens for g in generate(tiny_target.model, plain, prompts, GREEDY, MAX_NEW, tiny_target.stop_token_ids)]


@pytest.fixture(scope="module")
def fitted(tiny_target, prompts, expected) -> DraftHead:
    return fit_head(tiny_target, [p + e for p, e in zip(prompts, expected)], steps=60)


def _tree() -> TreeConfig:
    return TreeConfig(total_token=8, depth=3, top_k=3)


def _decode(target, requests: list[Request], on_commit=None) -> list[Result]:
    batcher = ContinuousBatcher(target.model, target.stop_token_ids, max_batch_size=4)
    results: dict[int, Result] = {}
    for i, request in enumerate(requests):
        batcher.submit(request, on_done=lambda r, i=i: results.__setitem__(i, r),
                       on_commit=None if on_commit is None else on_commit(request))
    while batcher.busy:
        batcher.step()
    return [results[i] for i in range(len(requests))]


def test_recording_changes_no_output_and_records_the_verify_features(tiny_target, prompts, expected, fitted,
                                                                     tmp_path):
    """Recording on: the same tokens as off, and the buffer holds what the target computed at each committed
    position (its post-norm features, bf16 as training stores them) under the right tokens."""
    proposer = build_proposer("math", tiny_target, {"math": fitted}, _tree())
    requests = [Request(prompt=p, proposer=proposer, params=GREEDY, max_tokens=MAX_NEW, seed=0) for p in prompts]
    off = _decode(tiny_target, requests)
    recorder = Recorder(TrafficBuffer(tmp_path / "buf", 10_000), sample=1.0, max_per_minute=100, flush_tokens=10**6)
    recordings = {}

    def on_commit(request):
        recordings[id(request)] = recorder.start(request.prompt)
        return recordings[id(request)].on_commit

    on = _decode(tiny_target, requests, on_commit)
    assert [r.generation.tokens for r in on] == [r.generation.tokens for r in off] == expected
    assert sum(s.accepted for r in on for s in r.generation.steps) > 0  # steps committed several positions
    for request, result in zip(requests, on):
        recorder.finish(recordings[id(request)], result.error is None)
    recorder.flush().result()
    recorded = recorder.buffer.read()
    assert len(recorded) == len(prompts)
    for example, prompt, tokens in zip(recorded, prompts, expected):
        # the output's tokens, then what the last step committed past the budget (the target's own tokens too)
        sequence = example.input_ids.tolist()
        assert len(sequence) >= len(prompt) + len(tokens) - 1
        assert sequence[: len(prompt) + len(tokens)] == (prompt + tokens)[: len(sequence)]
        assert example.loss_mask.tolist() == [0.0] * len(prompt) + [1.0] * (len(example) - len(prompt))
        with torch.no_grad():
            want = tiny_target.model.model(torch.tensor([sequence])).last_hidden_state[0]
        torch.testing.assert_close(example.hidden.float(), want.to(torch.bfloat16).float(), rtol=0.02, atol=0.02)


def _adapt_config(tiny_config, tmp_path, **adapt):
    serve = tiny_config.serve.model_copy(update={"adapt": tiny_config.serve.adapt.model_copy(
        update={"enabled": True, "models": ["math"], "poll_s": 1e-6, "sample": 1.0, **adapt})})
    return tiny_config.model_copy(update={"work_dir": str(tmp_path), "serve": serve, "tree": _tree()})


def test_recording_off_adds_nothing_to_a_step(tiny_target, prompts, fitted):
    """With serve.adapt off the decode loop has no adaptation: no sequence carries a recorder."""
    batcher = ContinuousBatcher(tiny_target.model, tiny_target.stop_token_ids, max_batch_size=4)
    proposer = build_proposer("math", tiny_target, {"math": fitted}, _tree())

    async def run() -> Result:
        loop = DecodeLoop(batcher, 8, 60.0)
        assert loop.adapt is None
        ticket = loop.submit(Request(prompt=prompts[0], proposer=proposer, params=GREEDY, max_tokens=4, seed=0), "math")
        assert all(seq.on_commit is None for seq in batcher._waiting)
        return await ticket.wait()

    assert asyncio.run(run()).error is None


def test_a_swap_between_decode_steps_keeps_greedy_output(tiny_config, tiny_target, prompts, expected, fitted,
                                                         tmp_path):
    """Version 0 (a random head) serves; a better head is published while requests decode; the replica swaps
    between two steps. Requests before and after it decode the target's greedy tokens, none fails, and the new
    version's drafts are accepted."""
    cfg = _adapt_config(tiny_config, tmp_path)
    new_head(tiny_target.model.config, seed=5, fc_bias=True).save(head_checkpoint(cfg, "eagle2", "math"))
    proposers: dict[str, object] = {}
    adapt = ReplicaAdaptation(cfg, ["math"], lambda m, head: build_proposer(m, tiny_target, {m: head}, cfg.tree),
                              proposers.__setitem__)
    batcher = ContinuousBatcher(tiny_target.model, tiny_target.stop_token_ids, max_batch_size=4)

    def request(prompt):
        return Request(prompt=prompt, proposer=proposers["math"], params=GREEDY, max_tokens=MAX_NEW, seed=0)

    async def run() -> tuple[list[Result], list[Result]]:
        loop = DecodeLoop(batcher, 16, 60.0, adapt=adapt)
        first = [loop.submit(request(p), "math") for p in prompts]
        while batcher.live == 0 or all(len(s.generation.tokens) < 2 for s in batcher._running):
            await asyncio.sleep(0.001)
        model_store(cfg, "eagle2", "math").publish(fitted, {"heldout_acc": 1.0}, over=0)
        while adapt.models["math"].version != 1:  # swapped in by the loop, between two steps
            await asyncio.sleep(0.001)
        assert any(not t.result.done() for t in first)  # in flight across the swap
        second = [loop.submit(request(p), "math") for p in prompts]
        return ([await t.wait() for t in first], [await t.wait() for t in second])

    before, after = asyncio.run(run())
    for results in (before, after):
        assert all(r.error is None for r in results)
        assert [r.generation.tokens for r in results] == expected
    assert sum(s.accepted for r in after for s in r.generation.steps) > 0
    served = adapt.models["math"]
    assert served.swaps == 1 and served.stats[0].requests == len(prompts) and served.stats[1].requests == len(prompts)


def _recorded_traffic(tiny_target, cfg, prompts) -> None:
    """Greedy traffic recorded into the math buffer: each prompt decoded as a replica records it."""
    plain = build_proposer("plain", tiny_target, {}, cfg.tree)
    recorder = Recorder(model_buffer(cfg, "eagle2", "math"), 1.0, 1000, 10**6)
    tok = tiny_target.tokenizer
    texts = 3 * [tok.decode(p) for p in prompts]  # repeated traffic: the newest (held out) is like the older
    requests = [Request(prompt=tok.encode(t), proposer=plain, params=GREEDY, max_tokens=24, seed=0) for t in texts]
    recordings = {}

    def on_commit(request):
        recordings[id(request)] = recorder.start(request.prompt)
        return recordings[id(request)].on_commit

    for request, result in zip(requests, _decode(tiny_target, requests, on_commit)):
        recorder.finish(recordings[id(request)], True)
    recorder.flush().result()


def test_a_version_is_published_only_when_it_agrees_better(tiny_config, tiny_target, prompts, tmp_path):
    cfg = _adapt_config(tiny_config, tmp_path, lr=3e-3, steps_per_round=30, min_new_tokens=1)
    new_head(tiny_target.model.config, seed=5).save(head_checkpoint(cfg, "eagle2", "math"))
    _recorded_traffic(tiny_target, cfg, prompts)
    trainer = OnlineTrainer(cfg, "math")
    result = trainer.round()
    assert result is not None and result.served == 0
    assert result.candidate_acc > result.served_acc  # training on the traffic helps on the newest traffic
    assert result.published == 1 and trainer.store.current().number == 1
    assert trainer.round() is None  # nothing new recorded: no round

    strict = _adapt_config(tiny_config, tmp_path / "strict", lr=3e-3, steps_per_round=30, min_new_tokens=1,
                           min_gain=1.0)  # agreement can never gain a whole 1.0: never published
    new_head(tiny_target.model.config, seed=5).save(head_checkpoint(strict, "eagle2", "math"))
    _recorded_traffic(tiny_target, strict, prompts)
    held_back = OnlineTrainer(strict, "math").round()
    assert held_back is not None and held_back.published is None
    assert model_store(strict, "eagle2", "math").current().number == 0


def _stats(requests: int, tau: float) -> LiveStats:
    steps = 10 * requests
    return LiveStats(requests, steps, round(tau * steps), 0, 0)


def test_rollback_rule_and_roll_back(tiny_target, tmp_path):
    assert not should_roll_back(_stats(3, 1.0), _stats(8, 3.0), min_requests=4, margin=0.0)  # too few requests
    assert not should_roll_back(_stats(8, 1.0), None, min_requests=4, margin=0.0)  # nothing to compare with
    assert not should_roll_back(_stats(8, 2.9), _stats(8, 3.0), min_requests=4, margin=0.2)  # within the margin
    assert should_roll_back(_stats(8, 2.0), _stats(8, 3.0), min_requests=4, margin=0.2)

    base = tmp_path / "base"
    new_head(tiny_target.model.config, seed=1).save(base)
    store = VersionStore(tmp_path / "versions", base)
    installed = []
    served = ServedModel("math", store, lambda head: object(), installed.append, min_requests=2, margin=0.0)
    assert served.poll() and served.version == 0
    for _ in range(2):
        served.finished(0, _stats(1, 3.0))
    store.publish(new_head(tiny_target.model.config, seed=2), {"heldout_acc": 0.5}, over=0)
    assert served.poll() and served.version == 1 and served.previous == 0
    served.finished(1, _stats(1, 3.5))
    served.finished(1, _stats(1, 1.0))  # pooled 2.25 < 3.0 over two requests: roll back
    assert served.rollback_due == 1
    assert served.poll() and served.version == 0 and installed[-1] is installed[0]  # the old proposer, kept
    assert served.previous is None and served.rollback_due is None  # nothing left to compare version 0 with
    assert store.current().number == 0 and store.rejected() == [1]
    assert store.publish(new_head(tiny_target.model.config, seed=3), {}, over=1) is None  # scored against v1: stale
    assert store.publish(new_head(tiny_target.model.config, seed=3), {}, over=0).number == 2  # 1 is never reused


def test_a_serve_replica_records_trains_swaps_and_stays_greedy(ray_session, tiny_config, tiny_target, tmp_path):
    """The deployment with serve.adapt on, over HTTP: the replica records, its trainer actor publishes a version
    trained on that traffic, the replica swaps it in, and every answer before and after is the greedy one. A routed
    model adapts beside it, per head."""
    cfg = _adapt_config(tiny_config, tmp_path, lr=3e-3, steps_per_round=30, min_new_tokens=1, flush_tokens=1,
                        poll_s=0.2, trainer_num_cpus=0.5, models=["math", "learned-routed"])
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={
        "max_batch_size": 4, "replica_num_cpus": 0.5, "num_replicas": 1, "cost_model": False})})
    for seed, mixture in enumerate(("math", "chat"), start=5):
        new_head(tiny_target.model.config, seed=seed).save(head_checkpoint(cfg, "eagle2", mixture))
    tok, stops = tiny_target.tokenizer, tiny_target.stop_token_ids
    texts = ["Hello there, how are you", "2+2=", "a long prompt about numbers 1 2 3 4"]
    plain = build_proposer("plain", tiny_target, {}, cfg.tree)
    greedy = {t: _text(tok, g.tokens, stops) for t, g in
              zip(texts, generate(tiny_target.model, plain, [tok.encode(t) for t in texts], GREEDY, 16, stops))}
    store = model_store(cfg, "eagle2", "math")
    port = _free_port()
    start_serve(port=port)
    try:
        serve.run(build_app(cfg), name="taps-adapt-test", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)

        def complete(text: str, model: str = "math") -> str:
            body = {"model": model, "prompt": text, "max_tokens": 16, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        deadline = time.monotonic() + 90
        while store.current().number == 0:  # traffic until the trainer has published a version
            assert time.monotonic() < deadline, "no version published"
            for text in texts:
                assert complete(text) == greedy[text]
        assert model_buffer(cfg, "eagle2", "math").tokens > 0
        time.sleep(1.0)  # past the replica's next poll: the new version serves
        for text in texts:
            assert complete(text) == greedy[text]
            assert complete(text, "learned-routed") == greedy[text]
        versions = httpx.get(f"{url}/healthz", timeout=10.0).json()["head_versions"]
        assert versions["math"] >= 1 and set(versions["learned-routed"]) == {"math", "chat"}
    finally:
        serve.shutdown()


# --- routed models: a head swapped inside the router, new heads for new traffic (docs/serve.md#spawning-heads) ---


def _finished(tau: float, **heads: float) -> tuple[float, dict[str, LiveStats]]:
    """A finished request's tau and each head's counts over the steps it drafted alone (10 steps each)."""
    return tau, {h: LiveStats(1, 10, round(10 * t), 0, 0) for h, t in heads.items()}


def test_the_spawn_rule_fires_on_enough_low_requests_that_no_head_does_well_on():
    names = ["math", "chat"]
    rule = SpawnRule(below_tau=2.0, window=4, after=3)
    assert rule.add(*_finished(1.2, math=1.1, chat=1.3), names) is None
    assert rule.add(*_finished(1.4, math=1.2, chat=1.6), names) is None  # two low: fewer than `after`
    assert rule.add(*_finished(1.3, math=1.2), names) == "chat"  # the closest: the best pooled tau on them
    assert rule.add(*_finished(1.1, math=1.0), names) is None  # a fresh window: one spell asks once

    spread = SpawnRule(below_tau=2.0, window=4, after=3)
    for tau in (1.0, 3.0, 3.0, 1.0, 3.0, 1.0):  # never three low among the last four
        assert spread.add(*_finished(tau, math=tau), names) is None

    served = SpawnRule(below_tau=2.0, window=4, after=2)  # low requests, but a head does well on them
    assert served.add(*_finished(1.5, math=1.0, chat=2.5), names) is None
    assert served.add(*_finished(1.5, math=1.0, chat=2.5), names) is None


def test_bad_spawn_settings_give_a_clear_error():
    with pytest.raises(ValidationError, match="spawn_after .* cannot exceed"):
        AdaptConfig(spawn_window=4, spawn_after=8)
    with pytest.raises(ValidationError, match="list one of routed, confidence-routed, learned-routed"):
        AdaptConfig(enabled=True, spawn=True, models=["math"])
    with pytest.raises(ValidationError, match="spawn_below_tau"):
        AdaptConfig(spawn_below_tau=1.0)  # tau is at least 1: nothing would ever be low
    with pytest.raises(ValidationError, match="max_heads"):
        AdaptConfig(max_heads=1)
    assert not AdaptConfig().spawn  # off by default
    assert AdaptConfig(spawn=True, models=["learned-routed"]).max_heads == 4


def test_a_routed_model_grows_to_max_heads_at_most(tiny_target, tmp_path):
    base = tmp_path / "base"
    new_head(tiny_target.model.config, seed=1).save(base)
    heads = HeadSet(tmp_path / "routed", max_heads=3)
    heads.ensure({"math": base, "chat": base})
    heads.ensure({"math": base, "chat": base})  # a second replica starting lists nothing twice
    assert [h.name for h in heads.heads()] == ["math", "chat"]
    assert heads.ask_spawn("chat") and heads.asked() == "chat"
    assert not heads.ask_spawn("math")  # one pending ask at a time
    spawned = heads.add("chat", new_head(tiny_target.model.config, seed=2), {"heldout_acc": 0.5})
    assert spawned.name == "spawn1" and spawned.parent == "chat" and heads.asked() is None
    assert heads.store(spawned).current().number == 0 and DraftHead.load(spawned.base) is not None
    assert not heads.ask_spawn("math")  # three heads: the bound is met
    assert heads.add("math", new_head(tiny_target.model.config, seed=3), {}) is None
    assert len(heads.heads()) == 3


def _routed_config(tiny_config, tmp_path, model: str, **adapt):
    return _adapt_config(tiny_config, tmp_path, models=[model], lr=3e-3, steps_per_round=60, min_new_tokens=1,
                         flush_tokens=1, **adapt)


def _single(target, cfg):
    """`ReplicaAdaptation`'s builder of single-head models (these tests adapt routed ones only)."""
    return lambda model, head: build_proposer(model, target, {model: head}, cfg.tree)


def _routed_requests(proposer, prompts, max_tokens: int = MAX_NEW) -> list[Request]:
    return [Request(prompt=p, proposer=proposer, params=GREEDY, max_tokens=max_tokens, seed=0) for p in prompts]


def test_a_head_version_is_swapped_inside_a_routed_model(tiny_config, tiny_target, prompts, expected, fitted,
                                                         tmp_path):
    """confidence-routed over a random math head and a random chat head: a better math version replaces the math
    head inside the router (its chat head untouched), versions are per head, and the output stays greedy."""
    cfg = _routed_config(tiny_config, tmp_path, "confidence-routed")
    random_heads = {m: new_head(tiny_target.model.config, seed=s, fc_bias=True) for s, m in ((5, "math"), (6, "chat"))}
    for mixture, head in random_heads.items():
        head.save(head_checkpoint(cfg, "eagle2", mixture))
    router = build_proposer("confidence-routed", tiny_target, random_heads, cfg.tree)
    proposers: dict[str, object] = {}
    adapt = ReplicaAdaptation(cfg, ["confidence-routed"], _single(tiny_target, cfg), proposers.__setitem__,
                              routed={"confidence-routed": router})
    assert adapt.versions() == {"confidence-routed": {"math": 0, "chat": 0}}
    before = proposers["confidence-routed"]
    heads = model_heads(cfg, "eagle2", "confidence-routed")
    heads.store(heads.heads()[0]).publish(fitted, {"heldout_acc": 1.0}, over=0)
    adapt.between_steps()
    after = proposers["confidence-routed"]
    assert after is not before and adapt.versions() == {"confidence-routed": {"math": 1, "chat": 0}}
    assert after.parts[1] is before.parts[1] and after.parts[0].head is not before.parts[0].head
    results = _decode(tiny_target, _routed_requests(after, prompts))
    assert [r.generation.tokens for r in results] == expected
    assert sum(s.accepted for r in results for s in r.generation.steps) > 0  # the fitted math head's drafts


def test_a_spawned_head_joins_the_router_between_steps_and_takes_the_traffic(tiny_config, tiny_target, prompts,
                                                                            expected, tmp_path):
    """learned-routed over two random heads: every request decodes low, the rule asks for a head, the trainer forks
    one and trains it on those requests only; the replica adds it between two decode steps while requests decode.
    Every request before and after decodes the greedy tokens, none fails, and the router drafts with the new head
    (its drafts accepted). The bound holds: with max_heads met, low traffic asks for nothing more."""
    cfg = _routed_config(tiny_config, tmp_path, "learned-routed", spawn=True, spawn_below_tau=1.5, spawn_window=4,
                         spawn_after=2, max_heads=3, poll_s=1.0)
    random_heads = {m: new_head(tiny_target.model.config, seed=s, fc_bias=True) for s, m in ((5, "math"), (6, "chat"))}
    for mixture, head in random_heads.items():
        head.save(head_checkpoint(cfg, "eagle2", mixture))
    proposers: dict[str, object] = {}
    now = [0.0]
    adapt = ReplicaAdaptation(cfg, ["learned-routed"], _single(tiny_target, cfg), proposers.__setitem__, clock=lambda: now[0],
                              routed={"learned-routed": build_proposer("learned-routed", tiny_target, random_heads,
                                                                       cfg.tree)})
    heads = model_heads(cfg, "eagle2", "learned-routed")
    batcher = ContinuousBatcher(tiny_target.model, tiny_target.stop_token_ids, max_batch_size=4)

    async def record() -> list[Result]:
        loop = DecodeLoop(batcher, 16, 60.0, adapt=adapt)
        tickets = [loop.submit(r, "learned-routed") for r in _routed_requests(proposers["learned-routed"], 3 * prompts)]
        return [await t.wait() for t in tickets]

    low = asyncio.run(record())
    assert all(r.error is None and r.generation.tau < 1.5 for r in low)
    assert heads.asked() == "math"  # no head drafted alone on them: the closest of equals is the first
    adapt.flush()
    trainer = RoutedTrainer(cfg, "learned-routed")
    for _ in range(3):
        rounds = trainer.train_round(force=True)
        if len(heads.heads()) == 3:
            break
    (spawn,) = [r for r in rounds if isinstance(r, SpawnRound)]
    assert spawn.parent == "math" and spawn.spawned == "spawn1" and spawn.fork_acc > spawn.parent_acc
    assert len(proposers["learned-routed"].head_names) == 2  # the replica has not polled yet

    def greedy_of(prompt):
        return expected[prompts.index(prompt)]

    async def serve_across_the_spawn() -> tuple[list[Result], list[Result], object]:
        loop = DecodeLoop(batcher, 16, 60.0, adapt=adapt)
        first = [loop.submit(r, "learned-routed") for r in _routed_requests(proposers["learned-routed"], prompts)]
        while batcher.live == 0 or all(len(s.generation.tokens) < 2 for s in batcher._running):
            await asyncio.sleep(0.001)
        now[0] += 10.0  # the next poll is due: the loop adds the spawned head between two steps
        while len(proposers["learned-routed"].head_names) != 3:
            await asyncio.sleep(0.001)
        assert any(not t.result.done() for t in first)  # in flight across the spawn
        grown = proposers["learned-routed"]
        second = [loop.submit(r, "learned-routed") for r in _routed_requests(grown, 3 * prompts)]
        return [await t.wait() for t in first], [await t.wait() for t in second], grown

    before, after, grown = asyncio.run(serve_across_the_spawn())
    assert grown.head_names == ["math", "chat", "spawn1"]
    for results, sent in ((before, prompts), (after, 3 * prompts)):
        assert all(r.error is None for r in results)
        assert [r.generation.tokens for r in results] == [greedy_of(p) for p in sent]
    spawned_steps = [s for r in after for s in r.generation.steps if s.head == 2]
    assert spawned_steps and sum(s.accepted for s in spawned_steps) > 0  # the router sends the traffic there
    assert min(r.generation.tau for r in after) > max(r.generation.tau for r in low)  # and it decodes better
    assert adapt.routed["learned-routed"].spawned == 1
    assert adapt.versions() == {"learned-routed": {"math": 0, "chat": 0, "spawn1": 0}}
    assert heads.asked() is None and len(heads.heads()) == 3  # max_heads met: low traffic asks for no more


def test_the_trainer_rests_in_proportion_to_each_step_below_a_duty_of_one():
    now, rests = [0.0], []
    cycle = DutyCycle(0.25, clock=lambda: now[0], sleep=rests.append)
    for seconds in (0.2, 0.4):
        with cycle:
            now[0] += seconds
    assert rests == pytest.approx([0.6, 1.2])  # 0.2 s of work in 0.8 s, 0.4 in 1.6: a quarter of the time
    with DutyCycle(1.0, clock=lambda: now[0], sleep=rests.append):
        now[0] += 1.0
    assert len(rests) == 2  # back to back: no rest
    with pytest.raises(ValueError, match="share of time"):
        DutyCycle(0.0)
    with pytest.raises(ValidationError, match="trainer_duty"):
        AdaptConfig(trainer_duty=1.5)


def test_the_benchmark_s_sharegpt_prompts_are_from_conversations_no_head_trained_on(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "serving"))
    online_adapt = importlib.import_module("online_adapt")
    config = load_config("configs/tiny.yaml")
    trained = {c.messages[0]["content"] for m in config.mixtures.values() if "sharegpt" in m.mixture
               for c in build_mixture(m)}
    as_ids = lambda text: [ord(ch) for ch in text]  # noqa: E731 - one id per character: the text comes back
    prompts = online_adapt.unseen_sharegpt(config, 40, 200, as_ids, seed=0)
    texts = ["".join(map(chr, ids)) for ids in prompts]
    assert len(set(texts)) == 40 and all(len(ids) <= 200 for ids in prompts)
    assert trained and not trained & set(texts)
    assert online_adapt.unseen_sharegpt(config, 40, 200, as_ids, seed=0) == prompts  # seeded
    with pytest.raises(SystemExit, match="unseen ShareGPT prompts of at most 0 tokens"):
        online_adapt.unseen_sharegpt(config, 1, 0, as_ids, seed=0)
