"""Load report of the Ray Serve app in one command: streamed chat clients on loopback, then an overload run.

For each target dtype (`--dtypes`) the script deploys the app once with every model in `--models` and, for each
client count in `--clients`, runs each model in turn for `--duration` seconds: the models of one client count
run back to back, so they see the same machine conditions. Each point reports completion tokens/s, p50/p99
end-to-end latency, p50/p99 time to first token (arrival of the first streamed content chunk), errors (0
expected: every point stays below the queue limit), mean tau and batch size, and, for float32, whether every
T=0 answer equals the target's plain greedy decoding (HF `model.generate`, computed in-process first).

The overload run then redeploys the first dtype with a small `serve.max_queued_requests` (`--max-queued`) and
sends `--overload-clients` clients at it, every model in round robin, each request with a deadline
(`--request-timeout`). A clean result: every request answered in time, only 200s and 503s with a Retry-After
header (the clients wait what it says before their next request), no other 5xx, no stream cut short, and the
replica idle afterwards.

    # tiny random target, random eagle2 heads in a temporary work dir, a few seconds per point; prints the section
    python benchmarks/serving/serve_load.py --config configs/tiny.yaml --random-heads --duration 3

    # the real report (about 12 minutes): trained speed heads, fp32 (exact greedy check) and bf16
    python benchmarks/serving/serve_load.py --config configs/speed.yaml --dtypes float32,bfloat16 --models plain,math,routed \
        --clients 1,4,8,16 --max-tokens 32 --duration 15 --overload-duration 20 --out reports/serve_load.md

Everything stays on this machine: Ray in its loopback mode, Serve's HTTP proxy on 127.0.0.1. Each run
replaces its own section (named by --label, default the config's name) in --out. Exit status 1 when a point
has errors, a float32 answer differs from greedy, or the overload run is not clean.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

import httpx  # noqa: E402

from taps_ray.fsio import atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402

QUESTIONS = [
    "What is 12 times 7?",
    "Write one sentence about the ocean.",
    "Solve for x: 3x + 5 = 20.",
    "Name three primary colors.",
    "If a train travels 60 km in 1.5 hours, what is its speed?",
    "Give me a tip for learning a new language.",
    "What is the square root of 144?",
    "Describe a cat in five words.",
    "A shop sells pens at 3 dollars each. How much do 8 pens cost?",
    "What is the capital of Japan?",
    "Compute 15% of 200.",
    "Suggest a name for a small bakery.",
    "How many minutes are in 3 hours?",
    "Explain what a noun is.",
    "What is 1000 minus 357?",
    "Write a haiku about rain.",
]
APP_NAME = "taps-load"
IDLE_WAIT_S = 30.0
# How a request ended, as the overload table counts it; "ok" is a complete 200 stream.
OUTCOMES = ("ok", "503", "503 without Retry-After", "other 5xx", "4xx", "lost", "hung")


@dataclass
class Outcome:
    """One streamed request as the client saw it."""

    model: str
    question: str
    status: int = 0  # HTTP status; 0: no response at all
    latency: float = 0.0  # send to the last byte (or to the failure)
    ttft: float | None = None  # send to the first content chunk (or to the finish chunk when there is no text)
    text: str = ""
    tokens: int = 0
    tau: float | None = None
    batch: int | None = None
    finished: bool = False  # a finish chunk arrived
    retry_after: str | None = None
    timed_out: bool = False
    problem: str | None = None  # why this is not a clean answer

    @property
    def kind(self) -> str:
        """One of OUTCOMES."""
        if self.timed_out:
            return "hung"
        if self.status == 200:
            return "ok" if self.problem is None else "lost"
        if self.status == 0:
            return "lost"
        if self.status == 503:
            return "503" if retry_after_s(self.retry_after) is not None else "503 without Retry-After"
        return "other 5xx" if self.status >= 500 else "4xx"


def retry_after_s(header: str | None) -> int | None:
    """The Retry-After header as whole seconds, None unless it is a positive integer (the form the service sends)."""
    if header is None or not header.strip().isdigit():
        return None
    seconds = int(header)
    return seconds if seconds > 0 else None


def parse_clients(text: str) -> list[int]:
    """`--clients 1,4,8,16` -> [1, 4, 8, 16] (positive, in the order given, no repeats)."""
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"expected distinct positive client counts such as 1,4,8,16, got {text!r}")
    return counts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def apply_chunk(out: Outcome, chunk: dict, elapsed: float) -> None:
    """Fold one server-sent chunk into the outcome: text, time to first token, the finish chunk's `speculative`
    block, the usage chunk (`stream_options.include_usage`) or an error event."""
    if "error" in chunk:
        out.problem = f"error event: {chunk['error'].get('message', chunk['error'])}"[:200]
        return
    for choice in chunk.get("choices", []):
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            out.text += piece
            if out.ttft is None:
                out.ttft = elapsed
        if choice.get("finish_reason") is not None:
            out.finished = True
            out.ttft = elapsed if out.ttft is None else out.ttft
            spec = chunk.get("speculative") or {}
            out.tau, out.batch = spec.get("tau"), spec.get("batch_size")
    if chunk.get("usage"):
        out.tokens = chunk["usage"]["completion_tokens"]


async def request(http: httpx.AsyncClient, model: str, question: str, max_tokens: int, timeout_s: float) -> Outcome:
    """One streamed T=0 chat completion, with a deadline for the whole response."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome(model, question)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                out.status = response.status_code
                if response.status_code != 200:
                    out.retry_after = response.headers.get("retry-after")
                    out.problem = (await response.aread()).decode(errors="replace")[:200]
                else:
                    done = False
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            if line == "data: [DONE]":
                                done = True
                                break
                            apply_chunk(out, json.loads(line[len("data: "):]), time.perf_counter() - t0)
                    if out.problem is None and not (done and out.finished):
                        out.problem = "the stream ended without a finish chunk and [DONE]"
    except TimeoutError:
        out.timed_out, out.problem = True, f"no complete response within {timeout_s:.0f} s"
    except httpx.HTTPError as error:
        out.problem = repr(error)[:200]
    out.latency = time.perf_counter() - t0
    return out


async def drive(url: str, plan: Callable[[int], tuple[str, str]], clients: int, duration: float, max_requests: int,
                max_tokens: int, timeout_s: float) -> tuple[list[Outcome], float]:
    """`clients` concurrent clients, each sending request `plan(n)` after request until `duration` has passed (a
    request in flight then still finishes); after a 503 a client waits what Retry-After says."""
    outcomes: list[Outcome] = []
    counter = itertools.count()
    deadline = time.perf_counter() + duration

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            n = next(counter)
            if n >= max_requests:
                return
            out = await request(http, *plan(n), max_tokens, timeout_s)
            outcomes.append(out)
            wait = retry_after_s(out.retry_after) if out.status == 503 else None
            if wait:
                await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], elapsed: float, expected: dict[str, str] | None,
              expected_kinds: tuple[str, ...] = ("ok",)) -> dict:
    """One point's figures; throughput counts the completion tokens of clean answers over the whole run. The
    samples show requests whose kind is not among `expected_kinds`, and one 503 body."""
    ok = [o for o in outcomes if o.kind == "ok"]
    mismatches = [o for o in ok if expected is not None and o.text != expected[o.question]]
    taus = [o.tau for o in ok if o.tau is not None]
    batches = [o.batch for o in ok if o.batch is not None]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "kinds": Counter(o.kind for o in outcomes),
        "error_samples": [f"{o.kind} {o.status}: {o.problem}" for o in outcomes if o.kind not in expected_kinds][:3],
        "rejection": next((o.problem for o in outcomes if o.status == 503), None),
        "checked": expected is not None,
        "mismatches": len(mismatches),
        "mismatch_samples": [(o.model, o.question, o.text[:60], expected[o.question][:60]) for o in mismatches[:3]],
        "tokens_per_s": sum(o.tokens for o in ok) / elapsed if elapsed > 0 else 0.0,
        "p50": percentile([o.latency for o in ok], 0.5),
        "p99": percentile([o.latency for o in ok], 0.99),
        "ttft50": percentile([o.ttft for o in ok if o.ttft is not None], 0.5),
        "ttft99": percentile([o.ttft for o in ok if o.ttft is not None], 0.99),
        "tau": statistics.fmean(taus) if taus else float("nan"),
        "mean_batch": statistics.fmean(batches) if batches else float("nan"),
        "max_batch": max(batches, default=0),
        "retry_after": sorted({s for o in outcomes if (s := retry_after_s(o.retry_after)) is not None}),
        "reject_p99": percentile([o.latency for o in outcomes if o.status == 503], 0.99),
        "elapsed": elapsed,
    }


def overload_failures(stats: dict, idle: bool) -> list[str]:
    """Why an overload run is not clean (empty when it is)."""
    kinds = stats["kinds"]
    failures = [f"{kinds[k]} {k}" for k in OUTCOMES if k not in ("ok", "503") and kinds[k]]
    if not kinds["503"]:
        failures.append("no 503: the run never filled the queue")
    if stats["mismatches"]:
        failures.append(f"{stats['mismatches']} answers differ from greedy")
    if not idle:
        failures.append(f"the replica still had requests {IDLE_WAIT_S:.0f} s after the run")
    return failures


# --- the service ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_config(args: argparse.Namespace):
    from taps_ray.config import load_config

    cfg = load_config(args.config)
    serve_update = {}
    if args.max_batch_size:
        serve_update["max_batch_size"] = args.max_batch_size
    if args.replica_cpus:
        serve_update["replica_num_cpus"] = args.replica_cpus
    if args.draft_below is not None:
        serve_update["draft_below"] = args.draft_below or None
    if args.max_tokens > cfg.serve.max_tokens_limit:
        serve_update["max_tokens_limit"] = args.max_tokens
    return cfg.model_copy(update={"serve": cfg.serve.model_copy(update=serve_update)}) if serve_update else cfg


def variant(cfg, dtype: str, max_queued: int | None = None):
    """The config with the target in `dtype` and, when given, a different serve.max_queued_requests."""
    update = {"target": cfg.target.model_copy(update={"dtype": dtype})}
    if max_queued is not None:
        update["serve"] = cfg.serve.model_copy(update={"max_queued_requests": max_queued})
    return cfg.model_copy(update=update)


def write_random_heads(cfg, work: Path):
    """Random (untrained) heads of serve.head_kind for every training mixture, in `work`; returns the config."""
    from taps_ray.config import with_overrides
    from taps_ray.models.draft_head import new_head
    from taps_ray.models.target import load_target
    from taps_ray.workdir import head_checkpoint

    cfg = with_overrides(cfg, work_dir=str(work))
    target = load_target(cfg.target)
    for seed, mixture in enumerate(cfg.train.mixtures, start=1):
        new_head(target.model.config, seed=seed).save(head_checkpoint(cfg, cfg.serve.head_kind, mixture))
    return cfg


def expected_answers(cfg, max_tokens: int) -> dict[str, str]:
    """Plain greedy answers of the target (HF generate), decoded the way the service decodes."""
    import torch

    from taps_ray.data.chat import render_ids
    from taps_ray.models.target import load_target

    target = load_target(cfg.target)
    stop_ids = target.stop_token_ids
    answers = {}
    for question in QUESTIONS:
        prompt = render_ids(target.tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
        out = target.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=stop_ids, pad_token_id=0,
        )
        tokens = out[0, len(prompt):].tolist()
        for i, token in enumerate(tokens):
            if token in stop_ids:
                tokens = tokens[:i]
                break
        answers[question] = target.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return answers


def deploy(cfg, url: str, replace: bool) -> dict:
    """(Re)deploy the app for `cfg` (the old replica goes first, so the new one gets the cores); returns /healthz."""
    from ray import serve

    from taps_ray.serve.app import build_app

    if replace:
        serve.delete(APP_NAME)
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    return httpx.get(f"{url}/healthz", timeout=60).json()


async def warm_up(url: str, models: list[str], timeout_s: float) -> None:
    """One short request per model (not counted): the first step of each proposer compiles and allocates."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        for model in models:
            await request(http, model, "Hi", 2, timeout_s)


async def wait_idle(url: str) -> bool:
    """Whether the replica has no running or waiting request within IDLE_WAIT_S (nothing leaked)."""
    deadline = time.perf_counter() + IDLE_WAIT_S
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while time.perf_counter() < deadline:
            health = (await http.get("/healthz")).json()
            if health["running"] == 0 and health["waiting"] == 0:
                return True
            await asyncio.sleep(0.5)
    return False


# --- the report ----------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return "–" if seconds != seconds else f"{seconds * 1000:.0f} ms"


def ratio(value: float, base: float | None) -> str:
    return "–" if not base or value != value or base != base else f"{value / base:.2f}x"


def check_cell(stats: dict) -> str:
    if not stats["checked"]:
        return "not checked (not float32)"
    return f"{stats['ok'] - stats['mismatches']}/{stats['ok']} equal"


def points_table(points: dict[tuple[int, str], dict]) -> list[str]:
    """One row per client count x model; ratios are against plain at the same client count."""
    lines = [
        "| clients | model | requests | errors | completion tok/s | tok/s vs plain | p50 latency | p50 vs plain | "
        "p99 latency | p50 TTFT | p99 TTFT | mean tau | mean / max batch | T=0 greedy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (clients, model), s in points.items():
        plain = points.get((clients, "plain"))
        lines.append(
            f"| {clients} | {model} | {s['requests']} | {s['errors']} | {s['tokens_per_s']:.1f} | "
            f"{ratio(s['tokens_per_s'], plain and plain['tokens_per_s'])} | {ms(s['p50'])} | "
            f"{ratio(s['p50'], plain and plain['p50'])} | {ms(s['p99'])} | {ms(s['ttft50'])} | {ms(s['ttft99'])} | "
            f"{s['tau']:.2f} | {s['mean_batch']:.2f} / {s['max_batch']} | {check_cell(s)} |")
    return lines


def overload_table(stats: dict, failures: list[str]) -> list[str]:
    kinds = stats["kinds"]
    waits = stats["retry_after"]
    return [
        "| requests | 200 | 503 with Retry-After | Retry-After | 503 without it | other 5xx | 4xx | lost | hung | "
        "p50 / p99 latency (200) | p99 latency (503) | T=0 greedy (200) | verdict |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        f"| {stats['requests']} | {kinds['ok']} | {kinds['503']} | "
        f"{'–' if not waits else f'{waits[0]} s' if len(waits) == 1 else f'{waits[0]}–{waits[-1]} s'} | "
        f"{kinds['503 without Retry-After']} | "
        f"{kinds['other 5xx']} | {kinds['4xx']} | {kinds['lost']} | {kinds['hung']} | "
        f"{ms(stats['p50'])} / {ms(stats['p99'])} | {ms(stats['reject_p99'])} | {check_cell(stats)} | "
        f"{'clean' if not failures else 'NOT clean: ' + '; '.join(failures)} |",
    ]


def samples(stats: dict, title: str) -> list[str]:
    lines = []
    if stats["error_samples"]:
        lines += [f"{title}: errors (first three):", "", *[f"- `{e}`" for e in stats["error_samples"]], ""]
    if stats["mismatch_samples"]:
        lines += [f"{title}: greedy mismatches (first three: model, question, served, expected):", "",
                  *[f"- {s}" for s in stats["mismatch_samples"]], ""]
    return lines


def machine() -> str:
    """CPU model and cores, and whether torch sees a GPU."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu_line()}; {gpu}"


def write_section(path: Path, label: str, section: str) -> None:
    header = ("# Serve load test\n\n`benchmarks/serving/serve_load.py`: concurrent streamed OpenAI-style chat clients against "
              "the Ray Serve app on loopback, T=0, then an overload run past the queue limit. Sections are "
              "rewritten by the command shown in each.\n")
    text = path.read_text() if path.is_file() else header
    pattern = re.compile(rf"<!-- section:{re.escape(label)} -->.*?<!-- /section:{re.escape(label)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, text)


# --- the run -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="study config of the service (heads from its work_dir)")
    parser.add_argument("--random-heads", action="store_true", help="write random heads to a temporary work dir first")
    parser.add_argument("--models", default=None,
                        help="comma-separated, e.g. plain,math,routed (default: plain, every head, routed)")
    parser.add_argument("--clients", type=parse_clients, default=[1, 4, 8, 16], help="client counts (default 1,4,8,16)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per point (default 20)")
    parser.add_argument("--max-requests", type=int, default=1000, help="at most this many requests per point")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated target dtypes, one deployment each (default: the config's)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="override serve.max_batch_size")
    parser.add_argument("--replica-cpus", type=float, default=None,
                        help="override serve.replica_num_cpus (also the replica's torch threads)")
    parser.add_argument("--draft-below", type=int, default=None,
                        help="override serve.draft_below (0: always draft, whatever the batch)")
    parser.add_argument("--max-queued", type=int, default=4, help="serve.max_queued_requests of the overload run")
    parser.add_argument("--overload-clients", type=int, default=32, help="clients of the overload run (0: skip it)")
    parser.add_argument("--overload-duration", type=float, default=None, help="seconds (default: --duration)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds for a whole response; longer counts as hung (default 120)")
    parser.add_argument("--label", default=None, help="report section name (default: the config's name)")
    parser.add_argument("--out", default=None, help="markdown report to write/update, e.g. reports/serve_load.md")
    args = parser.parse_args(argv)
    if min(args.duration, args.max_requests, args.max_tokens, args.max_queued, args.request_timeout) <= 0:
        parser.error("--duration, --max-requests, --max-tokens, --max-queued and --request-timeout must be positive")
    return args


def pick_models(requested: str | None, health: dict) -> list[str]:
    available = health["models"]
    if not requested:
        return [m for m in ["plain", *health["heads"], "routed"] if m in available]
    models = [m.strip() for m in requested.split(",") if m.strip()]
    unknown = [m for m in models if m not in available]
    if unknown:
        raise SystemExit(f"serve_load: {unknown} not served (missing heads: {health['missing_heads']}); "
                         f"available: {available}")
    return models


@dataclass
class Run:
    """What one invocation measured."""

    models: list[str]
    points: dict[str, dict[tuple[int, str], dict]]  # dtype -> (clients, model) -> figures
    overload: dict | None
    failures: list[str]


def measure_points(args: argparse.Namespace, url: str, dtype: str, models: list[str],
                   expected: dict[str, str] | None, failures: list[str]) -> dict[tuple[int, str], dict]:
    """Every client count, and within it every model in turn (the same machine conditions for all models)."""
    points: dict[tuple[int, str], dict] = {}
    total = len(args.clients) * len(models)
    for clients in args.clients:
        for model in models:
            outcomes, elapsed = asyncio.run(drive(
                url, lambda n, m=model: (m, QUESTIONS[n % len(QUESTIONS)]), clients, args.duration,
                args.max_requests, args.max_tokens, args.request_timeout))
            s = points[(clients, model)] = summarize(outcomes, elapsed, expected)
            print(f"serve_load: [{dtype} {len(points)}/{total}] {clients} clients {model}: {s['requests']} requests, "
                  f"{s['errors']} errors, {s['tokens_per_s']:.1f} tok/s, p50 {ms(s['p50'])}, TTFT p50 "
                  f"{ms(s['ttft50'])}, tau {s['tau']:.2f}, batch {s['mean_batch']:.2f}", flush=True)
            if s["errors"] or s["mismatches"]:
                failures.append(f"{dtype}, {clients} clients, {model}: {s['errors']} errors, "
                                f"{s['mismatches']} greedy mismatches")
    return points


def run_overload(args: argparse.Namespace, cfg, url: str, models: list[str], expected: dict[str, str] | None) -> dict:
    """Redeploy with the small queue, overload it with every model in round robin, then check the replica is idle."""
    duration = args.overload_duration or args.duration
    print(f"serve_load: overload run ({cfg.target.dtype}): max_queued_requests={args.max_queued}, "
          f"{args.overload_clients} clients, {duration:g} s", flush=True)
    deploy(cfg, url, replace=True)
    asyncio.run(warm_up(url, models, args.request_timeout))
    outcomes, elapsed = asyncio.run(drive(
        url, lambda n: (models[n % len(models)], QUESTIONS[(n // len(models)) % len(QUESTIONS)]),
        args.overload_clients, duration, sys.maxsize, args.max_tokens, args.request_timeout))
    idle = asyncio.run(wait_idle(url))
    stats = summarize(outcomes, elapsed, expected, ("ok", "503"))
    failures = overload_failures(stats, idle)
    print(f"serve_load: overload: {dict(stats['kinds'])}, idle after: {idle}, "
          f"{'clean' if not failures else failures}", flush=True)
    return {"dtype": cfg.target.dtype, "duration": duration, "stats": stats, "idle": idle, "failures": failures}


def measure(args: argparse.Namespace, cfg, dtypes: list[str]) -> Run:
    """Start loopback Ray + Serve in this process, deploy each dtype in turn, then the overload run on the first."""
    import ray
    from ray import serve

    from taps_ray.ray_runtime import start_ray, start_serve

    run = Run(models=[], points={}, overload=None, failures=[])
    start_ray(cfg.ray, log_to_driver=False)
    try:
        port = free_port()
        start_serve(port=port)
        url = f"http://127.0.0.1:{port}"
        for i, dtype in enumerate(dtypes):
            dcfg = variant(cfg, dtype)
            expected = expected_answers(dcfg, args.max_tokens) if dtype == "float32" else None
            print(f"serve_load: deploying {dcfg.target.name} ({dtype}) on {url}", flush=True)
            run.models = pick_models(args.models, deploy(dcfg, url, replace=i > 0))
            asyncio.run(warm_up(url, run.models, args.request_timeout))
            run.points[dtype] = measure_points(args, url, dtype, run.models, expected, run.failures)
            if args.overload_clients and run.overload is None:
                run.overload = run_overload(args, variant(cfg, dtype, args.max_queued), url, run.models, expected)
                run.failures += [f"overload: {f}" for f in run.overload["failures"]]
    finally:
        serve.shutdown()
        ray.shutdown()
    return run


def report(args: argparse.Namespace, cfg, run: Run, setup: list[str], command: str) -> str:
    label = args.label or cfg.name
    lines = [f"<!-- section:{label} -->", f"## {label}", "", "Regenerate with:", "", "```sh", command, "```", "",
             *[f"- {item}" for item in setup], ""]
    for dtype, points in run.points.items():
        lines += [f"### {dtype}", "", *points_table(points), ""]
        for (clients, model), s in points.items():
            lines += samples(s, f"{dtype}, {clients} clients, {model}")
    if run.overload is not None:
        o = run.overload
        lines += [f"### Overload: {o['dtype']}, serve.max_queued_requests={args.max_queued}, "
                  f"{args.overload_clients} clients, {o['duration']:g} s", "",
                  f"Models in round robin. Each request must be answered within {args.request_timeout:g} s, else it "
                  f"counts as hung; lost: no response, or a stream cut short. After a 503 a client waits its "
                  f"Retry-After. Replica idle (nothing running or waiting) after the run: "
                  f"{'yes' if o['idle'] else 'NO'}.", "",
                  *([f"A 503 body: `{o['stats']['rejection']}`", ""] if o["stats"]["rejection"] else []),
                  *overload_table(o["stats"], o["failures"]), "", *samples(o["stats"], "overload")]
    lines.append(f"<!-- /section:{label} -->")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from taps_ray.relpaths import shown_path
    from taps_ray.workdir import heads_root

    args = parse_args(argv)
    cfg = prepare_config(args)
    dtypes = [d.strip() for d in (args.dtypes or cfg.target.dtype).split(",") if d.strip()]
    limit = cfg.serve.max_batch_size + args.max_queued
    if args.overload_clients and args.overload_clients <= limit:
        print(f"serve_load: --overload-clients {args.overload_clients} cannot overload max_batch_size "
              f"{cfg.serve.max_batch_size} + --max-queued {args.max_queued}; give more than {limit}", file=sys.stderr)
        return 2
    above = [c for c in args.clients if c > cfg.serve.max_batch_size + cfg.serve.max_queued_requests]
    if above:
        print(f"serve_load: {above} clients exceed max_batch_size + serve.max_queued_requests: expect 503s there",
              file=sys.stderr)
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/serving/serve_load.py",
                                                            *(argv if argv is not None else sys.argv[1:])])
    load_start, began = os.getloadavg()[0], time.perf_counter()
    if args.random_heads:
        work = Path(tempfile.mkdtemp(prefix="taps-serve-load-"))
        heads_note = f"random (untrained) {cfg.serve.head_kind} heads for {', '.join(cfg.train.mixtures)}"
        try:
            run = measure(args, write_random_heads(cfg, work), dtypes)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    else:
        heads_note = f"{cfg.serve.head_kind} heads from {shown_path(heads_root(cfg))}"
        run = measure(args, cfg, dtypes)

    setup = [
        f"target `{cfg.target.name}` in {', '.join(dtypes)}; {heads_note}",
        f"models: {', '.join(run.models)}; clients {', '.join(map(str, args.clients))}; {args.duration:g} s per point "
        f"(at most {args.max_requests} requests); streamed chat (`stream: true`, usage from "
        f"`stream_options.include_usage`), T=0, max_tokens={args.max_tokens}; the models of one client count run "
        f"back to back so they share the machine's conditions; TTFT is the arrival of the first content chunk",
        f"serve: {cfg.serve.num_replicas} replica(s) × {cfg.serve.replica_num_cpus:g} CPU, max_batch_size="
        f"{cfg.serve.max_batch_size} (continuous batching), max_queued_requests={cfg.serve.max_queued_requests}, "
        f"draft_below={cfg.serve.draft_below or 'off (always draft)'}; Ray and Serve on loopback",
        f"machine: {machine()}; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"{(time.perf_counter() - began) / 60:.1f} min in all; {time.strftime('%Y-%m-%d')}",
        f"timings on {os.cpu_count()} cores shared with other jobs are noisy: read the figures as ratios within "
        "one run (a model against plain at the same client count), not as absolute speeds",
    ]
    section = report(args, cfg, run, setup, command)
    print(section)
    if args.out:
        write_section(Path(args.out), args.label or cfg.name, section)
        print(f"serve_load: wrote section {args.label or cfg.name!r} of {args.out}")
    for failure in run.failures:
        print(f"serve_load: FAILED {failure}", file=sys.stderr)
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
