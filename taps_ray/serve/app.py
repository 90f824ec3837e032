"""Ray Serve app: the target plus the specialised draft heads behind an OpenAI-compatible HTTP API.

Three ways to start it (docs/serve.md), all on loopback by default:

    serve run taps_ray.serve.app:app_builder config=configs/cpu.yaml
    serve run configs/serve.yaml            # or `serve deploy configs/serve.yaml` on a running cluster
    taps serve --config configs/cpu.yaml

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true), GET /v1/models,
GET /healthz, GET /openapi.json. The request's `model` names the proposer: `plain` (the target alone), a
head by its mixture (`math`, `chat`, ...), `routed` (= `confidence-routed`), `merged` or any other
registered combination. Every response carries `usage` and a `speculative` block (tau, steps, the fraction
of steps each head drafted, how many sequences shared the verification batch).

Batching is continuous: every prompt becomes one engine `Request` (decoding/continuous.py), built once from the
validated body and handed as it is to the replica's decode loop
(serve/scheduler.py around decoding/continuous.py). It joins the running batch at the next verification step
(up to `serve.max_batch_size` sequences; beyond that it waits, up to `serve.max_queued_requests`, then 503)
and leaves when finished. One target forward per step verifies every live sequence's tree, whatever its model
(proposer) or sampling parameters; each sequence keeps its own seed, so outputs never depend on the company.

Validation: bodies are pydantic models; malformed JSON, wrong types, out-of-range values and non-neutral values
of OpenAI fields the service lacks become 400 with the field, the problem and the fix; limits that depend on the
running service (known models, prompt length in tokens, max_tokens_limit, vocabulary) are checked in the handlers
and also published in the OpenAPI schema (model enum, max_tokens maximum). A 5xx is a full replica (503 with
Retry-After) or an unexpected failure of the service.
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
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from taps_ray import ray_requests
from taps_ray.adapt.replica import ReplicaAdaptation
from taps_ray.adapt.trainer_actor import start_trainer
from taps_ray.compute_thread import compute_executor
from taps_ray.config import ROUTED_ADAPT, HeadKind, StudyConfig, load_config, parse_config, with_overrides
from taps_ray.data.chat import render_ids
from taps_ray.decoding.continuous import ContinuousBatcher, Result, TokenLogprob
from taps_ray.decoding.continuous import Request as DecodeRequest  # `Request` is FastAPI's
from taps_ray.decoding.draft_gate import DraftGate
from taps_ray.decoding.verify import MIN_TEMPERATURE, SamplingParams
from taps_ray.drafting.cost import CostAware
from taps_ray.drafting.names import ALIASES, PLAIN, UnknownProposer, parse_proposer
from taps_ray.drafting.proposer import shared_feature_layers
from taps_ray.drafting.registry import combination, combination_names, single_names
from taps_ray.drafting.setup import draft_dtype, load_heads, load_proposers
from taps_ray.models.target import dtype_name, load_target
from taps_ray.ray_runtime import OMP_WAIT_ENV, bind_replica_grpc_to_node, process_runtime_env, start_serve
from taps_ray.serve.api_errors import ERROR_RESPONSES, ApiError, install_error_handlers
from taps_ray.serve.api_schemas import (
    ChatChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    Speculative,
)
from taps_ray.serve.asgi_middleware import ApiMiddleware
from taps_ray.serve.listener import ReplicaListener
from taps_ray.serve.metrics import serve_metrics
from taps_ray.serve.output import ChoiceStream, TextOutput, speculative, usage
from taps_ray.serve.scheduler import DecodeLoop, Overloaded, Ticket
from taps_ray.serve.warm_up import warm_up
from taps_ray.workdir import head_checkpoint, heads_root

logger = logging.getLogger("ray.serve")

APP_NAME = "taps"
DEPLOYMENT = "TapsService"
REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_TOP_P = 1e-6
SHUTDOWN_GRACE_S = 5.0  # after Serve's own drain: how long the running batch may still finish

api = FastAPI(
    title="taps-ray",
    description="Task-aware speculative decoding (TAPS) behind an OpenAI-compatible API",
    version="0.1.0",
    openapi_url=None,  # served by the deployment, with the service's live limits filled in
    docs_url=None,
    redoc_url=None,
)
install_error_handlers(api)


api.add_middleware(ApiMiddleware)


def _resolve_paths(cfg: StudyConfig, base: Path) -> StudyConfig:
    """Absolute work_dir / reports_dir, so replicas find the heads whatever their working directory."""
    update = {}
    for name in ("work_dir", "reports_dir"):
        path = Path(getattr(cfg, name)).expanduser()
        update[name] = str(path if path.is_absolute() else (base / path).resolve())
    return cfg.model_copy(update=update)


# --- the deployment ------------------------------------------------------------------------------------------


@serve.deployment(name=DEPLOYMENT)
@serve.ingress(api)
class TapsService:
    """One replica: the target, every head that exists, and a proposer per servable model name."""

    def __init__(self, config: dict[str, Any]) -> None:
        bind_replica_grpc_to_node()  # before Serve starts the replica's gRPC server, right after this constructor
        self.cfg = parse_config(config, "<serve deployment>").served()  # drafting serve.tree's shape
        # the decode thread, with the replica's threads; it loads everything too (compute_thread.py says why)
        self.compute = compute_executor("taps-decode", max(1, math.ceil(self.cfg.serve.replica_num_cpus)))
        self.compute.submit(self._load).result()
        logger.info(
            "taps serve: target %s, %s heads %s, models %s", self.cfg.target.name, self.kind,
            sorted(self.heads), self.model_names(),
        )
        self.listener: ReplicaListener | None = None
        if self.cfg.serve.listener == "replica":
            self.listener = ReplicaListener(self.cfg.serve.host, self.cfg.serve.port)
            # after this constructor: Serve's ingress wrapper sets the bound ASGI app (`_asgi_app`) when it returns
            asyncio.get_running_loop().call_soon(lambda: self.listener.start(self._asgi_app))

    def _load(self) -> None:
        """The target, the heads, the proposers and the decode loop (on the compute thread)."""
        serve_cfg = self.cfg.serve
        self.target = load_target(self.cfg.target, serving=True)
        self.tokenizer = self.target.tokenizer
        self.stop_ids = self.target.stop_token_ids
        self.vocab_size = int(self.target.model.get_input_embeddings().weight.shape[0])
        self.kind = serve_cfg.head_kind
        self.draft_dtype = draft_dtype(serve_cfg.draft_dtype, self.target)
        self.heads, self.missing = self._load_heads()
        names = single_names(list(self.heads))  # plain, every head, ngram, every head + ngram
        self.proposers: dict[str, Any] = load_proposers(self.cfg, names, target=self.target, heads=self.heads)
        mixtures = self.cfg.train.mixtures
        if all(m in self.heads for m in mixtures[:2]) and len(mixtures) >= 2:
            for name in combination_names():
                try:
                    self.proposers.update(load_proposers(self.cfg, [name], target=self.target, heads=self.heads))
                except Exception as error:  # a combination that cannot use these heads is left out, not fatal
                    logger.warning("combination %r left out: %s", name, error)
        if serve_cfg.cost_model:  # the model keeps its name; what runs is `auto-<name>`, drafting only where it pays
            self.proposers = {name: p if name == PLAIN else CostAware(p, name=name)
                              for name, p in self.proposers.items()}
        self.max_tokens_limit = serve_cfg.max_tokens_limit
        self.default_max_tokens = min(serve_cfg.default_max_tokens, serve_cfg.max_tokens_limit)
        self.created = int(time.time())
        self._openapi: dict[str, Any] | None = None
        self.output = TextOutput(self.tokenizer, self.stop_ids)
        layers = shared_feature_layers(self.proposers.values(), "the served heads")
        gate = DraftGate(serve_cfg.draft_below, measured=serve_cfg.measure_drafting)
        self.batcher = ContinuousBatcher(self.target.model, self.stop_ids, serve_cfg.max_batch_size,
                                         gate, layers,
                                         prefill_tokens=serve_cfg.prefill_tokens)
        warm_up(self.batcher, self.proposers[PLAIN], self.tokenizer.encode("Warm up the target's graph."))
        self.adapt = self._start_adapting() if serve_cfg.adapt.enabled else None
        self.loop = DecodeLoop(self.batcher, serve_cfg.max_queued_requests, serve_cfg.stall_timeout_s, serve_metrics(),
                               self.adapt, self.compute)

    def _start_adapting(self) -> ReplicaAdaptation:
        """serve.adapt: record, swap and roll back on this replica; one trainer actor per adapted model beside it
        (docs/serve.md#online-adaptation)."""
        names = [ALIASES.get(m, m) for m in self.cfg.serve.adapt.models or list(self.heads)]
        routed = {m: self.proposers[m] for m in names if m in ROUTED_ADAPT and m in self.proposers}
        models = [m for m in names if m in self.heads or m in routed]

        def build(model: str, head: Any) -> Any:
            proposer = load_proposers(self.cfg, [model], target=self.target,
                                      heads={**self.heads, model: head.to(self.target.device, self.draft_dtype)})[model]
            return CostAware(proposer, name=model) if self.cfg.serve.cost_model else proposer

        def install(model: str, proposer: Any) -> None:
            self.proposers[model] = proposer

        adapt = ReplicaAdaptation(self.cfg, models, build, install, serve_metrics(), routed=routed)
        self.trainers = [start_trainer(self.cfg, model) for model in models]
        return adapt

    def _load_heads(self) -> tuple[dict[str, Any], list[str]]:
        mixtures = self.cfg.train.mixtures
        missing = [m for m in mixtures if not head_checkpoint(self.cfg, self.kind, m).is_dir()]
        heads = load_heads(
            self.cfg, self.kind, self.draft_dtype, [m for m in mixtures if m not in missing], self.target.device
        )
        if missing:
            logger.warning(
                "taps serve: no trained %s head for %s under %s, so only %s can be served; train them with "
                "`taps train --config <cfg> --kind %s --mixture <name>` (or `make sweep`) and restart the service",
                self.kind, ", ".join(missing), heads_root(self.cfg),
                ", ".join(["plain", *heads]) or "plain", self.kind,
            )
        return heads, missing

    # -- model names ----------------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        reverse = {v: k for k, v in ALIASES.items()}
        return [reverse.get(name, name) for name in self.proposers]

    def _proposer_for(self, model: str) -> str:
        """The served proposer's name for the body's `model` (an alias resolved), or the 404 that says why not."""
        name = ALIASES.get(model, model)
        if name in self.proposers:
            return name
        known = ", ".join(self.model_names())
        unknown = f"unknown model {model!r}; choose one of: {known} (GET /v1/models)"
        try:
            spec = parse_proposer(name)
        except UnknownProposer as error:  # e.g. averaged-w2: a weight outside [0, 1]
            raise ApiError(404, f"{unknown}: {error}", "model", "model_not_found") from error
        # a head or a combination of them that is not loaded: its heads are missing
        drafts = spec.drafts_with_heads and (spec.base in self.cfg.train.mixtures or combination(spec.base) is not None)
        if drafts or model in ALIASES:
            raise ApiError(
                404,
                f"model {model!r} is not loaded: this service found no trained {self.kind} heads for "
                f"{', '.join(self.missing) or 'it'}; available: {known}. Train the heads "
                f"(`taps train --kind {self.kind} ...`) and restart, or use one of the available models",
                "model",
                "model_not_found",
            )
        raise ApiError(404, unknown, "model", "model_not_found")

    # -- validation shared by both endpoints -----------------------------------------------------------------

    def _request(self, body: SamplingFields, prompt: list[int], top_logprobs: int | None) -> DecodeRequest:
        """One prompt of a validated body as the engine's request: the one object that goes down to the batch."""
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
        max_tokens = body.token_limit if body.token_limit is not None else self.default_max_tokens
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise ApiError(
                400,
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
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=body.top_k)
        return DecodeRequest(prompt=prompt, proposer=self.proposers[proposer], params=params, max_tokens=max_tokens,
                             seed=seed, top_logprobs=top_logprobs, stop=self.output.stop_rule(body.stop_strings),
                             ignore_eos=body.ignore_eos)

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"prompt holds token ids outside the vocabulary (e.g. {bad[0]}); use ids in 0..{self.vocab_size - 1} "
                "or send the prompt as text",
                "prompt",
                "invalid_value",
            )
        return list(prompt)

    def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
        try:
            return render_ids(self.tokenizer, turns, add_generation_prompt=True)
        except Exception as error:  # a chat template that rejects this message order
            raise ApiError(
                400, f"the chat template cannot render these messages ({error}); check the roles' order", "messages",
                "invalid_value",
            ) from None

    # -- decoding ----------------------------------------------------------------------------------------------

    def _submit(self, requests: list[DecodeRequest], model: str,
                updates: asyncio.Queue | None = None) -> list[Ticket]:
        """Hand the requests to the decode loop; all or none (a full queue is a 503 with Retry-After)."""
        tickets: list[Ticket] = []
        try:
            for index, request in enumerate(requests):
                tickets.append(self.loop.submit(request, model, updates, index))
        except Overloaded as error:
            for ticket in tickets:
                ticket.cancel()
            raise ApiError(503, str(error), None, "overloaded", retry_after_s=error.retry_after_s) from None
        return tickets

    def _result(self, result: Result) -> Result:
        if result.error is None:
            return result
        if self.loop.closing:
            raise ApiError(503, "this replica shut down before the request finished; retry", None, "overloaded",
                           retry_after_s=1)
        raise RuntimeError(f"decoding failed: {result.error}")

    # -- endpoints -------------------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Serve's periodic health check: fails when the decode loop has work but makes no progress."""
        self.loop.check_health()

    async def drain(self, timeout_s: float) -> str:
        """`taps serve` stopping (serve/process.py): new requests get a 503 from now on; returns this replica's id
        once its running requests have finished (streams with their last chunk and [DONE]) or after `timeout_s`."""
        await self.loop.drain(timeout_s)
        return serve.get_replica_context().replica_id.unique_id

    async def __del__(self) -> None:
        """Graceful shutdown (Serve has already drained in-flight requests for graceful_shutdown_timeout_s):
        refuse new work, give the running batch a last moment, and fail what is left with a 503."""
        if hasattr(self, "loop"):  # __init__ may have failed before it
            await self.loop.shutdown(SHUTDOWN_GRACE_S)
        if getattr(self, "listener", None) is not None:
            await self.listener.stop()

    @api.get("/healthz", summary="liveness and what is loaded")
    def healthz(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "target": self.cfg.target.name,
            "head_kind": self.kind,
            "heads": sorted(self.heads),
            "missing_heads": self.missing,
            "models": self.model_names(),
            "running": self.batcher.live,
            "waiting": self.batcher.waiting,
            "head_versions": self.adapt.versions() if self.adapt else {},
            "tree": self.cfg.tree.model_dump(include={"total_token", "depth", "top_k", "min_confidence"}),
            "draft_dtype": dtype_name(self.draft_dtype),
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
    async def completions(self, body: CompletionRequest, request: Request):
        request.state.model = body.model
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        offsets: dict[int, int] = defaultdict(int)

        def logprobs(index: int, taken: list[TokenLogprob]) -> dict[str, Any] | None:
            if body.logprobs is None:
                return None
            formatted = self.output.completion_logprobs(taken, offsets[index])
            offsets[index] += sum(len(t) for t in formatted.tokens)
            return formatted.model_dump()

        def chunk(index: int, piece: str, reason: str | None, taken: list[TokenLogprob]) -> dict[str, Any]:
            return {
                "id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"index": index, "text": piece, "finish_reason": reason, "logprobs": logprobs(index, taken)}],
            }

        def response(results: list[Result]) -> CompletionResponse:
            choices = []
            for index, result in enumerate(results):
                text, finish = self.output.finish(result, body.stop_strings)
                choices.append(CompletionChoice(index=index, text=text, finish_reason=finish,
                                                logprobs=self._completion_logprobs(body, result)))
            return CompletionResponse(id=rid, created=created, model=body.model, choices=choices,
                                      usage=usage(results), speculative=self._speculative(body.model, results))

        top = body.logprobs
        requests = [self._request(body, self._completion_prompt(p), top) for p in body.prompts]
        return await self._respond(body, requests, chunk, response, "text_completion")

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES, summary="chat completion")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        request.state.model = body.model
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def chunk(index: int, piece: str, reason: str | None, taken: list[TokenLogprob]) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": piece} if piece or reason is None else {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            logprobs = self.output.chat_logprobs(taken).model_dump() if body.logprobs else None
            return {
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}],
            }

        def response(results: list[Result]) -> ChatCompletionResponse:
            (result,) = results
            text, finish = self.output.finish(result, body.stop_strings)
            logprobs = self.output.chat_logprobs(result.logprobs) if body.logprobs else None
            choice = ChatChoice(index=0, message=ChatCompletionMessage(content=text), finish_reason=finish,
                                logprobs=logprobs)
            return ChatCompletionResponse(id=rid, created=created, model=body.model, choices=[choice],
                                          usage=usage(results), speculative=self._speculative(body.model, results))

        top = (body.top_logprobs or 0) if body.logprobs else None
        requests = [self._request(body, self._chat_prompt(body.messages), top)]
        return await self._respond(body, requests, chunk, response, "chat.completion.chunk")

    def _completion_logprobs(self, body: CompletionRequest, result: Result) -> CompletionLogprobs | None:
        return None if body.logprobs is None else self.output.completion_logprobs(result.logprobs)

    def _speculative(self, model: str, results: list[Result]) -> Speculative:
        """The `speculative` block for the body's `model` (validated: its proposer is served)."""
        name = self._proposer_for(model)
        return speculative(results, name, list(self.proposers[name].head_names))

    async def _respond(self, body: SamplingFields, requests: list[DecodeRequest], chunk: Callable[..., dict],
                       response: Callable[[list[Result]], BaseModel], chunk_object: str):
        """Decode a body's prompts; stream chunks (SSE) or return the whole response built by `response`."""
        if body.stream:
            return self._stream(body, requests, chunk, chunk_object)
        tickets = self._submit(requests, body.model)
        results = [self._result(await ticket.wait()) for ticket in tickets]
        return response(results)

    def _stream(self, body: SamplingFields, requests: list[DecodeRequest], make_chunk: Callable[..., dict],
                chunk_object: str) -> StreamingResponse:
        """Server-sent events: per choice, one chunk per verification step as it decodes (text that can no longer
        change, see `ChoiceStream`), then its finish chunk; with `stream_options.include_usage` a last chunk with
        empty choices and the usage; then [DONE]."""
        updates: asyncio.Queue = asyncio.Queue()
        tickets = self._submit(requests, body.model, updates)  # a 503 before the stream starts
        choices = [ChoiceStream(self.output, body.stop_strings) for _ in requests]

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            results: list[Result | None] = [None] * len(requests)
            try:
                while any(r is None for r in results):
                    index, update = await updates.get()
                    stream = choices[index]
                    if update is not None:
                        piece = stream.add(update.tokens, update.logprobs)
                        if piece:
                            yield event(make_chunk(index, piece, None, stream.take_logprobs()))
                        continue
                    result = results[index] = self._result(await tickets[index].wait())
                    rest, finish = stream.close(result)
                    if rest:
                        yield event(make_chunk(index, rest, None, stream.take_logprobs()))
                    last = make_chunk(index, "", finish, stream.take_logprobs())
                    last["speculative"] = self._speculative(body.model, [result]).model_dump()
                    yield event(last)
            except Exception as error:  # the decode failed after the stream began: say so in the stream
                logger.exception("streamed decode failed")
                detail = ErrorDetail(message=f"decoding failed: {error}", type="server_error")
                yield event(ErrorResponse(error=detail).model_dump())
                yield "data: [DONE]\n\n"
                return
            finally:
                for ticket in tickets:  # the client went away: its sequences leave the batch
                    ticket.cancel()
            if body.include_usage:
                yield event({"id": make_chunk(0, "", None, [])["id"], "object": chunk_object,
                             "created": int(time.time()), "model": body.model, "choices": [],
                             "usage": usage(results).model_dump()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})



# --- building and starting the application -------------------------------------------------------------------


class AppArgs(BaseModel):
    """Arguments of `app_builder` (`serve run taps_ray.serve.app:app_builder key=value ...`)."""

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
    """The bound Serve application for a study config (replicas, batch limits and heads from `cfg.serve`).

    A replica takes in enough requests to fill its batch and its own queue, so it is the replica that answers
    503 + Retry-After when full (Serve's own `max_queued_requests` would count requests still being routed).
    """
    cfg = _resolve_paths(cfg, Path(base_dir) if base_dir is not None else Path.cwd())
    s = cfg.serve
    scaling = {"autoscaling_config": s.autoscaling_config} if s.autoscaling_config else {"num_replicas": s.num_replicas}
    return TapsService.options(
        **scaling,
        max_ongoing_requests=max(s.max_ongoing_requests, s.max_batch_size + s.max_queued_requests + 1),
        # the driver's settings and Hub token (ENV_KEYS) and OpenMP's wait, set before the replica imports anything
        ray_actor_options={**ray_requests.serve_replica(cfg).options(),
                           "runtime_env": process_runtime_env(OMP_WAIT_ENV[s.replica_omp_wait])},
    ).bind(cfg.model_dump(mode="json"))


def app_builder(args: dict[str, str]) -> serve.Application:
    """Serve application builder: `serve run taps_ray.serve.app:app_builder config=configs/cpu.yaml`."""
    try:
        parsed = AppArgs.model_validate(args or {})
    except ValidationError as error:
        raise ValueError(f"bad app_builder args {args}: {error}; known args: {', '.join(AppArgs.model_fields)}") from None
    cfg, base = _find_config(parsed.config)
    serve_update = {k: v for k, v in {"head_kind": parsed.head_kind, "num_replicas": parsed.num_replicas,
                                       "max_batch_size": parsed.max_batch_size}.items() if v is not None}
    # `serve run` / `serve deploy` bring Serve's own HTTP proxy, whatever the config's serve.listener says
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={**serve_update, "listener": "proxy"})})
    return build_app(with_overrides(cfg, work_dir=parsed.work_dir), base)


def start(cfg: StudyConfig, host: str | None = None, port: int | None = None, base_dir: str | Path | None = None) -> str:
    """Start Serve's HTTP proxy on host:port (`serve.listener: proxy`; with `replica` the replica listens there
    and Serve starts no proxy) and deploy the app (Ray must be initialised); returns the URL."""
    host = host or cfg.serve.host
    port = port or cfg.serve.port
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"host": host, "port": port})})
    start_serve(host, port, proxy=cfg.serve.listener == "proxy")
    serve.run(build_app(cfg, base_dir), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"
