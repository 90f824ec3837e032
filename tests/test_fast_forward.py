"""taps' fast Llama forward against transformers', and the preallocated KV cache the batch owns.

Tolerances come from fp32 rounding, not from a number picked to pass: both forwards are compared with the same
model in float64, and the fast forward must be about as close to it as transformers' own fp32 forward is (fusing
projections changes the order of sums, so the two fp32 forwards are not bit-identical; on AVX-512 and on AMX
machines alike they round differently from float64 by the same order). Greedy tokens must agree wherever the
float64 margin between the two best logits exceeds that error bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

from taps_ray.decoding.generate import generate
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.tree import build_tree
from taps_ray.models.cpu_linear import DecodingLinear, Projection
from taps_ray.models.fast_llama import SUPPORTED_MODEL_TYPES, FastLlama
from taps_ray.models.hf_forward import HFForward
from taps_ray.models.kv_cache import GROWTH, KVCache, write_slots
from taps_ray.models.layer_graph import LayerGraph
from taps_ray.models.target_forward import (attach_forward, compile_unavailable_reason, resolved_compile,
                                             target_forward)

from numerics import rounding_rtol
from oracles import GreedyOracle

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "gqa": {},
    "llama3-rope-biases-head-dim": {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True,
                                    "head_dim": 24},
}
NO_INDUCTOR = compile_unavailable_reason(torch.device("cpu"))
# the compiled path (target.compile: inductor) is held to the same float64 bound as the eager fast forward
COMPILE_MODES = ["none", pytest.param("inductor", marks=pytest.mark.skipif(NO_INDUCTOR is not None,
                                                                         reason=str(NO_INDUCTOR)))]
TREE_NODES = ([11, 12, 13, 14, 15, 16, 17], [-1, 0, 0, 1, 1, 2, 5])
CHAIN_NODES = ([21, 22, 23, 24], [-1, 0, 1, 2])
TREE, CHAIN = (build_tree(torch.tensor(tokens), torch.tensor(parents)) for tokens, parents in (TREE_NODES, CHAIN_NODES))


# The families the fast forward covers, each with what sets it apart: Mistral's sliding window (16, so the prompts
# below cross it), Qwen2's q/k/v biases, Qwen3's q/k norms (and a head_dim other than hidden / heads), and Qwen's
# sliding-window mode (full attention in the first layer, the window in the rest).
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 16}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24}),
    "qwen3-sliding": (transformers.Qwen3Config, {"use_sliding_window": True, "sliding_window": 16,
                                                 "max_window_layers": 1}),
}


def test_the_families_here_are_the_ones_the_fast_forward_covers():
    assert {config_class.model_type for config_class, _ in FAMILIES.values()} == set(SUPPORTED_MODEL_TYPES)


def _tiny(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random tiny model of `family` through transformers' own classes; norm weights and biases are perturbed
    from their ones and zeros so Qwen3's q/k norms and Qwen2's biases compute something."""
    config_class, family_settings = FAMILIES[family]
    settings = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    config = config_class(**{**settings, **family_settings, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # sharp distributions, as the tiny target has
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model.to(dtype).eval().requires_grad_(False)


def _llama(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: object) -> transformers.LlamaForCausalLM:
    return _tiny("llama", dtype, seed, **overrides)


def _verify(model: torch.nn.Module, feature_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Logits (and features) of a padded two-row prefill, then a tree on row 0 and a chain on row 1 after it:
    prompts long enough that Llama-3's rope scaling reaches its scaled and interpolated bands."""
    prompts = [list(range(3, 40)), list(range(50, 70))]
    batch = TargetBatch(model, feature_layers=feature_layers)
    outs = batch.prefill(prompts)
    logits, features, _ = batch.forward_trees([TREE, CHAIN])
    trees = [(logits[b, : t.size], features[b, : t.size]) for b, t in enumerate((TREE, CHAIN))]
    return [o.logits.double() for o in outs] + [x.double() for x, _ in trees] + [h.double() for _, h in trees]


def _three_ways(dtype: torch.dtype, compile_mode: str = "none", **overrides: object) -> tuple[list, list, list]:
    fast = _llama(dtype, **overrides)
    hf, exact = copy.deepcopy(fast), copy.deepcopy(fast).double()
    attach_forward(fast, "fast", compile_mode)
    assert target_forward(fast).compiled == (compile_mode == "inductor")
    attach_forward(hf, "hf")
    attach_forward(exact, "hf")
    assert isinstance(target_forward(fast), FastLlama) and isinstance(target_forward(hf), HFForward)
    return _verify(fast, (0, 2, -1)), _verify(hf, (0, 2, -1)), _verify(exact, (0, 2, -1))


@pytest.mark.parametrize("compile_mode", COMPILE_MODES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fast_forward_is_as_close_to_float64_as_transformers_fp32(name, compile_mode):
    fast, hf, exact = _three_ways(torch.float32, compile_mode, **CONFIGS[name])
    eps = torch.finfo(torch.float32).eps
    checked = 0
    for got, reference, truth in zip(fast, hf, exact, strict=True):
        hf_error = (reference - truth).abs().max().item()
        bound = 8 * max(hf_error, eps * truth.abs().max().item())
        assert (got - truth).abs().max().item() <= bound
        if truth.shape[-1] == 96:  # logits: the tokens agree wherever the float64 margin exceeds the error bound
            top2 = truth.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
            assert torch.equal(got.argmax(-1)[clear], truth.argmax(-1)[clear])
            checked += int(clear.sum())
    assert checked >= 10  # the token check compared real positions


def test_fast_forward_bf16_is_as_close_to_float64_as_transformers_bf16():
    fast, hf, exact = _three_ways(torch.bfloat16)
    for got, reference, truth in zip(fast, hf, exact, strict=True):
        hf_error = (reference - truth).abs().max().item()
        bound = 4 * max(hf_error, torch.finfo(torch.bfloat16).eps * truth.abs().max().item())
        assert (got - truth).abs().max().item() <= bound


def test_llama3_rope_frequencies_are_transformers_own():
    model = _llama(**CONFIGS["llama3-rope-biases-head-dim"])
    fast = FastLlama(model)
    rotary = model.model.rotary_emb
    assert torch.equal(fast.inv_freq, rotary.inv_freq.float()) and fast.rope_scaling == rotary.attention_scaling
    positions = torch.arange(200)[None]
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, sin = fast.rope(positions, torch.float32)
    want_cos, want_sin = rotary(x, positions)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    default = FastLlama(_llama())
    assert not torch.equal(default.inv_freq[: fast.inv_freq.numel()], fast.inv_freq)  # the scaling did something


def test_fusing_shares_the_hf_weights_and_transformers_forward_computes_the_same_function():
    """The HF parameters become views of the fused (on a CPU in fp32: [in, out]-laid-out) weights, so no weight is
    held twice; transformers' forward then runs other matmul kernels over them, equal up to fp32 rounding."""
    model = _llama(attention_bias=True)
    ids = torch.tensor([[3, 8, 13, 21, 34]])
    before = model(ids).logits
    parameters = sum(p.numel() for p in model.parameters())
    fast = FastLlama(model)
    after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=rounding_rtol(128, chained=3 * 4), atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == parameters
    for block, layer in zip(model.model.layers, fast.layers, strict=True):
        attn, mlp = block.self_attn, block.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.weight.untyped_storage().data_ptr() == layer.qkv.weight.untyped_storage().data_ptr()
            assert proj.bias.untyped_storage().data_ptr() == layer.qkv.bias.untyped_storage().data_ptr()
        for proj in (mlp.gate_proj, mlp.up_proj):
            assert proj.weight.untyped_storage().data_ptr() == layer.gate_up.weight.untyped_storage().data_ptr()
    first_q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(fast.layers[0].qkv.row_weight()[: first_q.shape[0]], first_q)


def test_in_place_weight_changes_reach_the_fast_forward_and_its_packed_copies():
    """oneDNN's reordered weights and a tied LM head's own layout are copies: an in-place change to the HF
    parameters after building (as a test that sharpens the embeddings makes) must not leave them stale."""
    def change(model: transformers.LlamaForCausalLM) -> None:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.5)  # tied: the LM head's copy
            model.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # shared storage: the packed copy

    model, rebuilt = _llama(), _llama()
    attach_forward(model, "fast")
    _verify(model)  # the copies are in use
    change(model)
    change(rebuilt)
    attach_forward(rebuilt, "fast")
    for got, want in zip(_verify(model), _verify(rebuilt), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_decoding_linear_follows_its_module_when_cast_after_first_use():
    """`module.to(dtype)` swaps a parameter's data under the same object without bumping its version: the laid-out
    copy a `DecodingLinear` made on first use must follow (a head drafts in fp32, is cast to bf16, drafts again)."""
    linear = DecodingLinear(16, 32, bias=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
        linear.to(torch.bfloat16)
        out = linear(x.bfloat16())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, F.linear(x.bfloat16(), linear.weight, linear.bias), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pack_one_row", [True, False])
def test_an_fp32_projection_multiplies_one_row_through_the_layout_chosen_and_equals_f_linear(pack_one_row):
    """`FP32_ONE_ROW_PACKED` (by CPU) or the caller picks oneDNN's packed weight or the plain [in, out] layout for
    one fp32 row; several rows always go through oneDNN's. Either way the result is F.linear's to fp32 rounding,
    and the HF parameters stay views of the projection's weight."""
    linears = [torch.nn.Linear(64, 96, bias=True) for _ in range(2)]
    want_weight = torch.cat([linear.weight.detach().clone() for linear in linears])
    want_bias = torch.cat([linear.bias.detach().clone() for linear in linears])
    projection = Projection.fused(linears, pack_one_row=pack_one_row)
    assert projection.columns == (not pack_one_row)  # the [in, out] layout only where one row is not packed
    assert projection.packed is not None
    torch.testing.assert_close(torch.cat([linear.weight for linear in linears]), want_weight, rtol=0, atol=0)
    with torch.no_grad():
        for rows in (1, 5):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(projection(x), F.linear(x, want_weight, want_bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_projection_runs_unpacked_where_onednn_cannot_pack_it(monkeypatch, dtype):
    """oneDNN refuses to reorder an fp16 weight on a CPU without AVX512-FP16 or AVX-NE-CONVERT (an AVX-512 Xeon
    without them raised at model load): there the projection is left unpacked and computes F.linear's result."""
    support = {torch.float16: "_is_mkldnn_fp16_supported", torch.bfloat16: "_is_mkldnn_bf16_supported"}[dtype]
    monkeypatch.setattr(torch.ops.mkldnn, support, lambda: False)
    linears = [torch.nn.Linear(16, 8, bias=False).to(dtype) for _ in range(3)]
    projection = Projection.fused(linears)
    assert projection.packed is None
    x = torch.randn(4, 16, dtype=dtype)
    with torch.no_grad():
        want = torch.cat([F.linear(x, linear.weight) for linear in linears], dim=-1)
        torch.testing.assert_close(projection(x), want)  # the dtype's tolerance: a fused layout may sum in another order


def test_compile_auto_is_the_captured_step_on_a_gpu_and_eager_on_a_cpu_but_in_a_replica():
    """`target.compile: auto` (the default) picks what measured fastest per device: reports/gpu.md, compiled_forward.md;
    on a CPU the layer graph only where it is compiled once for a long life, a Serve replica (docs/serve.md)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolved_compile("auto", cuda, fast=True) == "step"
    assert resolved_compile("auto", cuda, fast=False) == "none"  # transformers' forward has no captured step
    assert resolved_compile("auto", cpu, fast=True) == "none"
    assert resolved_compile("auto", cpu, fast=True, serving=True) == "inductor"  # bf16 and fp32 alike
    assert resolved_compile("auto", cpu, fast=False, serving=True) == "none"
    assert resolved_compile("none", cpu, fast=True, serving=True) == "none"  # a config's choice stands
    assert all(resolved_compile(mode, cuda, fast=True) == mode for mode in ("none", "inductor", "step"))
    forward = attach_forward(_llama(), "fast", "auto")  # here, a CPU: eager, nothing compiled or captured
    assert isinstance(forward, FastLlama) and not forward.compiled and forward.captured is None


@pytest.mark.parametrize("compile_mode", COMPILE_MODES)
def test_casting_the_model_after_building_is_refused_not_silently_diverging(compile_mode):
    model = _llama()
    attach_forward(model, "fast", compile_mode)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="attach_forward"):
        TargetBatch(model).prefill([[3, 4, 5]])


def test_uncovered_rope_falls_back_to_transformers_with_the_same_tokens():
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model = _llama(rope_parameters=dynamic)
    with pytest.raises(ValueError, match="rope type 'dynamic'.*target.forward: hf"):
        FastLlama(model)
    assert isinstance(attach_forward(model, "fast"), HFForward)
    prompt = [3, 9, 27, 81 % 96]
    batch = TargetBatch(model)
    tokens = [c.tokens[0] for c in batch.start([prompt], SamplingParams(), [0])]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1]
    assert tokens == [int(want)]


# --- every covered family against transformers' own full forward ---------------------------------------------


def _path(nodes: tuple[list[int], list[int]], node: int) -> list[int]:
    """The tokens from a tree's root down to `node`."""
    tokens, parents = nodes
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _scored(model: torch.nn.Module) -> tuple[list[list[int]], torch.Tensor]:
    """Every (token sequence, logits of its last token) the batch scores: a padded two-row prefill crossing the
    sliding windows, a tree on row 0 and a chain on row 1, a commit of part of each (row 0's moves slots), and
    the same trees again after it."""
    prompts = [list(range(3, 40)), list(range(50, 70))]
    batch = TargetBatch(model)
    committed, sequences = [list(p) for p in prompts], [list(p) for p in prompts]
    logits = [o.logits[0] for o in batch.prefill(prompts)]
    for accepted in ([0, 1, 3], [0, 1]), ([0, 2, 5, 6], [0, 1, 2, 3]):
        step_logits = batch.forward_trees([TREE, CHAIN])[0]
        for row, nodes in enumerate((TREE_NODES, CHAIN_NODES)):
            sequences += [committed[row] + _path(nodes, node) for node in range(len(nodes[0]))]
            logits += list(step_logits[row, : len(nodes[0])])
            committed[row] += [nodes[0][node] for node in accepted[row]]
        batch.commit(list(accepted))
    return sequences, torch.stack(logits).double()


def _own(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """transformers' own forward (its causal and sliding-window masks, no cache) of each sequence's last token."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, -1] for s in sequences]).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("forward", ["fast", "hf"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_as_transformers_own_forward(family, forward, dtype):
    """Prefill, tree steps and commits through the batch's cache against transformers' own forward of each whole
    sequence: as close to the float64 truth as that forward at the same dtype is."""
    model = _tiny(family, dtype)
    exact, own = copy.deepcopy(model).double(), copy.deepcopy(model)
    attached = attach_forward(model, forward)
    assert isinstance(attached, FastLlama if forward == "fast" else HFForward)
    sequences, got = _scored(model)
    truth = _own(exact, sequences)
    own_error = (_own(own, sequences) - truth).abs().max().item()
    bound = 8 * max(own_error, torch.finfo(dtype).eps * truth.abs().max().item())
    assert (got - truth).abs().max().item() <= bound
    if "sliding_window" in FAMILIES[family][1] and dtype == torch.float32:  # not vacuous: the window matters
        unwindowed = _tiny(family, torch.float64, sliding_window=None, use_sliding_window=False)
        assert (_own(unwindowed, sequences) - truth).abs().max().item() > 100 * bound


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_speculatively_as_greedy_token_for_token(family):
    model = _tiny(family)
    attach_forward(model, "fast")
    prompt = list(range(5, 17))
    generation = generate(model, GreedyOracle(model, prompt[0]), [prompt], SamplingParams(), 30, [])[0]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)[0, len(prompt):]
    assert generation.tokens == want.tolist()
    assert sum(step.accepted for step in generation.steps) > 0  # not vacuous: drafts were accepted


# --- the preallocated cache ----------------------------------------------------------------------------------


def test_decoding_writes_in_place_the_buffers_are_allocated_once_per_capacity():
    model = _llama()
    attach_forward(model, "fast")
    batch = TargetBatch(model)
    prompt = list(range(3, 20))
    root = batch.start([prompt], SamplingParams(), [0])[0].tokens[-1]

    def decode(steps: int) -> None:
        nonlocal root
        for _ in range(steps):
            root = batch.step([build_tree(torch.tensor([root]), torch.tensor([-1]))])[0].tokens[-1]

    pointers = {batch.cache.layer(i)[0].data_ptr() for i in range(3)}
    decode(GROWTH - len(prompt) - 1)  # stays within the first capacity
    assert {batch.cache.layer(i)[0].data_ptr() for i in range(3)} == pointers
    assert batch.cache.width == GROWTH - 1
    keys_before = batch.cache.layer(0)[0].clone()
    decode(10)  # past it: one reallocation, the committed slots carried over
    assert batch.cache.layer(0)[0].data_ptr() not in pointers and batch.cache.width == GROWTH + 9
    assert torch.equal(batch.cache.layer(0)[0][:, :, : keys_before.shape[2]], keys_before)


@pytest.mark.parametrize("head_dims", [(4, 4), (4, 6)], ids=["one-storage", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the slot moves are indexed, not scattered
def test_cache_compaction_and_row_selection_match_a_naive_copy(dtype: torch.dtype, head_dims: tuple[int, int]):
    """Layers of one shape share one storage (all moved at once); a layer of another shape has buffers of its own."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(num_layers=2)
    cache.reset(3)
    full = [torch.randn(3, 2, 9, d, generator=generator).to(dtype) for d in head_dims]
    for layer in range(2):
        cache.append(layer, full[layer][:, :, :6], full[layer][:, :, :6] + 1)
    cache.advance(6)
    for layer in range(2):
        cache.append(layer, full[layer][:, :, 6:], full[layer][:, :, 6:] + 1)
    cache.advance(3)
    assert (cache._storage is not None) == (head_dims[0] == head_dims[1])
    # rows move different slots to different places, one pair repeated (padding), one row moving onto itself
    source = torch.tensor([[6, 8, 8], [7, 6, 3], [0, 0, 0]])
    target = torch.tensor([[2, 3, 3], [4, 5, 3], [0, 0, 0]])
    cache.move_slots(source, target, 6)
    assert cache.width == 6
    for layer in range(2):
        keys, values = cache.layer(layer)
        want = full[layer][:, :, :6].clone()
        for row in range(3):
            moved = full[layer][row][:, source[row]]  # read before writing: sources may be targets
            want[row][:, target[row]] = moved
        assert torch.equal(keys, want) and torch.equal(values, want + 1)
    kept = [cache.layer(layer)[0][[2, 0], :, :5].clone() for layer in range(2)]
    cache.keep_rows([2, 0], 5)
    assert cache.rows == 2 and cache.width == 5
    assert all(torch.equal(cache.layer(layer)[0], kept[layer]) for layer in range(2))
    sub = cache.take_rows(torch.tensor([1]), 5)
    keys_before = cache.layer(0)[0].clone()
    for layer in range(2):
        new = (1, 2, 2, head_dims[layer])
        sub.append(layer, torch.full(new, 7.0, dtype=dtype), torch.full(new, 8.0, dtype=dtype))
    sub.advance(2)
    cache.put_rows(torch.tensor([1]), sub, since=5)
    keys = cache.layer(0)[0]
    assert cache.width == 7 and torch.equal(keys[1, :, 5:], torch.full((2, 2, 4), 7.0, dtype=dtype))
    assert torch.equal(keys[:, :, :5], keys_before)  # the rows' committed slots, and the other row, untouched


@pytest.mark.parametrize("head_dims", [(4, 4), (4, 6)], ids=["one-storage", "per-layer"])
@pytest.mark.parametrize("keep", [[3, 0, 1, 2], [1, 0, 3], [0, 2, 3], [2, 2, 0]], ids=["rotation", "swap", "leave",
                                                                                       "repeat"])
def test_keeping_rows_in_any_order_equals_selecting_them(keep: list[int], head_dims: tuple[int, int]):
    """Rows are copied one by one in place: a row overwritten before a later row reads it is read as it was."""
    generator = torch.Generator().manual_seed(2)
    cache = KVCache(num_layers=2)
    cache.reset(4)
    full = [torch.randn(4, 2, 7, d, generator=generator) for d in head_dims]
    for layer in range(2):
        cache.append(layer, full[layer], -full[layer])
    cache.advance(7)
    cache.keep_rows(keep, 5)
    assert (cache.rows, cache.width) == (len(keep), 5)
    for layer in range(2):
        keys, values = cache.layer(layer)
        assert torch.equal(keys, full[layer][keep, :, :5]) and torch.equal(values, -full[layer][keep, :, :5])


def test_write_slots_writes_each_row_at_its_own_slots():
    buffer = torch.zeros(2, 3, 6, 4, dtype=torch.bfloat16)
    values = torch.arange(2 * 3 * 2 * 4, dtype=torch.bfloat16).view(2, 3, 2, 4)
    slots = torch.tensor([[1, 2], [4, 0]])
    write_slots(buffer, slots, values)
    want = torch.zeros_like(buffer)
    for row in range(2):
        want[row][:, slots[row]] = values[row]
    assert torch.equal(buffer, want) and buffer.count_nonzero() == values.count_nonzero()


def test_a_request_leaving_and_one_joining_reuse_the_buffers_and_keep_every_row():
    """A leave copies only the rows after it, a join writes only its own rows, both in the same buffers."""
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, 2, 5, 4, generator=generator) for _ in range(4)]
    cache = KVCache(num_layers=2)
    cache.reset(4)
    for layer in range(2):
        cache.append(layer, torch.cat(rows), torch.cat(rows) + 1)
    cache.advance(5)
    pointers = [cache.layer(layer)[0].data_ptr() for layer in range(2)]
    cache.keep_rows([0, 2, 3], 5)  # row 1 leaves
    joining = KVCache(num_layers=2)
    joining.reset(1)
    newcomer = torch.randn(1, 2, 3, 4, generator=generator)
    for layer in range(2):
        joining.append(layer, newcomer, newcomer + 1)
    joining.advance(3)
    cache.merge(joining)
    assert [cache.layer(layer)[0].data_ptr() for layer in range(2)] == pointers
    assert cache.rows == 4 and cache.width == 5
    for layer in range(2):
        keys, values = cache.layer(layer)
        assert torch.equal(keys[:3], torch.cat([rows[0], rows[2], rows[3]]))
        assert torch.equal(values[:3], torch.cat([rows[0], rows[2], rows[3]]) + 1)
        assert torch.equal(keys[3:, :, :3], newcomer) and torch.equal(values[3:, :, :3], newcomer + 1)
    wider = KVCache(num_layers=2)  # a join wider than the buffers' slots reallocates, every row carried over
    wider.reset(1)
    for layer in range(2):
        wider.append(layer, torch.ones(1, 2, 300, 4), torch.ones(1, 2, 300, 4))
    wider.advance(300)
    cache.keep_rows([0, 1, 2], 5)
    cache.merge(wider)
    assert cache.layer(0)[0].data_ptr() != pointers[0] and cache.width == 300
    assert torch.equal(cache.layer(0)[0][:3, :, :5], torch.cat([rows[0], rows[2], rows[3]]))


def test_requests_joining_one_at_a_time_reallocate_the_cache_a_logarithmic_number_of_times():
    """Sixteen requests joining one by one: the buffers grow to 1, 2, 4, 8, 16 rows (four copies, not fifteen),
    every row keeps its keys and values, and a full batch of 16 holds no spare row."""
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randn(1, 2, 3 + i, 4, generator=generator) for i in range(16)]
    cache, pointer, copies = KVCache(num_layers=1), None, 0
    for row in rows:
        joining = KVCache(num_layers=1)
        joining.reset(1)
        joining.append(0, row, row + 1)
        joining.advance(row.shape[2])
        if cache.rows == 0:
            cache = joining
        else:
            cache.merge(joining)
        # the old buffer is alive while the new one is allocated, so a reallocation always changes the pointer
        copies += pointer is not None and cache.layer(0)[0].data_ptr() != pointer
        pointer = cache.layer(0)[0].data_ptr()
    assert copies == 4 and cache.reserve(16, 1)[0][0].shape[0] == 16
    keys, values = cache.layer(0)
    for index, row in enumerate(rows):
        assert torch.equal(keys[index, :, : row.shape[2]], row[0])
        assert torch.equal(values[index, :, : row.shape[2]], row[0] + 1)


def test_the_cache_never_grows_past_the_batch_cap():
    """A batch capped at 12 sequences grows its buffers 8 -> 12 rows, not 16: `taps plan` sizes them by the cap."""
    cache = KVCache(num_layers=1)
    cache.reset(8)
    cache.append(0, torch.ones(8, 2, 3, 4), torch.ones(8, 2, 3, 4))
    cache.advance(3)
    joining = KVCache(num_layers=1)
    joining.reset(1)
    joining.append(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    joining.advance(3)
    cache.merge(joining, max_rows=12)
    assert cache.rows == 9 and cache.reserve(9, 3)[0][0].shape[0] == 12


# --- prompts prefilled inside a step ------------------------------------------------------------------------


def _two_rows(model: torch.nn.Module, feature_layers: tuple[int, ...]) -> TargetBatch:
    batch = TargetBatch(model, keep_logits=True, feature_layers=feature_layers)
    batch.start([list(range(3, 20)), list(range(30, 37))], SamplingParams(), [0, 1])
    return batch


@pytest.mark.parametrize("feature_layers", [(), (0, 2, -1)], ids=["last", "eagle3-layers"])
@pytest.mark.parametrize("family,compile_mode", [("llama", "none"), ("qwen2", "none"), ("qwen3", "none"),
                                                 ("llama", "inductor")])
def test_a_step_that_prefills_joining_prompts_computes_what_a_step_then_a_prefill_does(family, compile_mode,
                                                                                      feature_layers, monkeypatch):
    """`step_joining` against `step` then `start` + `merge`: the same committed tokens, first tokens (one of
    them drawn at T > 0 from its seed), features, logits and cache, to fp32 rounding (the projections see more
    rows at once); the next step from either batch then commits the same tokens. Compiled (`inductor`), the
    packed step runs through the layer graph, padded, as the prompts' own prefills do."""
    if compile_mode != "none" and NO_INDUCTOR is not None:
        pytest.skip(NO_INDUCTOR)
    model = _tiny(family)
    attach_forward(model, "fast", compile_mode)
    graph_rows: list[int] = []  # the token count of each call of the layer graph
    graph_call = LayerGraph.__call__
    monkeypatch.setattr(LayerGraph, "__call__",
                        lambda graph, ids, *rest: graph_rows.append(ids.shape[1]) or graph_call(graph, ids, *rest))
    prompts = [list(range(40, 49)), list(range(5, 35))]
    params = [SamplingParams(), SamplingParams(temperature=0.8)]
    joined, apart = _two_rows(model, feature_layers), _two_rows(model, feature_layers)
    assert joined.joins_in_step
    newcomer = TargetBatch(model, keep_logits=True, feature_layers=feature_layers)
    graph_rows.clear()
    results, first = joined.step_joining([TREE, CHAIN], newcomer, prompts, params, [5, 6])
    assert graph_rows == ([] if compile_mode == "none" else [2 * TREE.size + 9 + 30]), graph_rows  # one packed row
    joined.merge(newcomer)
    want = apart.step([TREE, CHAIN])
    alone = TargetBatch(model, keep_logits=True, feature_layers=feature_layers)
    want_first = alone.start(prompts, params, [5, 6])
    apart.merge(alone)
    tolerance = {"rtol": 1e-4, "atol": 1e-4}
    for got, expected in zip([*results, *first], [*want, *want_first], strict=True):
        assert got.tokens == expected.tokens
        torch.testing.assert_close(got.features, expected.features, **tolerance)
        torch.testing.assert_close(got.logits, expected.logits, **tolerance)
        assert torch.equal(got.next_tokens, expected.next_tokens)
    assert joined.host_lengths == apart.host_lengths and joined.cache.width == apart.cache.width
    for layer in range(joined.cache.num_layers):
        for mine, theirs in zip(joined.cache.layer(layer), apart.cache.layer(layer)):
            for row, length in enumerate(joined.host_lengths):
                torch.testing.assert_close(mine[row, :, :length], theirs[row, :, :length], **tolerance)
    roots = [build_tree(torch.tensor([c.tokens[-1]]), torch.tensor([-1])) for c in [*results, *first]]
    assert [c.tokens for c in joined.step(roots)] == [c.tokens for c in apart.step(roots)]


def test_a_sliding_window_target_prefills_apart_and_says_why_not_inside_a_step():
    model = _tiny("mistral")
    attach_forward(model, "fast")
    batch = _two_rows(model, ())
    assert not batch.joins_in_step
    with pytest.raises(ValueError, match="sliding-window"):
        batch.step_joining([CHAIN, CHAIN], TargetBatch(model), [[3, 4]], [SamplingParams()], [0])
