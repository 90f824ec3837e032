"""How the Serve app refuses a request: every bad input becomes a 4xx whose message names the field and the fix.

As OpenAI and vLLM do, an invalid body is a 400 (never FastAPI's 422). `install_error_handlers` wires these into
the FastAPI ingress; a 5xx is either a full replica (503 with Retry-After) or an unexpected failure (500).
"""

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from taps_ray.serve.api_schemas import MAX_SEED, ErrorDetail, ErrorResponse

logger = logging.getLogger("ray.serve")

ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "malformed JSON, a wrong type, an out-of-range or unsupported value"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    503: {"model": ErrorResponse, "description": "the replica's queue is full (see the Retry-After header)"},
}


class ApiError(Exception):
    """A request this service refuses: 4xx for bad input, 503 (with `retry_after_s`) when it is full."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


_HINTS = {
    "temperature": "use a number from 0 (greedy) to 2",
    "top_p": "use a number in (0, 1]; 1 disables nucleus filtering",
    "top_k": "use an integer >= 0; 0 keeps the whole vocabulary",
    "max_tokens": "use an integer >= 1 (at most the service's max_tokens_limit, see GET /openapi.json)",
    "max_completion_tokens": "use an integer >= 1 (at most the service's max_tokens_limit)",
    "n": "only n=1 is supported; send one request per choice",
    "model": "name a model listed by GET /v1/models, e.g. plain or routed",
    "messages": 'send a non-empty list like [{"role": "user", "content": "Hi"}]',
    "prompt": "send a non-empty string, a list of token ids, or a list of either",
    "seed": f"use an integer from 0 to {MAX_SEED}",
    "stream": "use true or false",
    "role": "use system, developer, user or assistant",
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
    invalid_json = message.startswith("request body is not valid JSON")
    return _error(400, message, param, "invalid_json" if invalid_json else "invalid_value")


async def _on_api_error(request: Request, error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return _error(error.status, error.message, error.param, error.code, headers)


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


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
