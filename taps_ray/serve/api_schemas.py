"""Request and response bodies of the Serve app: the OpenAI-compatible subset it accepts and returns.

Pydantic models, so a malformed body becomes a 4xx that names the field (see api_errors.py), and FastAPI
publishes them in the OpenAPI schema.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_STOP = 4
MAX_PROMPTS = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def _absent_or(*neutral: Any):
    """A check that passes None and the given neutral values (what vLLM accepts for a feature it lacks)."""
    return lambda value: value is None or any(value == n for n in neutral)


# Standard OpenAI fields this service has no feature for: accepted at their neutral value, a 400 naming the field
# otherwise. Values: (check, what to send instead).
NEUTRAL = {
    "frequency_penalty": (_absent_or(0), "0"),
    "presence_penalty": (_absent_or(0), "0"),
    "repetition_penalty": (_absent_or(1), "1"),
    "logit_bias": (_absent_or({}), "{} or leave it out"),
    "store": (_absent_or(False), "false"),
    "echo": (_absent_or(False), "false"),
    "best_of": (_absent_or(1), "1"),
    "suffix": (_absent_or(""), "leave it out"),
    "tools": (_absent_or([]), "[] or leave it out (no tool calling)"),
    "functions": (_absent_or([]), "[] or leave it out (no function calling)"),
    "tool_choice": (_absent_or("none", "auto"), '"none" (no tool calling)'),
    "function_call": (_absent_or("none", "auto"), '"none" (no function calling)'),
    "response_format": (_absent_or({"type": "text"}), '{"type": "text"} (no JSON mode)'),
    "modalities": (_absent_or(["text"]), '["text"]'),
    "audio": (_absent_or(), "leave it out (text only)"),
    "prediction": (_absent_or(), "leave it out"),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk with usage (and empty choices) before [DONE]")
    continuous_usage_stats: bool = Field(False, description="accepted; usage comes only in the last chunk")


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
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer OpenAI name)")
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
    service_tier: str | None = Field(None, max_length=64, description="accepted and ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    frequency_penalty: float | None = Field(None, description="only 0 (no penalties)")
    presence_penalty: float | None = Field(None, description="only 0 (no penalties)")
    repetition_penalty: float | None = Field(None, description="vLLM extension; only 1")
    logit_bias: dict[str, float] | None = Field(None, description="only {}")
    store: bool | None = Field(None, description="only false")
    ignore_eos: bool = Field(False, description="vLLM extension: decode past the model's stop tokens up to max_tokens "
                             "(benchmark clients send it to fix the output length)")

    @field_validator("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "store")
    @classmethod
    def _neutral(cls, value: Any, info: Any) -> Any:
        return check_neutral(info.field_name, value)

    @model_validator(mode="after")
    def _stops_and_limits(self) -> "SamplingFields":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop holds {len(stops)} strings; give at most {MAX_STOP}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty; remove the empty string")
        if self.max_tokens is not None and self.max_completion_tokens is not None and (
            self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree; send only one of them")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_neutral(name: str, value: Any) -> Any:
    check, instead = NEUTRAL[name]
    if not check(value):
        raise ValueError(f"{name}={value!r} is not supported by this service; send {instead}")
    return value


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "routed", "prompt": "Question: what is 12 * 7?\nAnswer:", "temperature": 0,
                                         "max_tokens": 16}]}
    )
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ...,
        description=f"text, token ids of the target's tokenizer, or a list of up to {MAX_PROMPTS} of either (one "
        "choice per prompt); none may be empty",
        examples=["2+2="],
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_COMPLETION_LOGPROBS,
        description="log-probabilities of the chosen tokens and this many most likely ones, from the target",
    )
    echo: bool | None = Field(None, description="only false")
    best_of: int | None = Field(None, description="only 1")
    suffix: str | None = Field(None, description="not supported: leave it out")

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _neutral_completion(cls, value: Any, info: Any) -> Any:
        return check_neutral(info.field_name, value)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int] | list[list[int]]:
        if len(value) == 0:
            raise ValueError("is empty; send at least one character (or one token id)")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"holds {len(value)} prompts; send at most {MAX_PROMPTS} per request")
            if any(len(p) == 0 for p in value):
                raise ValueError("holds an empty prompt; every prompt needs at least one character (or token id)")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: a list of token ids is one prompt, a list of strings or of id lists is several."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="developer is read as system")
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
    logprobs: bool | None = Field(None, description="return the chosen tokens' log-probabilities under the target")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many most "
                                     "likely tokens per position")
    tools: list[dict[str, Any]] | None = Field(None, description="only [] (no tool calling)")
    tool_choice: str | dict[str, Any] | None = Field(None, description='only "none" (or "auto" without tools)')
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored (no tools)")
    functions: list[dict[str, Any]] | None = Field(None, description="only []")
    function_call: str | dict[str, Any] | None = Field(None, description='only "none"')
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')
    modalities: list[str] | None = Field(None, description='only ["text"]')
    audio: dict[str, Any] | None = Field(None, description="not supported: leave it out")
    prediction: dict[str, Any] | None = Field(None, description="not supported: leave it out")
    reasoning_effort: str | None = Field(None, max_length=32, description="accepted and ignored")

    @field_validator("tools", "tool_choice", "functions", "function_call", "response_format", "modalities", "audio",
                     "prediction")
    @classmethod
    def _neutral_chat(cls, value: Any, info: Any) -> Any:
        return check_neutral(info.field_name, value)

    @field_validator("messages")
    @classmethod
    def _has_text(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if value and not any(m.text.strip() for m in value):
            raise ValueError("every message is empty; give at least one message some text")
        return value

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
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
                                            "(\"merged\": a merged tree; \"none\": only the root verified: the batch "
                                            "did not draft (serve.draft_below, serve.measure_drafting) or the cost "
                                            "model paused the sequence)")
    batch_size: int = Field(description="the most sequences that shared one of this request's verification steps")
    decode_s: float = Field(description="seconds from joining the running batch to the last token")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class _Choice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length"]


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    speculative: Speculative


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None


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
