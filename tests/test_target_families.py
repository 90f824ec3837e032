"""Every causal decoder with rotary positions that transformers ships, built tiny: which forward decodes it (taps'
fast one, transformers' through taps' cache) or why it is refused at load, and a proof for each that the forward
it gets decodes as the model's own full forward does. docs/targets.md is this table; it is regenerated with
`python tests/test_target_families.py --update` and must equal what the test derives (so it stays true when
transformers or the forwards change).

A family is tiny-built from its config class's defaults with small sizes (and a sliding window of 16 where the
config has the field, so the prompts cross it); a family whose config cannot be shrunk that way, or whose model class
wraps another model (multimodal), is listed as not built with the error."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.drafting.tree import build_tree
from taps_ray.models.fast_llama import SUPPORTED_MODEL_TYPES, FastLlama
from taps_ray.models.hf_forward import TargetRefused
from taps_ray.models.target_forward import attach_forward

DOC = Path(__file__).resolve().parents[1] / "docs" / "targets.md"
WINDOW = 16
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 256,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# mixture-of-experts and low-rank attention sizes, shrunk where a config has them
SHRUNK = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
          "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32, "kv_lora_rank": 16,
          "q_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
          "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "intermediate_size_mlp": 128, "rotary_dim": 8}
# features that change the logits, set so that they matter at these sizes: Granite's logit scaling, Cohere's,
# Gemma's final soft-capping
FEATURES = {"logits_scaling": 8.0, "logit_scale": 0.25, "final_logit_softcapping": 2.0}
MAX_PARAMETERS = 20_000_000
TREE_NODES = ([11, 12, 13, 14, 15], [-1, 0, 0, 1, 3])
PROMPTS = [list(range(3, 40)), list(range(50, 70))]
# fp32 (float64 is not run by the experts' grouped matmuls): rounding is ~1e-6 of the logits' scale (~1e-4 in
# ill-conditioned tiny models); a missed window, scaling or mask is ~1e-2 and more
RELATIVE_TOLERANCE = 1e-3


@dataclass
class Row:
    family: str
    forward: str  # "fast", "transformers", "refused" or "not built"
    note: str = ""


def tiny_config(family: str) -> transformers.PretrainedConfig:
    """`family`'s config from its defaults, shrunk (and with its logit features and window set to matter)."""
    defaults = transformers.AutoConfig.for_model(family)
    settings = {name: value for name, value in {**SIZES, **SHRUNK, **FEATURES}.items() if hasattr(defaults, name)}
    if hasattr(defaults, "sliding_window"):  # also where it defaults to None (Phi-3): a window must then work
        settings["sliding_window"] = WINDOW
    return transformers.AutoConfig.for_model(family, **settings)  # derived fields (layer_types) follow the sizes


def tiny_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """The random model of `config`; raises where it is not tiny or its own forward does not run."""
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters at the tiny sizes")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    with torch.no_grad():
        model(torch.tensor([PROMPTS[1]]), use_cache=False)
    return model


def has_rotary(model: torch.nn.Module) -> bool:
    return any("rotary" in type(module).__name__.lower() for module in model.modules())


def source_has_rotary(family: str) -> bool:
    """For a family whose tiny config does not build: whether its modelling code has a rotary embedding."""
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], None)
    return model_class is not None and "RotaryEmbedding" in inspect.getsource(inspect.getmodule(model_class))


def _path(node: int) -> list[int]:
    tokens, parents = TREE_NODES
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def decoding_error(model: torch.nn.Module) -> float:
    """The largest |Δ logit|, relative to the logits' scale, between the batch (prefill of two ragged prompts
    crossing the window, a tree step, a commit, another tree step) and the model's own forward of each sequence."""
    tree = build_tree(torch.tensor(TREE_NODES[0]), torch.tensor(TREE_NODES[1]))
    batch = TargetBatch(model)
    committed, sequences = [list(p) for p in PROMPTS], [list(p) for p in PROMPTS]
    logits = [o.logits[0] for o in batch.prefill(PROMPTS)]
    for accepted in [0, 1, 3], [0, 2]:
        step_logits = batch.forward_trees([tree, tree])[0]
        for row in range(len(PROMPTS)):
            sequences += [committed[row] + _path(node) for node in range(len(TREE_NODES[0]))]
            logits += list(step_logits[row])
            committed[row] += [TREE_NODES[0][node] for node in accepted]
        batch.commit([accepted, accepted])
    with torch.no_grad():
        own = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in sequences])
    return ((torch.stack(logits) - own).abs().max() / own.abs().max()).item()


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"


def classify(family: str) -> Row | None:
    """The family's row (None: not a rotary decoder)."""
    try:
        config = tiny_config(family)
        with torch.device("meta"):
            shape = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - any failure to build it tiny is reported, not hidden
        return Row(family, "not built", _failure(error)) if source_has_rotary(family) else None
    if not has_rotary(shape):
        return None
    text = shape.config.model_type
    if text != family and text in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # a wrapper whose causal LM is a text model
        return Row(family, "not built", f"its causal LM is the {text} model: see that row")
    try:  # a multimodal wrapper is refused before its weights are read: its shape (on the meta device) shows it
        wrapper = hasattr(shape.config, "text_config") or hasattr(shape.config, "vision_config")
        model = shape if wrapper else tiny_model(shape.config)
    except Exception as error:  # noqa: BLE001
        return Row(family, "not built", _failure(error))
    try:
        forward = attach_forward(model, "fast")
    except TargetRefused as error:
        return Row(family, "refused", str(error).split(": ", 1)[1].split(";")[0])
    kind = "fast" if isinstance(forward, FastLlama) else "transformers"
    error = decoding_error(model)
    if error > RELATIVE_TOLERANCE:
        return Row(family, "WRONG", f"relative |Δ logit| {error:.2g}")
    return Row(family, kind, "" if kind == "fast" else forward.logit_transform[0].replace("none", ""))


def rows() -> list[Row]:
    return [row for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if (row := classify(family)) is not None]


def render(table: list[Row]) -> str:
    counts = {kind: sum(row.forward == kind for row in table) for kind in ("fast", "transformers", "refused",
                                                                           "not built")}
    lines = [
        "# Targets: which forward decodes each family",
        "",
        f"Generated by `python tests/test_target_families.py --update` (transformers {transformers.__version__});",
        "tests/test_target_families.py fails when this file differs from what it derives.",
        "",
        "Every causal decoder with rotary positions that transformers ships, built tiny from its config's defaults",
        "(a sliding window of 16 where the config has the field, so the prompts cross it):",
        "",
        "- **fast**: taps' own forward (`target.forward: fast`, models/fast_llama.py);",
        "- **transformers**: transformers' decoder over taps' cache (models/hf_forward.py), for any family the fast",
        "  forward does not cover; a note names the logit transform its `*ForCausalLM.forward` applies after the LM",
        "  head, which taps applies too (picked at load by comparing with that forward);",
        "- **refused**: fails at load with the feature named;",
        "- **not built**: the test's generic shrinking could not build it tiny. Such a family still gets transformers'",
        "  forward behind the same load-time checks (layer kinds, the logit transform, a short decode through taps'",
        "  cache held to the model's own forward), which refuse what they catch, but no test proves it beyond them.",
        "",
        "For fast and transformers rows the test decodes two ragged prompts, two tree steps and a commit and holds",
        f"every logit to the model's own full forward (fp32, relative |Δ| <= {RELATIVE_TOLERANCE:g}). Sliding windows",
        "(Mistral, Phi-3, Starcoder2, Gemma 2/3, Qwen's `use_sliding_window`, ...) are honoured in the masks by both",
        "forwards (models/attention_windows.py).",
        "",
        f"{counts['fast']} fast, {counts['transformers']} transformers, {counts['refused']} refused, "
        f"{counts['not built']} not built.",
        "",
        "| family | forward | note |",
        "|---|---|---|",
    ]
    lines += [f"| {row.family} | {row.forward} | {row.note.replace('|', '/')} |" for row in table]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def table() -> list[Row]:
    return rows()


def test_no_family_decodes_wrong(table):
    assert [row for row in table if row.forward == "WRONG"] == []


def test_exactly_the_covered_families_take_the_fast_forward(table):
    assert {row.family for row in table if row.forward == "fast"} == set(SUPPORTED_MODEL_TYPES)


def test_logit_transforms_and_windows_are_among_what_the_table_proves(table):
    """Not vacuous: the table's transformers rows include the logit scalings and soft-capping and sliding windows
    the forward must honour (their decoding was held to the model's own forward above)."""
    notes = {row.note for row in table if row.forward == "transformers"}
    assert {"/ logits_scaling", "* logit_scale", "final_logit_softcapping"} <= notes
    windowed = {row.family for row in table if row.forward == "transformers"} & {"gemma2", "phi3", "starcoder2"}
    assert windowed == {"gemma2", "phi3", "starcoder2"}
    assert all(isinstance(tiny_config(family).sliding_window, int) for family in windowed)


def test_the_docs_table_is_the_generated_one(table):
    assert DOC.read_text() == render(table), "docs/targets.md is stale: python tests/test_target_families.py --update"


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_target_families.py --update   (rewrites docs/targets.md)")
    DOC.write_text(render(rows()))
    print(f"wrote {DOC}")
