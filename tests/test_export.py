"""`taps export` and the published EAGLE / EAGLE-3 checkpoint layouts: round trip and import."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from taps_ray.cli import main
from taps_ray.config import TreeConfig
from taps_ray.models.draft_head import DraftHead, eagle3_layers, new_head
from taps_ray.models.published import export_head, load_published
from taps_ray.decoding.generate import generate
from taps_ray.drafting.proposers import SingleHead
from taps_ray.drafting.eagle2 import DraftContext, HeadCache
from taps_ray.decoding.verify import SamplingParams
from taps_ray.workdir import head_checkpoint

TREE = TreeConfig(total_token=8, depth=3, top_k=3)
EAGLE3_WEIGHTS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                  "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                  "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                  "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                  "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
                  "d2t", "t2d"}


def _perturbed(head: DraftHead) -> DraftHead:
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def _vocab(target) -> torch.Tensor:
    return torch.tensor(sorted(set(range(0, 4000, 3)) | set(target.stop_token_ids)))


def _features(model, ids: list[int], head: DraftHead) -> torch.Tensor:
    out = model.model(torch.tensor([ids]), output_hidden_states=True)
    if not head.eagle3:
        return out.last_hidden_state[0]
    return torch.cat([out.hidden_states[i][0] for i in head.config.feature_layers], dim=-1)


def _tree(target, head: DraftHead):
    model = target.model
    prompt = target.tokenizer.encode("The answer is 12 times 7")
    proposer = SingleHead("h", head, DraftContext(model.get_input_embeddings(), model.lm_head), TREE)
    with torch.no_grad():
        tree, _ = proposer.propose(HeadCache(), _features(model, prompt, head), torch.tensor(prompt[1:] + [5]))
    return tree


def _hf_greedy(model, prompt: list[int], n: int, stop_ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=stop_ids, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _drafts_losslessly(target, head: DraftHead) -> None:
    model, tok = target.model, target.tokenizer
    proposer = SingleHead("imported", head, DraftContext(model.get_input_embeddings(), model.lm_head), TREE)
    prompts = [tok.encode("Hello there, how are you"), tok.encode("2+2=")]
    for prompt, generation in zip(prompts, generate(model, proposer, prompts, SamplingParams(), 16, target.stop_token_ids)):
        assert generation.tokens == _hf_greedy(model, prompt, 16, target.stop_token_ids)


def _sglang_ready(head: DraftHead) -> DraftHead:
    """SGLang cannot capture hidden_states index 0, which the tiny target's EAGLE-3 layers (2, 1, 0) include."""
    if not head.eagle3 or min(head.config.feature_layers) > 0:
        return head
    other = DraftHead(head.config.model_copy(update={"feature_layers": [2, 1, 1]}))
    other.load_trainable(head.trainable_state())
    return other.eval()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("kind", ["eagle3", "eagle2", "hass"])
def test_export_then_import_is_bit_identical_and_drafts_the_same_trees(tiny_target, tmp_path, kind, engine):
    vocab = _vocab(tiny_target) if kind == "eagle3" else None
    head = _perturbed(new_head(tiny_target.model.config, seed=7, kind=kind, draft_vocab=vocab, trained_on="math"))
    if engine == "sglang":
        head = _sglang_ready(head)
    export_head(head, tmp_path / "out", engine=engine)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    names = set(weights)
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == head.config.hidden_size
    assert "bias" not in config  # both engines' Llama layers read it as attention bias
    assert config["taps"]["engine"] == engine and head.fc.bias is None  # heads train without an fc bias
    if kind == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and names == EAGLE3_WEIGHTS
        assert config["draft_vocab_size"] == vocab.numel() and config["target_hidden_size"] == head.config.hidden_size
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        shift = 0 if engine == "vllm" else 1  # SGLang captures the input of layer id + 1
        assert ids == [i - shift for i in head.config.feature_layers]
    else:
        assert config["architectures"] == [{"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]]
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
        assert not any(n.startswith("layer.") for n in names)
        if engine == "vllm":  # vLLM's EAGLE fc has no bias
            assert "fc.bias" not in names
        else:  # SGLang's always has one: a zero bias computes the same
            assert torch.equal(weights["fc.bias"], torch.zeros(head.config.hidden_size))
    again = load_published(tmp_path / "out")
    assert again.config == head.config
    mine, theirs = head.trainable_state(), again.trainable_state()
    assert set(mine) == set(theirs)
    for key, value in mine.items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key
    a, b = _tree(tiny_target, head), _tree(tiny_target, again)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.equal(a.confidence, b.confidence)
    with pytest.raises(ValueError, match="layout"):
        export_head(head, tmp_path / "wrong", "eagle" if kind == "eagle3" else "eagle3")
    with pytest.raises(ValueError, match="exported for"):
        load_published(tmp_path / "out", engine="sglang" if engine == "vllm" else "vllm")


def test_an_fc_bias_exports_only_where_the_engine_holds_one(tiny_target, tmp_path):
    head = _perturbed(new_head(tiny_target.model.config, seed=4, kind="hass", fc_bias=True))
    with pytest.raises(ValueError, match="fc bias.*retrain.*--engine sglang"):
        export_head(head, tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()
    export_head(head, tmp_path / "sglang", engine="sglang")
    again = load_published(tmp_path / "sglang")
    assert again.config.fc_bias and torch.equal(again.fc.bias, head.fc.bias)
    eagle3 = DraftHead(new_head(tiny_target.model.config, kind="eagle3").config.model_copy(update={"fc_bias": True}))
    for engine in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="fc bias"):
            export_head(eagle3, tmp_path / f"e3-{engine}", engine=engine)
    with pytest.raises(ValueError, match="index 0"):  # the tiny target's EAGLE-3 layers 2, 1, 0
        export_head(new_head(tiny_target.model.config, kind="eagle3"), tmp_path / "e3", engine="sglang")


def test_a_synthetic_published_eagle3_checkpoint_loads_and_drafts(tiny_target, tmp_path):
    """The layout of the published EAGLE-3 checkpoints (fp16, no fused-layer ids in config.json, embed absent)."""
    c = tiny_target.model.config
    d, v, rows = c.hidden_size, c.vocab_size, 600
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).half()

    ids = torch.tensor(sorted(set(torch.randperm(v, generator=g)[: rows - 2].tolist()) | set(tiny_target.stop_token_ids)))
    ids = ids[:rows] if ids.numel() >= rows else torch.cat([ids, torch.tensor([v - 1])])
    rows = ids.numel()
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    weights = {
        "fc.weight": w(d, 3 * d), "midlayer.input_layernorm.weight": torch.ones(d).half(),
        "midlayer.hidden_norm.weight": torch.ones(d).half(),
        "midlayer.self_attn.q_proj.weight": w(d, 2 * d), "midlayer.self_attn.k_proj.weight": w(kv, 2 * d),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * d), "midlayer.self_attn.o_proj.weight": w(d, d),
        "midlayer.post_attention_layernorm.weight": torch.ones(d).half(),
        "midlayer.mlp.gate_proj.weight": w(c.intermediate_size, d), "midlayer.mlp.up_proj.weight": w(c.intermediate_size, d),
        "midlayer.mlp.down_proj.weight": w(d, c.intermediate_size), "norm.weight": torch.ones(d).half(),
        "lm_head.weight": w(rows, d), "d2t": ids - torch.arange(rows), "t2d": t2d,
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": v, "draft_vocab_size": rows,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer count"):
        load_published(tmp_path)
    head = load_published(tmp_path, target_layers=c.num_hidden_layers)
    assert head.eagle3 and head.config.feature_layers == eagle3_layers(c.num_hidden_layers)
    assert torch.equal(head.draft_ids(), ids) and torch.equal(head.lm_head.weight, weights["lm_head.weight"].float())
    tree = _tree(tiny_target, head)
    assert set(tree.tokens[1:].tolist()) <= set(ids.tolist())
    _drafts_losslessly(tiny_target, head)

    # layer ids in each engine's numbering: SpecForge (SGLang) writes ours minus one, vLLM reads a top-level key first
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}}))
    assert load_published(tmp_path, engine="sglang").config.feature_layers == [2, 1, 2]
    assert load_published(tmp_path).config.feature_layers == [1, 0, 1]
    (tmp_path / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [2, 1, 1],
                                                      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0]}}))
    assert load_published(tmp_path, engine="vllm").config.feature_layers == [2, 1, 1]
    assert load_published(tmp_path, engine="sglang").config.feature_layers == [1, 1, 1]


def test_a_synthetic_published_eagle2_checkpoint_loads_and_drafts(tiny_target, tmp_path):
    """EAGLE-1/2 layout: layers.0.*, fc with bias, a copy of the target embedding that the head does not own."""
    c = tiny_target.model.config
    reference = _perturbed(new_head(c, seed=9, fc_bias=True))
    weights = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v.half()
               for k, v in reference.trainable_state().items()}
    weights["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size).half()
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "bias": True, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
              "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    head = load_published(tmp_path)
    assert not head.eagle3 and head.fc.bias is not None
    for key, value in reference.trainable_state().items():
        assert torch.equal(head.trainable_state()[key], value.half().float()), key
    _drafts_losslessly(tiny_target, head)

    # SGLang's class name and its always-present fc bias, here zero: a bias-free head that vLLM rejects by name
    weights["fc.bias"] = torch.zeros(c.hidden_size).half()
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle"]}))
    head = load_published(tmp_path)
    assert not head.eagle3 and head.fc.bias is None and not head.config.fc_bias
    _drafts_losslessly(tiny_target, head)
    with pytest.raises(ValueError, match="SGLang's"):
        load_published(tmp_path, engine="vllm")


def test_cli_export_writes_the_trained_head(tiny_config, tiny_target, tmp_path, capsys):
    cfg = tiny_config.model_copy(update={"work_dir": str(tmp_path / "work")})
    head = _perturbed(new_head(tiny_target.model.config, seed=3, kind="eagle3", trained_on="math"))
    head.save(head_checkpoint(cfg, "eagle3", "math"))
    config_file = tmp_path / "study.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    args = ["export", "--config", str(config_file), "--kind", "eagle3", "--mixture", "math"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    again = load_published(tmp_path / "out")
    for key, value in head.trainable_state().items():
        assert torch.equal(again.trainable_state()[key], value), key
    assert main([*args, "--out", str(tmp_path / "sglang"), "--engine", "sglang"]) == 2
    assert "index 0" in capsys.readouterr().err  # the tiny target's layers 2, 1, 0: SGLang cannot capture 0
    assert main([*args, "--out", str(tmp_path / "x"), "--layout", "eagle"]) == 2
    assert main(["export", "--config", str(config_file), "--kind", "eagle2", "--mixture", "math", "--out",
                 str(tmp_path / "y")]) == 2
    assert "no trained eagle2 head" in capsys.readouterr().err
