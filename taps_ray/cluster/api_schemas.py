"""Request and response bodies of the Serve app: the OpenAI-compatible subset it accepts and returns.

Pydantic models, so a malformed body becomes a 4xx that names the field (see api_errors.py), and FastAPI
publishes them in the OpenAPI schema.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_STOP = 4


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str = Field(
        ...,
        min_length=1,
        max_length=128,
        description="proposer: plain, a head (math, chat, ...), routed (= confidence-routed), merged, ... "
        "GET /v1/models lists what this service has loaded",
        examples=["routed"],
    )
    max_tokens: int | None = Field(
        None, ge=1, description="tokens to generate, 1..serve.max_tokens_limit (default serve.default_max_tokens)"
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="0 = greedy, up to 2")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="nucleus mass in (0, 1]")
    top_k: int = Field(0, ge=0, le=1_000_000, description="extension: keep the k most likely tokens (0 = all)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="sampling seed (random when absent)")
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP} strings; the text is cut before the first one that appears"
    )
    n: int = Field(1, ge=1, le=1, description="choices per request; only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _stops(self) -> "SamplingFields":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop holds {len(stops)} strings; give at most {MAX_STOP}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty; remove the empty string")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "routed", "prompt": "Question: what is 12 * 7?\nAnswer:", "temperature": 0,
                                         "max_tokens": 16}]}
    )
    prompt: str | list[int] = Field(
        ..., description="text, or token ids of the target's tokenizer; must not be empty", examples=["2+2="]
    )

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list[int]) -> str | list[int]:
        if len(value) == 0:
            raise ValueError("is empty; send at least one character (or one token id)")
        return value


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "routed", "messages": [{"role": "user", "content": "What is 12 * 7?"}],
                                         "temperature": 0, "max_tokens": 16}]}
    )
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer OpenAI name)")

    @field_validator("messages")
    @classmethod
    def _has_text(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if value and not any(m.text.strip() for m in value):
            raise ValueError("every message is empty; give at least one message some text")
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None and (
            self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree; send only one of them")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Speculative(BaseModel):
    proposer: str = Field(description="the registry name of the proposer that drafted")
    tau: float = Field(description="mean tokens committed per target verification step (the prefill's token excluded)")
    tau_taps: float = Field(description="TAPS/EAGLE definition: untrimmed committed tokens / (steps - 1)")
    steps: int = Field(description="target verification steps")
    accepted_tokens: int = Field(description="drafted tokens the target accepted")
    head_fractions: dict[str, float] = Field(description="fraction of steps whose verified tree each head drafted "
                                            "(\"merged\": a merged tree; \"none\": drafting paused by serve.draft_below)")
    batch_size: int = Field(description="sequences that shared this request's batched verification")
    decode_s: float = Field(description="wall time of the batched decode this request was part of")


class _Choice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    speculative: Speculative


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ChatCompletionMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "taps-ray"
    proposer: str
    heads: list[str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
