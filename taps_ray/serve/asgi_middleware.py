"""The API's one middleware, as plain ASGI: JSON bodies whatever their content type, and requests counted by model
and status.

Why not FastAPI's `@app.middleware("http")`: that is Starlette's `BaseHTTPMiddleware`, which relays a response's
body through a memory stream of its own and a task per request, and its `call_next` returns before a streamed
body has started, so every SSE chunk of every stream took two extra hops on the replica's event loop. On a CPU
replica that loop shares the cores with the decode threads, where every millisecond it runs stalls a step.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from taps_ray.serve.metrics import serve_metrics

JSON = (b"content-type", b"application/json")


class ApiMiddleware:
    """Around the FastAPI app, for POST requests:
    * the body is read as JSON, as OpenAI's API does: `curl -d` without `-H` sends a JSON body labelled
      form-urlencoded, which FastAPI would not parse (a body that is not JSON still gets the 400 that says so);
    * each is counted by model (the endpoints put the body's model on `request.state.model`) and by the status
      sent, or 500 when the app raised before sending one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if not any(key == b"content-type" and b"json" in value for key, value in headers):
            scope["headers"] = [*(h for h in headers if h[0] != b"content-type"), JSON]
        state = scope.setdefault("state", {})  # the dict `request.state` writes into, downstream
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            serve_metrics().request(state.get("model", "unknown"), status)
