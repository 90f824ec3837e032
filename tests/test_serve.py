"""The Ray Serve app over HTTP on loopback: endpoints, greedy equality with HF, SSE, continuous batching, OpenAI
compatibility, 4xx and 503, fuzzing.

One Serve instance for the module (tiny random target, random eagle2 heads for math and chat), on the
session's Ray cluster; `serve.shutdown()` at the end of the module, never `ray.shutdown()`.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import schemathesis
import torch
import yaml
from hypothesis import HealthCheck, settings
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error

from taps_ray.config import ConfigError, ServeConfig, ServedTree, load_config, parse_config
from taps_ray.data.chat import render_ids
from taps_ray.models.draft_head import new_head
from taps_ray.ray_runtime import start_serve
from taps_ray.serve.app import AppArgs, app_builder, build_app
from taps_ray.workdir import head_checkpoint

from listeners import exposed, listeners

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS_LIMIT = 32
MAX_PROMPT_TOKENS = 96
TIMEOUT = httpx.Timeout(120.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_config(tiny_config, work: Path, **serve_update):
    update = dict(
        max_batch_size=4,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_tokens_limit=MAX_TOKENS_LIMIT,
        default_max_tokens=16,
        replica_num_cpus=0.5,
        num_replicas=1,
        draft_below=3,  # batches of 3-4 start undrafted and resume drafting as their sequences finish
        measure_drafting=False,  # below the cap every batch drafts (one test: the measured rule)
        cost_model=False,  # the proposers as they are: these tests check what each one drafts (one test: the default)
        tree=ServedTree(total_token=6),  # the served heads draft 6 of the study's 8 nodes (tiny.yaml: 8/3/3)
    )
    update.update(serve_update)
    return tiny_config.model_copy(update={"work_dir": str(work), "serve": tiny_config.serve.model_copy(update=update)})


def _wait_healthy(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(f"{url}/healthz", timeout=5.0)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}/healthz did not answer within {timeout}s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def service(ray_session, tiny_config, tiny_target, tmp_path_factory):
    from ray import serve

    cfg = _serve_config(tiny_config, tmp_path_factory.mktemp("serve-work"))
    for seed, mixture in enumerate(("math", "chat"), start=1):
        new_head(tiny_target.model.config, seed=seed).save(head_checkpoint(cfg, "eagle2", mixture))
    port = _free_port()
    start_serve(port=port)
    try:
        serve.run(build_app(cfg), name="taps-test", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        health = _wait_healthy(url)
        yield SimpleNamespace(url=url, cfg=cfg, health=health, serve=serve)
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="x", max_retries=0, timeout=120.0)


def _text(tokenizer, tokens: list[int], stop_ids: list[int]) -> str:
    if tokens and tokens[-1] in stop_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    stop_ids = target.stop_token_ids
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=stop_ids, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    tokens = out[0, len(prompt) :].tolist()
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


def _expected_chat(target, content: str, n: int) -> str:
    prompt = render_ids(target.tokenizer, [{"role": "user", "content": content}], add_generation_prompt=True)
    return _text(target.tokenizer, _hf_greedy(target, prompt, n), target.stop_token_ids)


def _spec_models(service) -> list[str]:
    models = service.health["models"]
    return [m for m in ("math", "chat", "routed", "merged") if m in models]


# --- endpoints -----------------------------------------------------------------------------------------------


def test_healthz_and_models(service):
    health = httpx.get(f"{service.url}/healthz").json()
    assert health["status"] == "ok" and health["heads"] == ["chat", "math"] and health["missing_heads"] == []
    assert health["tree"] == {"total_token": 6, "depth": 3, "top_k": 3, "min_confidence": 0.0}  # serve.tree
    assert health["draft_dtype"] == "float32"  # serve.draft_dtype unset: the target's
    listed = httpx.get(f"{service.url}/v1/models").json()
    assert listed["object"] == "list"
    ids = [card["id"] for card in listed["data"]]
    assert ids[:3] == ["plain", "math", "chat"]
    card = next(c for c in listed["data"] if c["id"] == "routed")
    assert card["proposer"] == "confidence-routed" and card["heads"] == ["math", "chat"]
    assert "merged" in ids and "averaged-w0.25" in ids


def test_chat_completion_greedy_equals_hf_for_every_proposer(service, client, tiny_target):
    question = "What is 7 times 6? Explain briefly."
    expected = _expected_chat(tiny_target, question, 24)
    for model in ["plain", *_spec_models(service)]:
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24
        )
        choice = response.choices[0]
        assert choice.message.content == expected, model
        assert choice.finish_reason in ("stop", "length")
        assert response.usage.completion_tokens >= 1
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
        speculative = response.model_extra["speculative"]
        assert speculative["tau"] >= 1.0 and speculative["steps"] >= 1 and speculative["batch_size"] >= 1
        if model == "plain":
            assert speculative["head_fractions"] == {}
        else:
            assert abs(sum(speculative["head_fractions"].values()) - 1.0) < 1e-3
            if model in ("math", "chat"):
                assert speculative["head_fractions"] == {model: 1.0}


def test_completions_endpoint_greedy_and_token_prompt(service, tiny_target):
    text = "The capital of France is"
    prompt = tiny_target.tokenizer.encode(text)
    expected = _text(tiny_target.tokenizer, _hf_greedy(tiny_target, prompt, 12), tiny_target.stop_token_ids)
    for body_prompt in (text, prompt):
        response = httpx.post(
            f"{service.url}/v1/completions",
            json={"model": "math", "prompt": body_prompt, "temperature": 0, "max_tokens": 12},
            timeout=TIMEOUT,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected
        assert body["usage"]["prompt_tokens"] == len(prompt)


def test_streaming_chunks_concatenate_to_the_same_text(service, client):
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    for model in ("plain", *_spec_models(service)[:1]):
        full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == full.choices[0].message.content
        assert len(pieces) >= 2, "expected one chunk per verification step"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
        assert chunks[-2].model_extra["speculative"]["steps"] == full.model_extra["speculative"]["steps"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])
        plain = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                    stream=True))
        assert plain[-1].choices[0].finish_reason and all(c.usage is None for c in plain)  # no usage unless asked


def test_raw_sse_and_stop_strings(service):
    body = {"model": "plain", "prompt": "Hello", "temperature": 0, "max_tokens": 16}
    full = httpx.post(f"{service.url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    assert len(full) >= 4
    stop = full[2:4]  # cut inside the generated text
    plain = httpx.post(f"{service.url}/v1/completions", json={**body, "stop": [stop]}, timeout=TIMEOUT).json()
    cut = plain["choices"][0]
    assert cut["text"] == full[: full.find(stop)] and cut["finish_reason"] == "stop"
    with httpx.stream("POST", f"{service.url}/v1/completions", json={**body, "stop": stop, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == cut["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_end_decoding_and_usage_counts_what_was_returned(service, tiny_target):
    tok, stop_ids = tiny_target.tokenizer, tiny_target.stop_token_ids
    prompt = tok.encode("Hello")
    tokens = _hf_greedy(tiny_target, prompt, 24)
    full = _text(tok, tokens, stop_ids)
    stop = full[6:8]
    needed = next(k for k in range(1, len(tokens) + 1) if stop in _text(tok, tokens[:k], stop_ids))
    body = {"model": "plain", "prompt": "Hello", "temperature": 0, "max_tokens": 24, "stop": stop}
    response = httpx.post(f"{service.url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert response["choices"][0]["text"] == full[: full.find(stop)]
    assert response["usage"]["completion_tokens"] == needed < len(tokens)
    steps = response["speculative"]["steps"]
    assert steps == needed - 1  # plain: one token per step after the prefill's; decoding stopped at the stop string


def test_sampling_is_reproducible_with_a_seed(service, client):
    kwargs = dict(model="plain", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16)
    first = client.chat.completions.create(temperature=0.9, seed=7, **kwargs).choices[0].message.content
    again = client.chat.completions.create(temperature=0.9, seed=7, **kwargs).choices[0].message.content
    assert first == again


def test_extreme_but_valid_sampling_values_work(service):
    """Found by the fuzzer: float32 sampling broke on T=1e-300 or top_p=5e-324; the service floors both."""
    for temperature, top_p in ((1e-300, 1.0), (1.0, 5e-324), (2.0, 1e-300)):
        body = {"model": "plain", "prompt": "2+2=", "temperature": temperature, "top_p": top_p, "max_tokens": 4, "seed": 0}
        response = httpx.post(f"{service.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, (temperature, top_p, response.text)


def test_concurrent_requests_share_batched_verification(service, tiny_target):
    """Requests join the running batch; each output still equals HF greedy, whoever shares its steps."""
    model = "routed" if "routed" in service.health["models"] else "math"
    questions = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "Count to five.", "Say hi.", "What is pi?"]
    limits = [8, 16, 24, 12, 20, 10]  # sequences leave the batch at their own limits

    def ask(i: int) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": questions[i]}], "temperature": 0,
                "max_tokens": limits[i]}
        response = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(questions)) as pool:
        results = list(pool.map(ask, range(len(questions))))
    for i, result in enumerate(results):
        assert result["choices"][0]["message"]["content"] == _expected_chat(tiny_target, questions[i], limits[i])
        assert result["usage"]["completion_tokens"] <= limits[i]
    sizes = [r["speculative"]["batch_size"] for r in results]
    assert max(sizes) >= 2, f"no request shared a batch: {sizes}"
    assert max(sizes) <= service.cfg.serve.max_batch_size
    for result in results:  # draft_below=3: a batch of three or more begins with undrafted steps
        paused = "none" in result["speculative"]["head_fractions"]
        assert paused == (result["speculative"]["batch_size"] >= service.cfg.serve.draft_below), result["speculative"]


def test_different_models_share_the_forward_while_requests_join_mid_batch(service, tiny_target):
    """plain, single, routed and merged heads in one running batch; late requests join it; T=0 equals greedy."""
    question = "What is the boiling point of water?"
    expected = {n: _expected_chat(tiny_target, question, n) for n in (12, 28)}
    models = ["plain", *_spec_models(service)]
    long = {"model": models[-1], "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 28}

    def ask(model: str, delay: float) -> dict:
        time.sleep(delay)
        body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 12}
        return httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=TIMEOUT).json()

    with ThreadPoolExecutor(len(models) + 1) as pool:
        first = pool.submit(lambda: httpx.post(f"{service.url}/v1/chat/completions", json=long, timeout=TIMEOUT).json())
        results = list(pool.map(ask, models, [0.3 + 0.2 * i for i in range(len(models))]))
        first = first.result()
    assert first["choices"][0]["message"]["content"] == expected[28]
    for model, result in zip(models, results):
        assert result["choices"][0]["message"]["content"] == expected[12], model
        assert result["speculative"]["proposer"] == {"routed": "confidence-routed"}.get(model, model)
    assert first["speculative"]["batch_size"] >= 2, "later requests did not join the running batch"


# --- bad input: always 4xx, with what is wrong and how to fix it ----------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
BAD_INPUTS = [
    ("malformed json", CHAT, '{"model": "plain", "messages": [', 400, "not valid JSON"),
    ("body not an object", CHAT, "[1, 2]", 400, "must be a JSON object"),
    ("empty body", COMPLETIONS, "", 400, None),
    ("no messages", CHAT, {"model": "plain", "messages": []}, 400, "messages"),
    ("empty messages", CHAT, {"model": "plain", "messages": [{"role": "user", "content": "  "}]}, 400, "every message is empty"),
    ("empty prompt", COMPLETIONS, {"model": "plain", "prompt": ""}, 400, "prompt: is empty"),
    ("over-long prompt", COMPLETIONS, {"model": "plain", "prompt": "word " * 400}, 400, "max_prompt_tokens"),
    ("over-long chat", CHAT, {"model": "plain", "messages": [{"role": "user", "content": "word " * 400}]}, 400, "at most 96"),
    ("negative temperature", CHAT, {"model": "plain", "messages": HI, "temperature": -0.1}, 400, "temperature"),
    ("temperature above 2", CHAT, {"model": "plain", "messages": HI, "temperature": 2.5}, 400, "from 0 (greedy) to 2"),
    ("top_p zero", CHAT, {"model": "plain", "messages": HI, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", COMPLETIONS, {"model": "plain", "prompt": "a", "top_p": 1.5}, 400, "(0, 1]"),
    ("max_tokens zero", CHAT, {"model": "plain", "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens too large", CHAT, {"model": "plain", "messages": HI, "max_tokens": MAX_TOKENS_LIMIT + 1}, 400,
     f"1..{MAX_TOKENS_LIMIT}"),
    ("unknown model", CHAT, {"model": "gpt-4", "messages": HI}, 404, "choose one of: plain"),
    ("missing model", COMPLETIONS, {"prompt": "a"}, 400, "model: required field is missing"),
    ("temperature wrong type", CHAT, {"model": "plain", "messages": HI, "temperature": "hot"}, 400, "temperature"),
    ("messages wrong type", CHAT, {"model": "plain", "messages": "hi"}, 400, "messages"),
    ("bad role", CHAT, {"model": "plain", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("penalty", CHAT, {"model": "plain", "messages": HI, "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5 is not supported"),
    ("tools", CHAT, {"model": "plain", "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools="),
    ("json mode", CHAT, {"model": "plain", "messages": HI, "response_format": {"type": "json_object"}}, 400,
     "response_format="),
    ("logit bias", COMPLETIONS, {"model": "plain", "prompt": "a", "logit_bias": {"5": 1.0}}, 400, "logit_bias="),
    ("echo", COMPLETIONS, {"model": "plain", "prompt": "a", "echo": True}, 400, "echo=True is not supported"),
    ("best_of", COMPLETIONS, {"model": "plain", "prompt": "a", "best_of": 3}, 400, "best_of=3"),
    ("too many logprobs", COMPLETIONS, {"model": "plain", "prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"model": "plain", "messages": HI, "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs"),
    ("empty prompt in a list", COMPLETIONS, {"model": "plain", "prompt": ["a", ""]}, 400, "empty prompt"),
    ("unknown field", CHAT, {"model": "plain", "messages": HI, "temprature": 0}, 400, "temprature: unknown field"),
    ("n > 1", CHAT, {"model": "plain", "messages": HI, "n": 2}, 400, "only n=1"),
    ("token id out of vocab", COMPLETIONS, {"model": "plain", "prompt": [1, 10**9]}, 400, "outside the vocabulary"),
    ("negative token id", COMPLETIONS, {"model": "plain", "prompt": [-1]}, 400, "outside the vocabulary"),
    ("too many stops", COMPLETIONS, {"model": "plain", "prompt": "a", "stop": list("abcde")}, 400, "at most 4"),
    ("seed negative", CHAT, {"model": "plain", "messages": HI, "seed": -1}, 400, "seed"),
    ("wrong method", "/v1/models", None, 405, "not allowed"),
    ("no route", "/v2/nothing", {}, 404, "no route"),
]


@pytest.mark.parametrize("name,path,body,status,reason", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_a_4xx_with_the_reason(service, name, path, body, status, reason):
    url = f"{service.url}{path}"
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    else:
        response = httpx.post(url, json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if reason:
        assert reason in error["message"], error["message"]


def test_openai_client_sees_the_reason(client):
    with pytest.raises(openai.BadRequestError, match="from 0 \\(greedy\\) to 2"):
        client.chat.completions.create(model="plain", messages=HI, temperature=3)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.chat.completions.create(model="nope", messages=HI)


NEUTRAL_CHAT = dict(frequency_penalty=0, presence_penalty=0.0, logprobs=False, top_logprobs=0, tools=[],
                    tool_choice="none", parallel_tool_calls=True, user="u1", logit_bias={}, response_format={"type": "text"},
                    service_tier="auto", store=False, metadata={"k": "v"}, max_completion_tokens=12, n=1, seed=3)


def test_openai_fields_at_neutral_values_are_accepted(service, client, tiny_target):
    question = "Name a fruit."
    expected = _expected_chat(tiny_target, question, 12)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": question}]
    response = client.chat.completions.create(model="plain", messages=messages[1:], temperature=0, **NEUTRAL_CHAT)
    assert response.choices[0].message.content == expected and response.choices[0].logprobs is None
    developer = client.chat.completions.create(model="plain", messages=messages, temperature=0, max_tokens=12)
    system = client.chat.completions.create(model="plain", messages=[{**messages[0], "role": "system"}, messages[1]],
                                            temperature=0, max_tokens=12)
    assert developer.choices[0].message.content == system.choices[0].message.content  # developer reads as system
    completion = client.completions.create(model="plain", prompt="2+2=", temperature=0, max_tokens=4, echo=False,
                                           best_of=1, frequency_penalty=0, presence_penalty=0, logit_bias={}, user="u",
                                           suffix=None, logprobs=None)
    assert completion.choices[0].finish_reason in ("stop", "length")
    fixed = client.chat.completions.create(model="plain", messages=HI, temperature=0, max_tokens=9,
                                           extra_body={"ignore_eos": True})  # vLLM's extension, as its client sends
    assert fixed.usage.completion_tokens == 9 and fixed.choices[0].finish_reason == "length"


def test_openai_client_with_default_arguments(client):
    chat = client.chat.completions.create(model="plain", messages=HI)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    text = client.completions.create(model="math", prompt="Once upon a time")
    assert text.choices[0].index == 0 and text.usage.prompt_tokens >= 1
    chunks = list(client.chat.completions.create(model="plain", messages=HI, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completion_prompt_arrays_give_one_choice_per_prompt(service, tiny_target):
    tok, stop_ids = tiny_target.tokenizer, tiny_target.stop_token_ids
    texts = ["The sky is", "Two plus two is", "Hello"]
    ids = [tok.encode(t) for t in texts]
    expected = [_text(tok, _hf_greedy(tiny_target, p, 8), stop_ids) for p in ids]
    for prompt in (texts, ids):
        body = {"model": "math", "prompt": prompt, "temperature": 0, "max_tokens": 8}
        response = httpx.post(f"{service.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        result = response.json()
        assert [c["index"] for c in result["choices"]] == [0, 1, 2]
        assert [c["text"] for c in result["choices"]] == expected
        assert result["usage"]["prompt_tokens"] == sum(len(p) for p in ids)
    body = {"model": "plain", "prompt": texts[:2], "temperature": 0, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{service.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        pieces = [e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == index]
        assert "".join(pieces) == expected[index]


def test_logprobs_come_from_the_target(service, client, tiny_target):
    response = client.chat.completions.create(model="math", messages=HI, temperature=0, max_tokens=6, logprobs=True,
                                              top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
    prompt = render_ids(tiny_target.tokenizer, HI, add_generation_prompt=True)
    tokens = _hf_greedy(tiny_target, prompt, 6)
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    for i, (token, item) in enumerate(zip(tokens, content)):
        assert item.logprob == pytest.approx(float(logits[len(prompt) - 1 + i, token]), abs=1e-3)
    text = httpx.post(f"{service.url}/v1/completions", timeout=TIMEOUT,
                      json={"model": "plain", "prompt": "Hi", "temperature": 0, "max_tokens": 5, "logprobs": 2}).json()
    logprobs = text["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == text["usage"]["completion_tokens"]
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and logprobs["text_offset"][0] == 0


def test_full_queue_answers_503_with_retry_after(service, tiny_config, tmp_path):
    serve = service.serve
    cfg = _serve_config(tiny_config, tmp_path / "tight", max_batch_size=1, max_queued_requests=1)
    serve.run(build_app(cfg), name="taps-tight", route_prefix="/tight")
    try:
        _wait_healthy(f"{service.url}/tight")
        body = {"model": "plain", "messages": HI, "temperature": 0, "max_tokens": MAX_TOKENS_LIMIT}
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(
                lambda _: httpx.post(f"{service.url}/tight/v1/chat/completions", json=body, timeout=TIMEOUT), range(6)))
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 503} and statuses[200] >= 2, statuses
        for r in responses:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1 and "max_queued_requests" in r.json()["error"]["message"]
    finally:
        serve.delete("taps-tight")


def test_every_listener_of_the_service_is_on_loopback(service, client):
    """After requests were served, every listening socket of this process and the processes it started (GCS,
    raylet, agents, Serve controller, proxy, replicas) is on loopback: Serve's HTTP port and the replica's own
    inter-deployment gRPC server included (Ray Serve 2.60 binds that one to every interface by default)."""
    from taps_ray.config import ServeConfig

    assert ServeConfig().host == "127.0.0.1"
    answer = client.chat.completions.create(model="routed", messages=HI, temperature=0, max_tokens=4)
    assert answer.choices[0].message.content is not None
    found = listeners()
    port = int(service.url.rsplit(":", 1)[1])
    assert port in {listener.port for listener in found}, "the check must see Serve's HTTP proxy"
    replicas = {listener.pid for listener in found if listener.name.startswith("ray::ServeReplica")}
    assert replicas, f"the check must see the replica's listeners: {found}"
    assert not exposed(found), f"listeners off loopback: {exposed(found)}"


def test_the_replica_listens_itself_with_serve_listener_replica(service, tiny_target):
    """serve.listener=replica: the replica answers HTTP on its own port (no Serve proxy in the path), on loopback,
    greedy output equal to transformers' and streamed chunks adding up to it (a transport test: the proxy's tests
    above check the decoding); deleting the app closes the port."""
    serve = service.serve
    port = _free_port()
    cfg = _serve_config(service.cfg, Path(service.cfg.work_dir), listener="replica", port=port)
    serve.run(build_app(cfg), name="taps-direct", route_prefix="/direct")
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(url)["models"] == service.health["models"]
        direct = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120.0)
        question = "What is 7 times 6? Explain briefly."
        expected = _expected_chat(tiny_target, question, 24)
        messages = [{"role": "user", "content": question}]
        answer = direct.chat.completions.create(model="plain", messages=messages, temperature=0, max_tokens=24)
        assert answer.choices[0].message.content == expected
        chunks = list(direct.chat.completions.create(model="plain", messages=messages, temperature=0, max_tokens=24,
                                                     stream=True))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == expected and len(pieces) >= 2
        assert httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": messages},
                          timeout=TIMEOUT).status_code == 404
        found = listeners()
        assert any(item.port == port and item.name.startswith("ray::ServeReplica") for item in found), found
        assert not exposed(found), f"listeners off loopback: {exposed(found)}"
    finally:
        serve.delete("taps-direct")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5.0)


def test_replica_listener_takes_one_replica():
    with pytest.raises(ValidationError, match="serve.listener=proxy"):
        ServeConfig(listener="replica", num_replicas=2)
    with pytest.raises(ValidationError, match="serve.listener=proxy"):
        ServeConfig(listener="replica", autoscaling_config={"min_replicas": 1, "max_replicas": 2})


def test_serve_tree_sets_the_shape_served_heads_draft_and_must_fit():
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    chain = parse_config({**data, "serve": {"tree": {"total_token": 4, "top_k": 1}}})
    assert chain.served().tree.model_dump() == {**chain.tree.model_dump(), "total_token": 4, "top_k": 1}
    assert chain.tree.top_k == 3 and chain.served().tree.passes == 2  # the study's own tree is left as it is
    with pytest.raises(ConfigError, match="serve.tree over the study's tree: total_token-1=39 exceeds"):
        parse_config({**data, "serve": {"tree": {"total_token": 40, "top_k": 1}}})


def test_openapi_schema_publishes_live_limits(service):
    schema = httpx.get(f"{service.url}/openapi.json").json()
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert request["model"]["enum"] == service.health["models"]
    maxima = [o.get("maximum") for o in request["max_tokens"]["anyOf"] if o.get("type") == "integer"]
    assert maxima == [MAX_TOKENS_LIMIT]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz"} <= set(schema["paths"])


# --- a service without heads still starts ---------------------------------------------------------------------


def test_missing_heads_serve_plain_only(service, tiny_config, tmp_path):
    serve = service.serve
    cfg = _serve_config(tiny_config, tmp_path / "no-heads")
    serve.run(build_app(cfg), name="taps-noheads", route_prefix="/noheads")
    try:
        health = _wait_healthy(f"{service.url}/noheads")
        # plain and prompt lookup draft with no trained head, so they are served without any
        assert health["models"] == ["plain", "ngram"] and health["missing_heads"] == ["math", "chat"]
        models = httpx.get(f"{service.url}/noheads/v1/models").json()
        assert [card["id"] for card in models["data"]] == ["plain", "ngram"]
        response = httpx.post(f"{service.url}/noheads/v1/chat/completions", json={"model": "routed", "messages": HI})
        assert response.status_code == 404 and "taps train" in response.json()["error"]["message"]
        ok = httpx.post(
            f"{service.url}/noheads/v1/chat/completions",
            json={"model": "plain", "messages": HI, "temperature": 0, "max_tokens": 4},
            timeout=TIMEOUT,
        )
        assert ok.status_code == 200, ok.text
    finally:
        serve.delete("taps-noheads")


def test_drafting_models_run_under_the_cost_model_by_default(service, tiny_config, tiny_target):
    """The defaults (`serve.cost_model: true`, `serve.measure_drafting: true`, no cap): `math` keeps its name, its
    first step is plain (the cost model measures a plain step first), and the output is still the target's greedy
    one while the drafting gate measures and exports its step rates."""
    serve = service.serve
    defaults = {"cost_model": True, "measure_drafting": True, "draft_below": None}
    cfg = service.cfg.model_copy(update={"serve": service.cfg.serve.model_copy(update=defaults)})
    serve.run(build_app(cfg), name="taps-cost", route_prefix="/cost")
    try:
        health = _wait_healthy(f"{service.url}/cost")
        assert "math" in health["models"] and "routed" in health["models"]
        question = "What is 7 times 6? Explain briefly."
        for model in ("math", "routed"):
            response = httpx.post(f"{service.url}/cost/v1/chat/completions", timeout=TIMEOUT, json={
                "model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                "max_tokens": 24})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["message"]["content"] == _expected_chat(tiny_target, question, 24)
            assert body["speculative"]["head_fractions"].get("none", 0) > 0  # the cost model's plain steps
    finally:
        serve.delete("taps-cost")


# --- the three ways to build it --------------------------------------------------------------------------------


def test_serve_yaml_and_app_builder():
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    deploy = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "configs" / "serve.yaml").read_text()))
    assert deploy.http_options.host == "127.0.0.1"
    (app,) = deploy.applications
    assert app.import_path == "taps_ray.serve.app:app_builder"
    assert set(app.args) <= set(AppArgs.model_fields)
    assert isinstance(app_builder(dict(app.args)), Application)
    assert isinstance(app_builder({"config": "configs/tiny.yaml", "num_replicas": "2"}), Application)
    # configs/cpu.yaml has the replica listen itself under `taps serve`; `serve run` brings Serve's proxy instead
    bound = app_builder({"config": "configs/cpu.yaml"})._bound_deployment.init_args[0]
    assert load_config(REPO / "configs" / "cpu.yaml").serve.listener == "replica"
    assert bound["serve"]["listener"] == "proxy"
    with pytest.raises(ValueError, match="known args"):
        app_builder({"config": "configs/tiny.yaml", "bogus": "1"})


def test_cli_has_serve():
    from taps_ray.cli import build_parser

    args = build_parser().parse_args(["serve", "--config", "configs/tiny.yaml", "--port", "8123"])
    assert args.command == "serve" and args.port == 8123 and args.host is None


# --- fuzzing from the app's own OpenAPI schema -------------------------------------------------------------------


FUZZ_STATUSES: Counter = Counter()


@pytest.fixture(scope="module")
def api_schema(service):
    yield schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    if FUZZ_STATUSES:  # shown with `pytest -s`: which statuses the fuzzer's cases got, per operation
        print("\nfuzz statuses:", dict(sorted(FUZZ_STATUSES.items())))


fuzz_schema = schemathesis.pytest.from_fixture("api_schema")


@fuzz_schema.parametrize()
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz_never_a_server_error(case):
    response = case.call_and_validate(checks=[not_a_server_error], timeout=120)
    FUZZ_STATUSES[f"{case.operation.label} {response.status_code}"] += 1


@pytest.mark.parametrize("wait, env", [
    ("default", {"GOMP_SPINCOUNT": "300000"}),
    ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
    ("active", {"OMP_WAIT_POLICY": "ACTIVE"}),
])
def test_replica_openmp_wait_reaches_the_replica_environment(wait: str, env: dict[str, str]):
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"replica_omp_wait": wait})})
    env_vars = build_app(cfg)._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert {key: env_vars.get(key) for key in env} == env
    assert env_vars["TOKENIZERS_PARALLELISM"] == "false"  # the other process settings stay


def test_replica_openmp_wait_refuses_an_unknown_policy():
    with pytest.raises(ValidationError, match="replica_omp_wait"):
        ServeConfig(replica_omp_wait="spin")
