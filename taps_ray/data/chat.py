"""Chat-template formatting with the target's HF tokenizer: training samples with loss masks, eval prompts.

Training (docs/algorithms.md#loss-mask): the template is re-applied after each message; the
tokens a message adds get mask 1 when it is an assistant message, but only its content and its closing
end-of-turn token (not the role header, not what the template writes after the end-of-turn token).
System and user tokens get 0. The sequence is truncated at ``max_len`` and the last position's mask is 0.

The template's own behaviour is kept: SmolLM2's template inserts a default system prompt when the
messages have none, so training samples and evaluation prompts both start with it.
"""

from __future__ import annotations

from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")


def _ids(encoded: Any) -> list[int]:
    """input_ids from whatever apply_chat_template returned (list, dict/BatchEncoding, nested batch)."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"expected one sequence from apply_chat_template, got {len(encoded)}")
        encoded = list(encoded[0])
    return [int(t) for t in encoded]


def render_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (no extra special tokens)."""
    encoded = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return _ids(encoded)


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of the tokens that close a turn in this tokenizer's template (plus eos)."""
    ids: set[int] = set()
    unk = tokenizer.unk_token_id
    for text in END_OF_TURN_TOKENS:  # (get_vocab() would be slow: it builds the whole vocabulary dict)
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id != unk and tokenizer.convert_ids_to_tokens(token_id) == text:
            ids.add(token_id)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], max_len: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation, built incrementally (docs/algorithms.md#loss-mask).

    Messages with empty content are skipped. Roles are passed to the template as given; only
    "assistant" messages are trained on.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    eot = end_of_turn_ids(tokenizer)
    kept = [m for m in messages if isinstance(m.get("content"), str) and m["content"].strip()]
    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(kept):
        full = render_ids(tokenizer, kept[: k + 1])
        start = _common_prefix(ids, full)
        if start < len(ids):  # re-tokenisation changed earlier tokens (not expected with special-token templates)
            ids, mask = ids[:start], mask[:start]
        new = full[start:]
        new_mask = [0] * len(new)
        if message["role"] == "assistant" and new:
            # The role header is what the message shares with an empty assistant message in its place.
            try:
                header = render_ids(tokenizer, [*kept[:k], {"role": "assistant", "content": ""}])
            except Exception:  # a template that refuses empty messages: fall back to the generation prompt
                header = render_ids(tokenizer, kept[:k], add_generation_prompt=True) if k else []
            content_start = max(_common_prefix(header, full), start) - start
            ends = [i for i in range(content_start, len(new)) if new[i] in eot]
            content_end = ends[-1] + 1 if ends else len(new)
            for i in range(content_start, content_end):
                new_mask[i] = 1
        ids.extend(new)
        mask.extend(new_mask)
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    if mask:
        mask[-1] = 0
    return ids, mask


def build_messages(turns: Sequence[str], answers: Sequence[str], system_prompt: str | None = None) -> list[dict[str, str]]:
    """[system] + user(q_1), assistant(a_1), …, user(q_n): the conversation asking turn n."""
    if not turns:
        raise ValueError("need at least one turn")
    if len(answers) < len(turns) - 1:
        raise ValueError(f"{len(turns)} turns need the answers of the first {len(turns) - 1}, got {len(answers)}")
    messages: list[dict[str, str]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    for i, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def build_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[str],
    answers: Sequence[str],
    system_prompt: str | None = None,
) -> list[int]:
    """Prompt ids for the last of `turns`, earlier turns answered by `answers` (MT-Bench turn 2 uses answer 1).

    `answers` holds the answers of turns[:-1] (extra answers are ignored). With no `system_prompt` the
    template's default applies. Ends with the assistant generation header.
    """
    return render_ids(tokenizer, build_messages(turns, answers, system_prompt), add_generation_prompt=True)
