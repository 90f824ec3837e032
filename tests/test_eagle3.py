"""EAGLE-3 heads: fused target layers, the draft vocabulary maps, training-time test, lossless drafting."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from taps_ray.config import TrainConfig, TreeConfig
from taps_ray.models.draft_head import DraftHead, eagle3_layers, new_head
from taps_ray.drafting.combine import Merged, average_heads, with_ngram
from taps_ray.drafting.cost import CostAware
from taps_ray.decoding.generate import generate
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.eagle2 import DraftContext, HeadCache, extend_batch, head_context
from taps_ray.decoding.verify import SamplingParams
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes, shift_batch, ttt_steps

from oracles import GreedyOracle, OracleState

GREEDY = SamplingParams()
TREE = TreeConfig(total_token=8, depth=3, top_k=3)


def _vocab(target) -> torch.Tensor:
    return torch.tensor(sorted(set(range(0, 4000, 3)) | set(target.stop_token_ids)))


def _eagle3(target, seed: int = 0, vocab: torch.Tensor | None = None) -> DraftHead:
    head = new_head(target.model.config, seed=seed, kind="eagle3", draft_vocab=vocab)
    with torch.no_grad():  # away from the init, so norms and maps matter
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def _hf_greedy(model, prompt: list[int], n: int, stop_ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=stop_ids, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _fused(model, ids: list[int], layers) -> torch.Tensor:
    states = model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


def test_draft_vocabulary_maps_follow_the_published_convention(tiny_target):
    vocab = _vocab(tiny_target)
    head = _eagle3(tiny_target, vocab=vocab)
    rows = torch.arange(vocab.numel())
    assert torch.equal(rows + head.d2t, vocab)  # target id = draft id + d2t[draft id]
    assert head.t2d.dtype == torch.bool and int(head.t2d.sum()) == vocab.numel()
    assert torch.equal(head.t2d.nonzero().flatten(), vocab)
    assert head.config.feature_layers == eagle3_layers(tiny_target.model.config.num_hidden_layers)
    assert head.fc.in_features == 3 * head.config.hidden_size and head.fc.bias is None
    assert head.layer.self_attn.q_proj.in_features == 2 * head.config.hidden_size
    assert tuple(head.lm_head.weight.shape) == (vocab.numel(), head.config.hidden_size)
    assert eagle3_layers(30) == [2, 15, 27]  # SmolLM2-135M: EAGLE-3's layers 2, L/2, L-3


def test_save_load_and_averaging_keep_the_maps(tiny_target, tmp_path):
    vocab = _vocab(tiny_target)
    a, b = _eagle3(tiny_target, 1, vocab), _eagle3(tiny_target, 2, vocab)
    a.save(tmp_path / "a")
    again = DraftHead.load(tmp_path / "a")
    for key, value in a.trainable_state().items():
        assert torch.equal(again.trainable_state()[key], value), key
    mean = average_heads(a, b, 0.3)
    assert torch.equal(mean.d2t, a.d2t) and torch.equal(mean.t2d, a.t2d)
    other = _eagle3(tiny_target, 3, vocab[:-1])
    with pytest.raises(ValueError):
        average_heads(a, other, 0.5)


def test_greedy_lossless_random_eagle3_head_batch(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    vocab = _vocab(tiny_target)
    head = _eagle3(tiny_target, seed=4, vocab=vocab)
    proposer = SingleHead("e3", head, DraftContext(model.get_input_embeddings(), model.lm_head), TREE)
    assert proposer.feature_layers == tuple(head.config.feature_layers)
    prompts = [tok.encode("Hello there, how are you"), tok.encode("x"), list(range(100, 160)), tok.encode("2+2=")]
    stops = tiny_target.stop_token_ids
    for prompt, generation in zip(prompts, generate(model, proposer, prompts, GREEDY, 24, stops)):
        assert generation.tokens == _hf_greedy(model, prompt, 24, stops)
    prompt = prompts[0]
    tree, _ = proposer.propose(HeadCache(), _fused(model, prompt, head.config.feature_layers),
                               torch.tensor(prompt[1:] + [5]))
    assert set(tree.tokens[1:].tolist()) <= set(vocab.tolist())  # drafts only its own vocabulary


@dataclass
class FusedOracle(GreedyOracle):
    """The greedy oracle, as an EAGLE-3 proposer: it checks that every committed feature it is handed is the
    target's fused low/mid/high layers at that position (prompt, accepted drafts and bonus tokens alike)."""

    layers: tuple[int, ...] = ()
    checked: list[int] = field(default_factory=list)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layers

    def propose(self, state: OracleState, features: torch.Tensor, next_tokens: torch.Tensor):
        history = state.history + next_tokens.tolist()
        m = features.shape[0]
        expected = _fused(self.model, history[:-1], self.layers)[-m:]
        torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)
        self.checked.append(m)
        return super().propose(state, features, next_tokens)


def test_target_batch_hands_fused_layers_and_an_accepting_oracle_stays_lossless(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("numbers 1 2 3 4 5 6 7 8", "hi", "math: 12*7=")]
    layers = tuple(eagle3_layers(model.config.num_hidden_layers))
    oracle = FusedOracle(model, first_token=bos, depth=4, layers=layers)
    generations = generate(model, oracle, prompts, GREEDY, 24, [])
    for prompt, generation in zip(prompts, generations):
        assert generation.tokens == _hf_greedy(model, prompt, 24, [])
        assert max(s.accepted for s in generation.steps) == 4 and generation.tau > 1.5
    assert sum(n > 1 for n in oracle.checked) > len(prompts)  # accepted blocks were checked, not only prompts


def test_an_eagle3_head_combines_with_prompt_lookup_and_stays_lossless(tiny_target):
    """`<head>+ngram` on an EAGLE-3 head (what `taps serve` builds for every head): prompt lookup reads tokens
    only, so the merged proposer drafts from the head's fused layers. Serving EAGLE-3 heads failed to start here
    ("cannot combine heads that draft from different target layers"). Two parts that read different features
    still cannot combine."""
    model, tok = tiny_target.model, tiny_target.tokenizer
    bos = tok.encode("<|im_start|>")[0]
    prompts = [[bos] + tok.encode(t) for t in ("numbers 1 2 3 4 5 6 7 8", "math: 12*7=")]
    layers = tuple(eagle3_layers(model.config.num_hidden_layers))
    oracle = FusedOracle(model, first_token=bos, depth=4, layers=layers)
    merged = with_ngram(oracle, TREE, "oracle+ngram")
    assert merged.feature_layers == layers and CostAware(merged).feature_layers == layers
    generations = generate(model, merged, prompts, GREEDY, 24, [])
    for prompt, generation in zip(prompts, generations):
        assert generation.tokens == _hf_greedy(model, prompt, 24, [])
        assert generation.tau > 1.5  # drafts were accepted
    assert sum(n > 1 for n in oracle.checked) > len(prompts)  # the head got the fused layers of accepted blocks
    last_layer_head = FusedOracle(model, first_token=bos, depth=4, layers=())
    with pytest.raises(ValueError, match="different target layers"):
        Merged([oracle, last_layer_head], mode="rank", budget=7).feature_layers


def _batch(target, texts: list[str], layers) -> Batch:
    ids = [target.tokenizer.encode(t) for t in texts]
    n = max(map(len, ids))
    b = len(ids)
    input_ids = torch.zeros(b, n, dtype=torch.long)
    hidden = torch.zeros(b, n, target.model.config.hidden_size)
    aux = torch.zeros(b, n, 3 * target.model.config.hidden_size)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        with torch.no_grad():
            out = target.model.model(torch.tensor([row]), output_hidden_states=True)
        hidden[i, : len(row)] = out.last_hidden_state[0]
        aux[i, : len(row)] = torch.cat([out.hidden_states[j][0] for j in layers], dim=-1)
    lengths = torch.tensor([len(r) for r in ids])
    mask = (torch.arange(n)[None] < lengths[:, None]).float()
    return Batch(input_ids, mask, hidden, lengths, aux=aux)


def test_training_time_test_step_equals_drafting_one_level_deeper(tiny_target):
    """TTT step j at index t is exactly the draft forward j levels below committed position t."""
    model = tiny_target.model
    head = _eagle3(tiny_target, seed=5)
    layers = head.config.feature_layers
    batch = _batch(tiny_target, ["The answer to 12 times 7 is 84, so we are done."], layers)
    frozen = FrozenTarget.from_model(model)
    shifted = shift_batch(batch, 0.0)
    with torch.no_grad():
        steps = [hidden for _, _, hidden in ttt_steps(head, frozen, shifted, batch.aux, 3)]
    ids = batch.input_ids[0]
    ctx = head_context(head, DraftContext(model.get_input_embeddings(), model.lm_head))
    t = 5
    with torch.no_grad():
        (out,), (cache,), _ = extend_batch(head, ctx, [HeadCache()], [batch.aux[0, : t + 1]], [ids[1 : t + 2]])
        torch.testing.assert_close(out, steps[0][0, t], rtol=1e-5, atol=1e-5)
        kv, hidden = cache.kv, out
        for j in (1, 2):  # one draft level deeper: previous output, the next true token, position t+j
            mask = torch.ones(1, 1, 1, t + 1 + j, dtype=torch.bool)
            emb = ctx.embed(ids[t + 1 + j].view(1, 1))
            step, kv = head(emb, hidden.view(1, 1, -1), torch.tensor([[t + j]]), mask, kv)
            hidden = step[0, 0]
            torch.testing.assert_close(hidden, steps[j][0, t], rtol=1e-5, atol=1e-5)


def test_eagle3_loss_is_token_level_and_learns(tiny_target):
    head = new_head(tiny_target.model.config, seed=6, kind="eagle3")
    batch = _batch(tiny_target, ["Let us add 3 and 4 to get 7.", "Hello! How can I help you today?"],
                   head.config.feature_layers)
    frozen = FrozenTarget.from_model(tiny_target.model)
    head.lm_head.weight.data.copy_(frozen.lm_head)
    settings = LossSettings.for_kind("eagle3", TrainConfig(hca_passes=3))
    assert settings.reg_weight == 0 and settings.topk_weight == 0 and settings.noise_std == 0 and settings.passes == 3
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        result = run_passes(head, batch, frozen, settings, backward=True)
        optimizer.step()
        losses.append(result.loss)
    assert "reg" not in result.terms and {"cls", "acc", "acc_0", "acc_1", "acc_2"} <= set(result.terms)
    assert losses[-1] < 0.8 * losses[0]


def test_trainer_keeps_extra_layers_only_for_eagle3_and_trains_the_head(tiny_config, tiny_target, tmp_path, monkeypatch):
    from taps_ray.training.features import extract_features, features_key
    from taps_ray.training.trainer import train_head

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = tiny_config.model_copy(deep=True, update={"work_dir": str(tmp_path)})
    cfg.train.kinds = ["eagle2", "eagle3"]
    cfg.mixtures["math"].size = 12
    without = cfg.model_copy(deep=True)
    without.train.kinds = ["eagle2", "hass"]
    assert features_key(cfg, "math") != features_key(without, "math")
    features = extract_features(cfg, "math", target=tiny_target, progress=False)
    example = features.load()[0]
    layers = eagle3_layers(tiny_target.model.config.num_hidden_layers)
    torch.testing.assert_close(example.aux, _fused(tiny_target.model, example.input_ids.tolist(), layers),
                               rtol=1e-4, atol=1e-4)
    final = train_head(cfg, "eagle3", "math", target=tiny_target, progress=False)
    head = DraftHead.load(final)
    assert head.config.kind == "eagle3" and head.config.feature_layers == layers
    metrics = json.loads((final / "metrics.json").read_text())["history"][-1]
    assert metrics["heldout_acc"] is not None and metrics["heldout_acc_2"] is not None
    plain = without.model_copy(update={"work_dir": str(tmp_path / "plain")})
    assert extract_features(plain, "math", target=tiny_target, progress=False).load()[0].aux is None


@pytest.mark.parametrize("kind", ["hass", "eagle3"])
def test_bf16_mixed_precision_runs_the_forward_in_bf16_and_keeps_fp32_gradients(tiny_target, kind):
    """train.precision bf16-mixed: the loss moves off the fp32 value by bf16 rounding only (so autocast did
    apply), and the gradients land in the fp32 weights pointing where the fp32 ones do."""
    head = new_head(tiny_target.model.config, seed=7, kind=kind)
    batch = _batch(tiny_target, ["Let us add 3 and 4 to get 7.", "Hello! How can I help you today?"],
                   eagle3_layers(tiny_target.model.config.num_hidden_layers))
    frozen = FrozenTarget.from_model(tiny_target.model)
    results, grads = {}, {}
    for precision in ("fp32", "bf16-mixed"):
        train = TrainConfig(hca_passes=2, noise_std=0.0, topk_weight=0.0, precision=precision)
        settings = LossSettings.for_kind(kind, train)
        head.zero_grad()
        results[precision] = run_passes(head, batch, frozen, settings, backward=True)
        grads[precision] = torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
        assert all(p.grad.dtype == torch.float32 for p in head.parameters() if p.grad is not None)
    assert LossSettings.for_kind(kind, TrainConfig(precision="bf16-mixed")).autocast == torch.bfloat16
    fp32, mixed = results["fp32"].loss, results["bf16-mixed"].loss
    assert mixed != fp32 and mixed == pytest.approx(fp32, rel=0.05)
    assert torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16-mixed"], dim=0) > 0.95


def test_the_training_time_test_runs_its_own_step_count(tiny_config):
    """EAGLE-3's training-time test trains every level a tree drafts: tree.depth + 1 steps unless train.ttt_steps
    says otherwise, independent of HASS's hca_passes; the fingerprint of a head whose step count equals
    hca_passes (every head trained before ttt_steps existed) and of the other kinds is unchanged."""
    from types import SimpleNamespace

    from taps_ray.training.trainer import run_fingerprint

    assert LossSettings.for_kind("eagle3", TrainConfig(hca_passes=3), tree_depth=4).passes == 5
    assert LossSettings.for_kind("eagle3", TrainConfig(hca_passes=3, ttt_steps=7), tree_depth=4).passes == 7
    assert LossSettings.for_kind("hass", TrainConfig(hca_passes=3, ttt_steps=7), tree_depth=4).passes == 3
    features = SimpleNamespace(key="math-0")
    old = tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"hca_passes": 3}),
                                         "tree": tiny_config.tree.model_copy(update={"depth": 4})})

    def with_steps(steps):
        return old.model_copy(update={"train": old.train.model_copy(update={"ttt_steps": steps})})

    assert run_fingerprint(with_steps(3), "eagle3", features) != run_fingerprint(with_steps(None), "eagle3", features)
    assert run_fingerprint(with_steps(None), "eagle3", features) == run_fingerprint(with_steps(5), "eagle3", features)
    assert run_fingerprint(with_steps(7), "eagle2", features) == run_fingerprint(with_steps(None), "eagle2", features)


def test_ttt_outside_vocab_mask_drops_positions_whose_target_top1_cannot_be_drafted(tiny_target, tiny_config):
    """train.ttt_outside_vocab: mask (the reference's choice) scores a training-time-test step only where the
    target's stored top-1 lies in the draft vocabulary: with one step it equals `keep` on a batch whose loss mask
    drops exactly those positions; without a draft vocabulary it changes nothing; only masked heads change key."""
    from types import SimpleNamespace

    from taps_ray.training.trainer import run_fingerprint

    vocab = _vocab(tiny_target)
    head = _eagle3(tiny_target, seed=8, vocab=vocab)
    batch = _batch(tiny_target, ["Let us add 3 and 4 to get 7.", "Hello! How can I help you today?"],
                   head.config.feature_layers)
    with torch.no_grad():  # the target's top-K of the next token, as stored features hold them
        top = torch.topk(torch.softmax(tiny_target.model.lm_head(batch.hidden), -1), 4)
    batch.topk_probs, batch.topk_ids = top.values, top.indices
    outside = ~torch.isin(batch.topk_ids[..., 0], vocab)
    # shifted position t predicts x_{t+2} from the top-K stored at t+1; its (predicted-aligned) mask is m[t+2]
    masked_by_hand = batch.loss_mask.clone()
    masked_by_hand[:, 1:] *= (~outside[:, :-1]).float()
    assert 0 < int((masked_by_hand != batch.loss_mask).sum()) < int(batch.loss_mask.sum()) - 4
    frozen = FrozenTarget.from_model(tiny_target.model, vocab=vocab)
    keep, mask = (LossSettings.for_kind("eagle3", TrainConfig(ttt_steps=3, ttt_outside_vocab=choice), tree_depth=4)
                  for choice in ("keep", "mask"))
    assert mask.mask_outside_vocab and not keep.mask_outside_vocab
    by_hand = Batch(batch.input_ids, masked_by_hand, batch.hidden, batch.lengths, batch.topk_probs, batch.topk_ids,
                    batch.aux)
    with torch.no_grad():
        one = run_passes(head, batch, frozen, mask, backward=False, passes=1).loss
        assert one == pytest.approx(run_passes(head, by_hand, frozen, keep, backward=False, passes=1).loss, rel=1e-5)
        assert run_passes(head, batch, frozen, mask, backward=False).loss != pytest.approx(
            run_passes(head, batch, frozen, keep, backward=False).loss, rel=1e-4)
        full, whole = FrozenTarget.from_model(tiny_target.model), _eagle3(tiny_target, seed=8)
        assert run_passes(whole, batch, full, mask, backward=False).loss == run_passes(
            whole, batch, full, keep, backward=False).loss
    features = SimpleNamespace(key="math-0")

    def with_choice(choice):
        return tiny_config.model_copy(update={"train": tiny_config.train.model_copy(
            update={"ttt_outside_vocab": choice})})

    assert run_fingerprint(with_choice("keep"), "eagle3", features) == run_fingerprint(tiny_config, "eagle3", features)
    assert run_fingerprint(with_choice("mask"), "eagle3", features) != run_fingerprint(tiny_config, "eagle3", features)
    assert run_fingerprint(with_choice("mask"), "eagle2", features) == run_fingerprint(tiny_config, "eagle2", features)
