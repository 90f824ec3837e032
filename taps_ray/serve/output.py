"""What the Serve app returns from decoded tokens: text cut at stop strings, log-probabilities, usage, the
`speculative` block, and the streamed pieces of one choice.

Stop strings: `TextOutput.stop_rule` is handed to the engine, which ends decoding at the step that completes
one and keeps tokens only up to the token that completed it, so `usage.completion_tokens` counts what was
returned (as vLLM does); the text is then cut before the stop string.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from taps_ray.decoding.continuous import Result, TokenLogprob
from taps_ray.decoding.step import tau
from taps_ray.serve.api_schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    Speculative,
    TopLogprob,
    Usage,
)
from taps_ray.serve.scheduler import head_steps


class TextOutput:
    """Token ids -> text for one tokenizer: a final stop token is dropped, special tokens are skipped."""

    def __init__(self, tokenizer: Any, stop_ids: list[int]) -> None:
        self.tokenizer, self.stop_ids = tokenizer, set(stop_ids)

    def text(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        return self.decode(tokens)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def stop_rule(self, stops: list[str]) -> Callable[[list[int], int], int | None] | None:
        """For the engine: how many tokens to keep once one of `stops` appears in the last `new` tokens' text.
        One rule per request: it follows the request's text through an `IncrementalText`, so a step decodes a
        window, not the whole sequence (the rule runs on the compute thread, between steps)."""
        if not stops:
            return None

        decoded = IncrementalText(self)

        def rule(tokens: list[int], new: int) -> int | None:
            nonlocal decoded
            if tokens[: len(decoded.tokens)] != decoded.tokens:  # not the same sequence grown: start again
                decoded = IncrementalText(self)
            decoded.add(tokens[len(decoded.tokens) :])
            text = decoded.current()
            if not any(s in text for s in stops):
                return None
            for keep in range(len(tokens) - new + 1, len(tokens) + 1):  # once per request: whole decodes
                text = self.text(tokens[:keep])
                if any(s in text for s in stops):
                    return keep
            return None

        return rule

    def finish(self, result: Result, stops: list[str]) -> tuple[str, str]:
        """The returned text and finish_reason."""
        text = self.text(result.generation.tokens)
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        return text, "stop" if result.generation.finished_by == "stop" else "length"

    def token(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(lp.token, lp.logprob).model_dump(), top_logprobs=[top(t, v) for t, v in lp.top])
            for lp in logprobs
        ])

    def completion_logprobs(self, logprobs: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        tokens = [self.token(lp.token) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{self.token(t): v for t, v in lp.top} for lp in logprobs],
            text_offset=offsets,
        )


def usage(results: list[Result]) -> Usage:
    prompt = sum(len(r.generation.prompt) for r in results)
    completion = sum(len(r.generation.tokens) for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def speculative(results: list[Result], proposer: str, head_names: list[str]) -> Speculative:
    """The `speculative` block of one response (over its choices when a request has several prompts)."""
    steps = [s for r in results for s in r.generation.steps]
    counts: Counter = Counter()
    for result in results:
        counts.update(head_steps(result, head_names))
    total = sum(counts.values())
    committed = sum(s.accepted + 1 for s in steps)
    return Speculative(
        proposer=proposer,
        tau=round(tau(steps), 4),
        tau_taps=round(committed / max(len(steps) - len(results), 1), 4),
        steps=len(steps),
        accepted_tokens=sum(s.accepted for s in steps),
        head_fractions={name: round(n / total, 4) for name, n in counts.items()} if total else {},
        batch_size=max(r.max_batch for r in results),
        decode_s=round(max(r.generation.wall_s for r in results), 4),
    )


class IncrementalText:
    """Token ids -> text, decoding only a short window per new token instead of the whole sequence (a stream of
    n tokens decoded whole at every step costs O(n^2): 2,048 tokens of SmolLM2 took 0.43 s of the replica's event
    loop per stream, against 0.014 s through the window, AMD EPYC). The window is the usual one of incremental
    detokenizers (TGI, vLLM): the tokens since `prefix` decoded with and without the new ones, the difference
    being the new text, taken only once it does not end in a partial UTF-8 character. Both decodes start at the
    same token, so a tokenizer's treatment of a sequence's first token (SentencePiece's leading space) cancels
    out. Decoded as `TextOutput.text`: special tokens skipped, a final stop token left out."""

    def __init__(self, output: TextOutput) -> None:
        self.output = output
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = 0  # the window's first token
        self.read = 0  # the tokens before this one are in `text`
        self.pending: str | None = ""  # the text of the tokens after `read` so far (None: unknown)

    def add(self, tokens: list[int]) -> None:
        """Append `tokens`; `text` grows by what became readable."""
        self.tokens += tokens
        end = len(self.tokens) - (1 if self.tokens and self.tokens[-1] in self.output.stop_ids else 0)
        if end <= self.read:
            self.pending = ""
            return
        decode = self.output.decode
        before = decode(self.tokens[self.prefix : self.read])
        after = decode(self.tokens[self.prefix : end])
        if after.endswith("\ufffd") or not after.startswith(before):  # a character still incomplete: wait
            self.pending = after[len(before) :] if after.startswith(before) else None
            return
        piece, self.pending = after[len(before) :], ""
        self.text += piece
        if piece:
            self.prefix = self.read
        self.read = end

    def current(self) -> str:
        """The whole decode of the tokens so far (`TextOutput.text`), an incomplete last character included."""
        return self.text + self.pending if self.pending is not None else self.output.text(self.tokens)


class ChoiceStream:
    """The streamed text of one choice. Text is sent only once it can no longer change: not while it ends in a
    partial UTF-8 character, and never the last len(longest stop)-1 characters, which a stop string could still
    claim. So the pieces always concatenate to exactly the non-streamed text."""

    def __init__(self, output: TextOutput, stops: list[str]) -> None:
        self.output, self.stops = output, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.decoded = IncrementalText(output)
        self.sent = ""
        self.logprobs: list[TokenLogprob] = []  # not yet sent

    def add(self, tokens: list[int], logprobs: list[TokenLogprob]) -> str:
        """The piece of text that became final with these tokens ("" if none)."""
        self.logprobs += logprobs
        self.decoded.add(tokens)
        text = self.decoded.text
        safe = min([len(text) - self.hold, *[text.find(s) for s in self.stops if s in text]])
        if safe <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) : safe], text[:safe]
        return piece

    def close(self, result: Result) -> tuple[str, str]:
        """The rest of the text and the finish_reason."""
        text, finish = self.output.finish(result, self.stops)
        rest = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return rest, finish

    def take_logprobs(self) -> list[TokenLogprob]:
        taken, self.logprobs = self.logprobs, []
        return taken
