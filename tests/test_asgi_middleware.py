"""The API's ASGI middleware: JSON bodies whatever their label, and every POST counted by model and status, streamed
responses and failures included (no Ray: the metrics are recorded by a stand-in)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

import taps_ray.serve.asgi_middleware as middleware


class Body(BaseModel):
    model: str


class Counted:
    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []

    def request(self, model: str, status: int) -> None:
        self.requests.append((model, status))


@pytest.fixture
def counted(monkeypatch) -> Counted:
    metrics = Counted()
    monkeypatch.setattr(middleware, "serve_metrics", lambda: metrics)
    return metrics


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Body, request: Request) -> dict:
        request.state.model = body.model
        return {"model": body.model}

    @app.post("/stream")
    async def stream(body: Body, request: Request) -> StreamingResponse:
        request.state.model = body.model

        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/fails")
    async def fails(body: Body, request: Request) -> dict:
        request.state.model = body.model
        raise RuntimeError("a bug")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {}

    app.add_middleware(middleware.ApiMiddleware)
    return TestClient(app, raise_server_exceptions=False)


def test_a_json_body_labelled_as_a_form_is_read_as_json(client, counted):
    response = client.post("/echo", content=b'{"model": "math"}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json() == {"model": "math"}
    assert counted.requests == [("math", 200)]


def test_a_body_that_is_not_json_still_gets_fastapis_answer(client, counted):
    response = client.post("/echo", content=b"model=math", headers={"content-type": "text/plain"})
    assert response.status_code == 422  # the service's own handlers turn this into a 400 (tests/test_serve.py)
    assert counted.requests == [("unknown", 422)]


def test_streams_and_failures_are_counted_with_their_status(client, counted):
    response = client.post("/stream", json={"model": "plain"})
    assert response.status_code == 200 and response.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert client.post("/fails", json={"model": "routed"}).status_code == 500
    assert client.get("/healthz").status_code == 200  # not a POST: not counted
    assert counted.requests == [("plain", 200), ("routed", 500)]
