"""Ray Serve app: the target plus the specialised draft heads behind an OpenAI-compatible HTTP API.

Three ways to start it (docs/serve.md), all on loopback by default:

    serve run taps_ray.cluster.serve:app_builder config=configs/cpu.yaml
    serve run configs/serve.yaml            # or `serve deploy configs/serve.yaml` on a running cluster
    taps serve --config configs/cpu.yaml

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true), GET /v1/models,
GET /healthz, GET /openapi.json. The request's `model` names the proposer: `plain` (the target alone), a
head by its mixture (`math`, `chat`, ...), `routed` (= `confidence-routed`), `merged` or any other
registered combination. Every response carries `usage` and a `speculative` block (tau, steps, the fraction
of steps each head drafted, how many sequences shared the verification batch).

Batching: every request becomes one `Job`; `TapsService.decode` is a `@serve.batch` method, so requests
that arrive within `serve.batch_wait_timeout_s` of each other (up to `serve.max_batch_size`) reach it
together. It groups them by (proposer, sampling parameters) and runs ONE `generate(...)` per group, i.e.
one batched target forward per verification step for all of the group's prompts, each with its own seed.
Requests with different `max_tokens` share a group: the group decodes to the largest and each output is
cut at its own limit, which is exact (a sequence's tokens never depend on how long it is allowed to run).

Validation: bodies are pydantic models; malformed JSON, wrong types and out-of-range values become 400/422
with the field, the problem and the fix; limits that depend on the running service (known models, prompt
length in tokens, max_tokens_limit, vocabulary) are checked in the handlers and also published in the
OpenAPI schema (model enum, max_tokens maximum). Only an unexpected failure of the service is a 5xx.
"""

# No `from __future__ import annotations`: Serve's FastAPI class-based views need real annotations on the
# endpoint methods (string annotations make FastAPI read a pydantic body as a missing query parameter).

import asyncio
import json
import logging
import math
import random
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from taps_ray.config import HeadKind, StudyConfig, load_config, parse_config

logger = logging.getLogger("ray.serve")

APP_NAME = "taps"
ALIASES = {"routed": "confidence-routed"}
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_SEED = 2**63 - 1
MAX_STOP = 4
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6

# --- request and response schemas (OpenAI-compatible subset) -------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
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
    def _stops(self) -> "_Sampling":
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop holds {len(stops)} strings; give at most {MAX_STOP}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty; remove the empty string")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
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


class ChatCompletionRequest(_Sampling):
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
    head_fractions: dict[str, float] = Field(description="fraction of steps whose verified tree each head drafted")
    batch_size: int = Field(description="sequences that shared this request's batched verification")
    decode_s: float = Field(description="wall time of the batched decode this request was part of")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: Speculative


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


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


# --- errors --------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request this service refuses; `status` is always 4xx for bad input."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


_HINTS = {
    "temperature": "use a number from 0 (greedy) to 2",
    "top_p": "use a number in (0, 1]; 1 disables nucleus filtering",
    "top_k": "use an integer >= 0; 0 keeps the whole vocabulary",
    "max_tokens": "use an integer >= 1 (at most the service's max_tokens_limit, see GET /openapi.json)",
    "max_completion_tokens": "use an integer >= 1 (at most the service's max_tokens_limit)",
    "n": "only n=1 is supported; send one request per choice",
    "model": "name a model listed by GET /v1/models, e.g. plain or routed",
    "messages": 'send a non-empty list like [{"role": "user", "content": "Hi"}]',
    "prompt": "send a non-empty string or a list of token ids",
    "seed": f"use an integer from 0 to {MAX_SEED}",
    "stream": "use true or false",
    "role": "use system, user or assistant",
    "content": "use a string (or a list of {type: text, text: ...} parts)",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line per problem: where, what is wrong, what to send instead."""
    lines, first_param = [], None
    for item in errors[:8]:
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        # pydantic reports union members as extra loc parts (str, list[int], function-after[...]); drop them
        loc = [p for p in loc if not (p in _TYPE_TAGS or "[" in p or p.startswith("function-"))] or loc
        where = ".".join(loc) or "body"
        first_param = first_param or where
        kind = item.get("type", "")
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if kind == "json_invalid":
            detail = (item.get("ctx") or {}).get("error", "")
            return f"request body is not valid JSON ({detail}); send a JSON object", None
        if kind == "missing":
            message = "required field is missing"
        elif kind == "extra_forbidden":
            message = "unknown field; check its spelling or remove it"
        elif kind in ("model_type", "model_attributes_type", "dict_type") and where == "body":
            message = "request body must be a JSON object"
        leaf = next((p for p in reversed(loc) if not p.isdigit()), "")
        hint = _HINTS.get(leaf)
        value = item.get("input")
        shown = "" if kind in ("missing", "extra_forbidden", "value_error") or not loc else f" (got {_short(value)})"
        add_hint = hint and kind not in ("extra_forbidden", "value_error")
        lines.append(f"{where}: {message}{shown}" + (f"; {hint}" if add_hint else ""))
    more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
    return "invalid request: " + "; ".join(lines) + more, first_param


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


async def _on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    message, param = _describe_validation(list(error.errors()))
    status = 400 if message.startswith("request body is not valid JSON") else 422
    return _error(status, message, param, "invalid_json" if status == 400 else "invalid_value")


async def _on_api_error(request: Request, error: ApiError) -> JSONResponse:
    return _error(error.status, error.message, error.param, error.code)


async def _on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    message = str(error.detail)
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /openapi.json for the endpoints"
    elif error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; see GET /openapi.json"
    return _error(error.status_code, message, None, "http_error")


async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error(500, f"internal error ({type(error).__name__}); the service log has the traceback", None, "internal")


api = FastAPI(
    title="taps-ray",
    description="Task-aware speculative decoding (TAPS) behind an OpenAI-compatible API",
    version="0.1.0",
    openapi_url=None,  # served by the deployment, with the service's live limits filled in
    docs_url=None,
    redoc_url=None,
)
api.add_exception_handler(RequestValidationError, _on_validation_error)
api.add_exception_handler(ApiError, _on_api_error)
api.add_exception_handler(StarletteHTTPException, _on_http_error)
api.add_exception_handler(Exception, _on_unexpected)

_ERRORS = {
    400: {"model": ErrorResponse, "description": "malformed JSON or an input the service cannot take"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    422: {"model": ErrorResponse, "description": "a field has the wrong type or is out of range"},
}

# --- decoding jobs -------------------------------------------------------------------------------------------


@dataclass
class Job:
    proposer: str
    temperature: float
    top_p: float
    top_k: int
    prompt: list[int]
    max_tokens: int
    seed: int
    listener: Callable[[list[int]], None] | None = None  # streaming: called (from the decode thread) per step

    @property
    def group(self) -> tuple:
        """Requests that can share one generate() call: same proposer and sampling parameters."""
        if self.temperature == 0.0:  # greedy ignores top_p / top_k
            return (self.proposer, 0.0, 1.0, 0)
        return (self.proposer, self.temperature, self.top_p, self.top_k)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    speculative: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class _Observed:
    """A Verifier that hands every sequence's committed tokens to its listener as each step finishes."""

    def __init__(self, inner: Any, jobs: list[Job]) -> None:
        self.inner, self.jobs = inner, jobs

    def _tell(self, results: list[Any]) -> list[Any]:
        for job, committed in zip(self.jobs, results):
            listener = job.listener
            if listener is not None and committed is not None:
                try:
                    listener(list(committed.tokens))
                except Exception:  # a vanished client must not stop the batch
                    logger.debug("stream listener failed", exc_info=True)
        return results

    def start(self, prompts: list[list[int]], params: Any, seeds: list[int]) -> list[Any]:
        return self._tell(self.inner.start(prompts, params, seeds))

    def step(self, trees: list[Any]) -> list[Any]:
        return self._tell(self.inner.step(trees))


def _trim(generation: Any, limit: int) -> tuple[list[int], str, list[Any], list[int]]:
    """Cut a generation at `limit` tokens: (tokens, finish_reason, kept steps, tokens per kept step)."""
    tokens = list(generation.tokens[:limit])
    finish = generation.finished_by if len(generation.tokens) <= limit else "length"
    steps, counts, have = [], [], min(1, len(tokens))
    for step in generation.steps:
        if have >= len(tokens):
            break
        take = min(step.new_tokens, len(tokens) - have)
        steps.append(step)
        counts.append(take)
        have += take
    return tokens, finish or "length", steps, counts


def _head_fractions(steps: list[Any], head_names: list[str]) -> dict[str, float]:
    if not head_names or not steps:
        return {}
    counts: dict[str, int] = defaultdict(int)
    for step in steps:
        name = "merged" if step.head < 0 else (head_names[step.head] if step.head < len(head_names) else str(step.head))
        counts[name] += 1
    return {name: round(count / len(steps), 4) for name, count in counts.items()}


def _resolve_paths(cfg: StudyConfig, base: Path) -> StudyConfig:
    """Absolute work_dir / reports_dir, so replicas find the heads whatever their working directory."""
    update = {}
    for name in ("work_dir", "reports_dir"):
        path = Path(getattr(cfg, name)).expanduser()
        update[name] = str(path if path.is_absolute() else (base / path).resolve())
    return cfg.model_copy(update=update)


# --- the deployment ------------------------------------------------------------------------------------------


@serve.deployment(name="TapsService")
@serve.ingress(api)
class TapsService:
    """One replica: the target, every head that exists, and a proposer per servable model name."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from taps_ray.models.target import load_target
        from taps_ray.spec.draft_vocab import draft_vocabulary
        from taps_ray.spec.registry import build_proposer, proposer_names

        self.cfg = parse_config(config, "<serve deployment>")
        serve_cfg = self.cfg.serve
        torch.set_num_threads(max(1, math.ceil(serve_cfg.replica_num_cpus)))
        self.target = load_target(self.cfg.target)
        self.tokenizer = self.target.tokenizer
        self.stop_ids = self.target.stop_token_ids
        self.vocab_size = int(self.target.model.get_input_embeddings().weight.shape[0])
        self.kind = serve_cfg.head_kind
        self.heads, self.missing = self._load_heads()
        vocab = draft_vocabulary(self.cfg, self.tokenizer, self.stop_ids) if self.heads else None
        self.proposers: dict[str, Any] = {"plain": build_proposer("plain", self.target, {}, self.cfg.tree)}
        for name in self.heads:
            self.proposers[name] = build_proposer(name, self.target, self.heads, self.cfg.tree, vocab)
        mixtures = self.cfg.train.mixtures
        combinations = [n for n in proposer_names(self.cfg) if n != "plain" and n not in mixtures]
        if all(m in self.heads for m in mixtures[:2]) and len(mixtures) >= 2:
            for name in combinations:
                try:
                    self.proposers[name] = build_proposer(name, self.target, self.heads, self.cfg.tree, vocab)
                except Exception as error:  # a combination that cannot use these heads is left out, not fatal
                    logger.warning("combination %r left out: %s", name, error)
        self.max_tokens_limit = serve_cfg.max_tokens_limit
        self.default_max_tokens = min(serve_cfg.default_max_tokens, serve_cfg.max_tokens_limit)
        self.created = int(time.time())
        self._openapi: dict[str, Any] | None = None
        self.decode.set_max_batch_size(serve_cfg.max_batch_size)
        self.decode.set_batch_wait_timeout_s(serve_cfg.batch_wait_timeout_s)
        logger.info(
            "taps serve: target %s, %s heads %s, models %s", self.cfg.target.name, self.kind,
            sorted(self.heads), self.model_names(),
        )

    def _load_heads(self) -> tuple[dict[str, Any], list[str]]:
        from taps_ray.spec.registry import head_dir, load_heads

        heads, missing = {}, []
        for mixture in self.cfg.train.mixtures:
            if not head_dir(self.cfg, self.kind, mixture).is_dir():
                missing.append(mixture)
                continue
            heads.update(load_heads(self.cfg, self.kind, self.target.dtype, mixtures=[mixture]))
        if missing:
            logger.warning(
                "taps serve: no trained %s head for %s under %s, so only %s can be served; train them with "
                "`taps train --config <cfg> --kind %s --mixture <name>` (or `make sweep`) and restart the service",
                self.kind, ", ".join(missing), self.cfg.work_path("heads"),
                ", ".join(["plain", *heads]) or "plain", self.kind,
            )
        return heads, missing

    # -- model names ----------------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        reverse = {v: k for k, v in ALIASES.items()}
        return [reverse.get(name, name) for name in self.proposers]

    def _proposer_for(self, model: str) -> str:
        name = ALIASES.get(model, model)
        if name in self.proposers:
            return name
        known = ", ".join(self.model_names())
        if name in self.cfg.train.mixtures or name in ("confidence-routed", "merged") or model in ALIASES:
            raise ApiError(
                404,
                f"model {model!r} is not loaded: this service found no trained {self.kind} heads for "
                f"{', '.join(self.missing) or 'it'}; available: {known}. Train the heads "
                f"(`taps train --kind {self.kind} ...`) and restart, or use one of the available models",
                "model",
                "model_not_found",
            )
        raise ApiError(404, f"unknown model {model!r}; choose one of: {known} (GET /v1/models)", "model", "model_not_found")

    # -- validation shared by both endpoints -----------------------------------------------------------------

    def _job(self, body: _Sampling, prompt: list[int], max_tokens: int | None) -> Job:
        proposer = self._proposer_for(body.model)
        if not prompt:
            raise ApiError(400, "the prompt has no tokens; send some text", "prompt", "empty_prompt")
        limit = self.cfg.serve.max_prompt_tokens
        if len(prompt) > limit:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens but this service takes at most {limit} "
                "(serve.max_prompt_tokens); shorten the prompt or drop earlier messages",
                "prompt",
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise ApiError(
                422,
                f"max_tokens={max_tokens} is out of range; use 1..{self.max_tokens_limit} (serve.max_tokens_limit)",
                "max_tokens",
                "invalid_value",
            )
        seed = body.seed if body.seed is not None else random.getrandbits(63)
        # Numerical floors (the engine samples in float32): logits / T overflows for T below ~1e-37 and a top_p
        # below float32's smallest value rounds to 0 and drops every token. top_p < 1e-6 keeps only the most
        # likely token exactly like 1e-6 does (its probability is >= 1/vocab > 1e-6); T < 1e-6 is as sharp.
        temperature = body.temperature if body.temperature == 0 else max(body.temperature, MIN_TEMPERATURE)
        top_p = max(body.top_p, MIN_TOP_P)
        return Job(proposer, temperature, top_p, body.top_k, prompt, max_tokens, seed)

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                422,
                f"prompt holds token ids outside the vocabulary (e.g. {bad[0]}); use ids in 0..{self.vocab_size - 1} "
                "or send the prompt as text",
                "prompt",
                "invalid_value",
            )
        return list(prompt)

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        from taps_ray.data.chat import render_ids

        turns = [{"role": m.role, "content": m.text} for m in messages]
        try:
            return render_ids(self.tokenizer, turns, add_generation_prompt=True)
        except Exception as error:  # a chat template that rejects this message order
            raise ApiError(
                422, f"the chat template cannot render these messages ({error}); check the roles' order", "messages",
                "invalid_value",
            ) from None

    # -- batched decoding ------------------------------------------------------------------------------------

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.01)  # limits reset from the config in __init__
    async def decode(self, jobs: list[Job]) -> list[Outcome]:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[job.group].append(i)
        outcomes: list[Outcome] = [Outcome(error="not run")] * len(jobs)
        for indices in groups.values():
            members = [jobs[i] for i in indices]
            try:
                results = await asyncio.to_thread(self._run_group, members)
            except Exception as error:
                logger.exception("decoding a batch of %d failed", len(members))
                results = [Outcome(error=f"{type(error).__name__}: {error}")] * len(members)
            for i, result in zip(indices, results):
                outcomes[i] = result
        return outcomes

    def _run_group(self, jobs: list[Job]) -> list[Outcome]:
        from taps_ray.spec.generate import run_loop
        from taps_ray.spec.target_batch import TargetBatch
        from taps_ray.spec.verify import SamplingParams

        first = jobs[0]
        params = SamplingParams(temperature=first.temperature, top_p=first.top_p, top_k=first.top_k)
        proposer = self.proposers[first.proposer]
        verifier = _Observed(TargetBatch(self.target.model), jobs)
        generations = run_loop(
            verifier,
            proposer,
            [job.prompt for job in jobs],
            params,
            max(job.max_tokens for job in jobs),
            self.stop_ids,
            seeds=[job.seed for job in jobs],
        )
        outcomes = []
        for job, generation in zip(jobs, generations):
            tokens, finish, steps, counts = _trim(generation, job.max_tokens)
            committed = sum(counts)
            speculative = Speculative(
                proposer=first.proposer,
                tau=round(committed / len(steps), 4) if steps else 0.0,
                tau_taps=round(sum(s.accepted + 1 for s in steps) / max(len(steps) - 1, 1), 4) if steps else 0.0,
                steps=len(steps),
                accepted_tokens=sum(s.accepted for s in steps),
                head_fractions=_head_fractions(steps, list(proposer.head_names)),
                batch_size=len(jobs),
                decode_s=round(generation.wall_s, 4),
            )
            outcomes.append(
                Outcome(
                    tokens=tokens,
                    finish_reason="stop" if finish == "stop" else "length",
                    speculative=speculative.model_dump(),
                )
            )
        return outcomes

    async def _run(self, job: Job) -> Outcome:
        outcome = await self.decode(job)
        if outcome.error is not None:
            raise RuntimeError(f"decoding failed: {outcome.error}")
        return outcome

    # -- text ------------------------------------------------------------------------------------------------

    def _text(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _finish(self, outcome: Outcome, stops: list[str]) -> tuple[str, str]:
        text, finish = self._text(outcome.tokens), outcome.finish_reason
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        return text, finish

    @staticmethod
    def _usage(prompt: list[int], outcome: Outcome) -> Usage:
        return Usage(
            prompt_tokens=len(prompt), completion_tokens=len(outcome.tokens), total_tokens=len(prompt) + len(outcome.tokens)
        )

    # -- endpoints -------------------------------------------------------------------------------------------

    @api.get("/healthz", summary="liveness and what is loaded")
    def healthz(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "target": self.cfg.target.name,
            "head_kind": self.kind,
            "heads": sorted(self.heads),
            "missing_heads": self.missing,
            "models": self.model_names(),
        }

    @api.get("/v1/models", response_model=ModelList, summary="the models (proposers) this service can use")
    def models(self) -> ModelList:
        cards = []
        for model in self.model_names():
            proposer = self.proposers[ALIASES.get(model, model)]
            cards.append(ModelCard(id=model, created=self.created, proposer=proposer.name, heads=list(proposer.head_names)))
        return ModelList(data=cards)

    @api.get("/openapi.json", include_in_schema=False)
    def openapi(self, request: Request) -> JSONResponse:
        if self._openapi is None:
            schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=request.app.routes)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                properties = components.get(name, {}).get("properties", {})
                if "model" in properties:
                    properties["model"] = {**properties["model"], "enum": self.model_names()}
                for key in ("max_tokens", "max_completion_tokens"):
                    for option in properties.get(key, {}).get("anyOf", []):
                        if option.get("type") == "integer":
                            option["maximum"] = self.max_tokens_limit
            self._openapi = schema
        return JSONResponse(self._openapi)

    @api.get("/docs", include_in_schema=False)
    def docs(self) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="openapi.json", title="taps-ray API")

    @api.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS, summary="text completion")
    async def completions(self, body: CompletionRequest):
        prompt = self._completion_prompt(body.prompt)
        job = self._job(body, prompt, body.max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(piece: str, reason: str | None) -> dict[str, Any]:
            return {
                "id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}],
            }

        if body.stream:
            return self._stream(job, body.stop_strings, chunk)
        outcome = await self._run(job)
        text, finish = self._finish(outcome, body.stop_strings)
        return CompletionResponse(
            id=rid,
            created=created,
            model=body.model,
            choices=[CompletionChoice(index=0, text=text, finish_reason=finish)],
            usage=self._usage(prompt, outcome),
            speculative=Speculative(**outcome.speculative),
        )

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS, summary="chat completion")
    async def chat_completions(self, body: ChatCompletionRequest):
        prompt = self._chat_prompt(body.messages)
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        job = self._job(body, prompt, max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def chunk(piece: str, reason: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": piece} if piece or reason is None else {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            return {
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}],
            }

        if body.stream:
            return self._stream(job, body.stop_strings, chunk)
        outcome = await self._run(job)
        text, finish = self._finish(outcome, body.stop_strings)
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=body.model,
            choices=[ChatChoice(index=0, message=ChatCompletionMessage(content=text), finish_reason=finish)],
            usage=self._usage(prompt, outcome),
            speculative=Speculative(**outcome.speculative),
        )

    def _stream(self, job: Job, stops: list[str], make_chunk: Callable[[str, str | None], dict]) -> StreamingResponse:
        """Server-sent events, one chunk per verification step as the batch decodes, then usage and [DONE].

        Text is sent only once it can no longer change: not while it ends in a partial UTF-8 character, and
        (with stop strings) never the last len(longest stop)-1 characters, which a stop string could still
        claim. So the chunks always concatenate to exactly the non-streamed text.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        job.listener = lambda tokens: loop.call_soon_threadsafe(queue.put_nowait, tokens)
        task = asyncio.ensure_future(self._run(job))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        stop_ids, hold = set(self.stop_ids), max((len(x) for x in stops), default=1) - 1

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            tokens: list[int] = []
            sent, done = "", False
            try:
                while (new := await queue.get()) is not None:
                    for token in new:
                        if done:
                            break
                        tokens.append(token)
                        done = token in stop_ids or len(tokens) >= job.max_tokens
                    text = self._text(tokens)
                    if text.endswith("\ufffd") or not text.startswith(sent):
                        continue
                    safe = len(text) - hold
                    cuts = [text.find(x) for x in stops if x in text]
                    safe = min([safe, *cuts])
                    if safe > len(sent):
                        yield event(make_chunk(text[len(sent) : safe], None))
                        sent = text[:safe]
                outcome = await task
            except Exception as error:  # the decode failed after the stream began: say so in the stream
                logger.exception("streamed decode failed")
                yield event(ErrorResponse(error=ErrorDetail(message=f"decoding failed: {error}", type="server_error")).model_dump())
                yield "data: [DONE]\n\n"
                return
            finally:
                if not task.done():  # the client went away; the batch still finishes, nobody listens
                    job.listener = None
            text, finish = self._finish(outcome, stops)
            if not text.startswith(sent):  # cannot happen with monotone decoding; never send a wrong total
                logger.warning("streamed prefix %r is not a prefix of the final text %r", sent, text)
            elif len(text) > len(sent):
                yield event(make_chunk(text[len(sent) :], None))
            last = make_chunk("", finish)
            last["usage"] = self._usage(job.prompt, outcome).model_dump()
            last["speculative"] = outcome.speculative
            yield event(last)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# --- building and starting the application -------------------------------------------------------------------


class AppArgs(BaseModel):
    """Arguments of `app_builder` (`serve run taps_ray.cluster.serve:app_builder key=value ...`)."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field("configs/cpu.yaml", description="study config; relative paths: cwd first, then the repo root")
    head_kind: HeadKind | None = None
    work_dir: str | None = None
    num_replicas: int | None = Field(None, gt=0)
    max_batch_size: int | None = Field(None, gt=0)


def _find_config(path: str) -> tuple[StudyConfig, Path]:
    """Load a config; a relative path is tried against the working directory, then the repository root.

    Returns the config and the directory its relative work_dir is resolved against (the same one).
    """
    candidate = Path(path).expanduser()
    if not candidate.is_absolute() and not candidate.is_file() and (REPO_ROOT / candidate).is_file():
        return load_config(REPO_ROOT / candidate), REPO_ROOT
    return load_config(candidate), Path.cwd()


def build_app(cfg: StudyConfig, base_dir: str | Path | None = None) -> serve.Application:
    """The bound Serve application for a study config (replicas, batch limits and heads from `cfg.serve`)."""
    cfg = _resolve_paths(cfg, Path(base_dir) if base_dir is not None else Path.cwd())
    s = cfg.serve
    return TapsService.options(
        num_replicas=s.num_replicas,
        max_ongoing_requests=max(s.max_ongoing_requests, s.max_batch_size),
        ray_actor_options={"num_cpus": s.replica_num_cpus},
    ).bind(cfg.model_dump(mode="json"))


def app_builder(args: dict[str, str]) -> serve.Application:
    """Serve application builder: `serve run taps_ray.cluster.serve:app_builder config=configs/cpu.yaml`."""
    try:
        parsed = AppArgs.model_validate(args or {})
    except ValidationError as error:
        raise ValueError(f"bad app_builder args {args}: {error}; known args: {', '.join(AppArgs.model_fields)}") from None
    cfg, base = _find_config(parsed.config)
    serve_update = {k: v for k, v in {"head_kind": parsed.head_kind, "num_replicas": parsed.num_replicas,
                                       "max_batch_size": parsed.max_batch_size}.items() if v is not None}
    if serve_update:
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update=serve_update)})
    if parsed.work_dir:
        cfg = cfg.model_copy(update={"work_dir": parsed.work_dir})
    return build_app(cfg, base)


def start(cfg: StudyConfig, host: str | None = None, port: int | None = None, base_dir: str | Path | None = None) -> str:
    """Start Serve's HTTP proxy on host:port and deploy the app (Ray must be initialised); returns the URL."""
    host = host or cfg.serve.host
    port = port or cfg.serve.port
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(cfg, base_dir), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def cmd_serve(cfg: StudyConfig, host: str | None = None, port: int | None = None, blocking: bool = True) -> str:
    """`taps serve`: a local loopback Ray (unless cfg.ray.address joins one), the app, then block until Ctrl-C."""
    import ray

    started_ray = False
    if not ray.is_initialized():
        if cfg.ray.address:
            ray.init(address=cfg.ray.address)
        else:
            ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
        started_ray = True
    url = start(cfg, host, port)
    print(f"taps serve: {url}  (models: GET {url}/v1/models, health: GET {url}/healthz; Ctrl-C stops)", flush=True)
    if not blocking:
        return url
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("taps serve: shutting down", flush=True)
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
    return url
