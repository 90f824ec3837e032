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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from taps_ray.cluster.api_errors import ERROR_RESPONSES, ApiError, install_error_handlers
from taps_ray.cluster.api_schemas import (
    ChatChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    Speculative,
    Usage,
)
from taps_ray.cluster.runtime import start_ray, start_serve
from taps_ray.config import HeadKind, StudyConfig, load_config, parse_config, with_overrides
from taps_ray.eval.diagnostics import routing_fractions
from taps_ray.spec.verify import MIN_TEMPERATURE

logger = logging.getLogger("ray.serve")

APP_NAME = "taps"
ALIASES = {"routed": "confidence-routed"}
REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_TOP_P = 1e-6

api = FastAPI(
    title="taps-ray",
    description="Task-aware speculative decoding (TAPS) behind an OpenAI-compatible API",
    version="0.1.0",
    openapi_url=None,  # served by the deployment, with the service's live limits filled in
    docs_url=None,
    redoc_url=None,
)
install_error_handlers(api)

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


def _head_fractions(steps: list[Any], head_names: list[str]) -> dict[str, float]:
    """The evaluation's routing fractions by head name, rounded for the response; {} for plain decoding."""
    if not head_names:
        return {}
    return {name: round(fraction, 4) for name, fraction in routing_fractions(steps, head_names).items()}


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

    def _job(self, body: SamplingFields, prompt: list[int], max_tokens: int | None) -> Job:
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
        # Numerical floors (the engine samples in float32): a top_p below float32's smallest value rounds to 0 and
        # drops every token; top_p < 1e-6 keeps only the most likely token exactly like 1e-6 does (its probability
        # is >= 1/vocab > 1e-6). T is floored at the engine's MIN_TEMPERATURE, the floor the engine applies anyway,
        # so requests below it share one batch group.
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
            [job.max_tokens for job in jobs],
            self.stop_ids,
            seeds=[job.seed for job in jobs],
            draft_below=self.cfg.serve.draft_below,
        )
        outcomes = []
        for job, generation in zip(jobs, generations):
            steps = generation.steps
            speculative = Speculative(
                proposer=first.proposer,
                tau=round(generation.tau, 4),
                tau_taps=round(generation.tau_taps, 4),
                steps=len(steps),
                accepted_tokens=sum(s.accepted for s in steps),
                head_fractions=_head_fractions(steps, list(proposer.head_names)),
                batch_size=len(jobs),
                decode_s=round(generation.wall_s, 4),
            )
            outcomes.append(
                Outcome(
                    tokens=generation.tokens,
                    finish_reason="stop" if generation.finished_by == "stop" else "length",
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

    @api.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES, summary="text completion")
    async def completions(self, body: CompletionRequest):
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(piece: str, reason: str | None) -> dict[str, Any]:
            return {
                "id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}],
            }

        def response(text: str, finish: str, usage: Usage, speculative: Speculative) -> CompletionResponse:
            choice = CompletionChoice(index=0, text=text, finish_reason=finish)
            return CompletionResponse(id=rid, created=created, model=body.model, choices=[choice], usage=usage,
                                      speculative=speculative)

        return await self._respond(body, self._completion_prompt(body.prompt), body.max_tokens, chunk, response)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES, summary="chat completion")
    async def chat_completions(self, body: ChatCompletionRequest):
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

        def response(text: str, finish: str, usage: Usage, speculative: Speculative) -> ChatCompletionResponse:
            choice = ChatChoice(index=0, message=ChatCompletionMessage(content=text), finish_reason=finish)
            return ChatCompletionResponse(id=rid, created=created, model=body.model, choices=[choice], usage=usage,
                                          speculative=speculative)

        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        return await self._respond(body, self._chat_prompt(body.messages), max_tokens, chunk, response)

    async def _respond(self, body: SamplingFields, prompt: list[int], max_tokens: int | None,
                       chunk: Callable[[str, str | None], dict], response: Callable[..., BaseModel]):
        """Decode one request; stream chunks (SSE) or return the whole response built by `response`."""
        job = self._job(body, prompt, max_tokens)
        if body.stream:
            return self._stream(job, body.stop_strings, chunk)
        outcome = await self._run(job)
        text, finish = self._finish(outcome, body.stop_strings)
        return response(text, finish, self._usage(prompt, outcome), Speculative(**outcome.speculative))

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
    return build_app(with_overrides(cfg, work_dir=parsed.work_dir), base)


def start(cfg: StudyConfig, host: str | None = None, port: int | None = None, base_dir: str | Path | None = None) -> str:
    """Start Serve's HTTP proxy on host:port and deploy the app (Ray must be initialised); returns the URL."""
    host = host or cfg.serve.host
    port = port or cfg.serve.port
    start_serve(host, port)
    serve.run(build_app(cfg, base_dir), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def cmd_serve(cfg: StudyConfig, host: str | None = None, port: int | None = None, blocking: bool = True) -> str:
    """`taps serve`: a local loopback Ray (unless cfg.ray.address or RAY_ADDRESS names one to join), the app,
    then block until Ctrl-C."""
    import ray

    started_ray = start_ray(cfg.ray)
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
