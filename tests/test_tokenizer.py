"""The aliases' tokenizer, built from its files (`models.target.plain_fast_tokenizer`), is AutoTokenizer's:
same ids, same decoded text, same chat-template output — a drafter and the target worker must agree on both."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from taps_ray.data.chat import build_prompt_ids, tokenize_conversation
from taps_ray.models.target import SMOLLM2_ALIAS, TINY_ALIAS, Target, load_tokenizer, smollm2_folder, with_pad_token

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Natalia sold clips to 48 of her friends in April. How many clips did she sell altogether?",
    "def f(x):\n\treturn x ** 2  # tabs, newlines\n\n",
    "Unicode: café, naïve, 日本語, emoji 🤖, math ∑ x²",
    "<|im_start|>user\nspecial tokens inside text<|im_end|><|endoftext|>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps time."},
        {"role": "user", "content": "Now one about mountains, in 日本語 please."},
    ],
    [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "{\"a\": 1}"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "{\"b\": 2}"},
    ],
]


@pytest.fixture(scope="module")
def reference():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module", params=[SMOLLM2_ALIAS, TINY_ALIAS])
def lean(request):
    return load_tokenizer(request.param)


def test_same_class_vocabulary_and_special_tokens(reference, lean) -> None:
    assert type(lean) is type(reference)
    assert lean.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert len(lean) == len(reference) == 49152
    assert lean.all_special_ids == reference.all_special_ids
    assert lean.all_special_tokens == reference.all_special_tokens
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "model_max_length",
                      "padding_side", "truncation_side", "clean_up_tokenization_spaces", "chat_template"):
        assert getattr(lean, attribute) == getattr(reference, attribute), attribute
    assert lean.chat_template.startswith("{% for message in messages %}")
    stops = [Target(None, with_pad_token(t), "x").stop_token_ids for t in (lean, reference)]
    assert stops[0] == stops[1] == [lean.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_decoded_text(reference, lean, text: str) -> None:
    ids = reference.encode(text)
    assert lean.encode(text) == ids
    assert lean(text)["input_ids"] == reference(text)["input_ids"]
    for skip in (False, True):
        assert lean.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert lean.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system", "multi-turn", "assistant-last"])
def test_same_chat_template_output(reference, lean, messages: list[dict[str, str]]) -> None:
    for generation_prompt in (False, True):
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert lean.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == text
        assert "<|im_start|>" in text
        ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        assert lean.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt) == ids
    assert tokenize_conversation(lean, messages, 512) == tokenize_conversation(reference, messages, 512)


def test_same_evaluation_prompts(reference, lean) -> None:
    turns, answers = ["What is 7 * 6?", "And divided by 2?"], ["7 * 6 = 42."]
    for system in (None, "You are terse."):
        for n in (1, 2):
            expected = build_prompt_ids(reference, turns[:n], answers, system)
            assert build_prompt_ids(lean, turns[:n], answers, system) == expected



def test_same_padded_batches() -> None:
    """Fresh tokenizers: padding a batch sets the backend's padding, which the other tests compare."""
    batch = ["short", "a somewhat longer sentence to pad against"]
    lean, reference = with_pad_token(load_tokenizer()), with_pad_token(AutoTokenizer.from_pretrained(smollm2_folder()))
    assert lean(batch, padding=True)["input_ids"] == reference(batch, padding=True)["input_ids"]


def test_loading_imports_no_model_config_code() -> None:
    """Why the loader exists: AutoTokenizer reads the model type's config code, the direct build does not."""
    code = ("import sys; from taps_ray.models.target import load_tokenizer; load_tokenizer(); "
            "print([m for m in sys.modules if m.startswith('transformers.models.llama')])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
