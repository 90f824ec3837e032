"""Load test of the Ray Serve app: N concurrent clients for a fixed time (and at most M requests), loopback only.

Reports requests/s, completion tokens/s, p50/p99 latency, errors (0 expected), the mean number of
sequences that shared a verification batch, tau per model, and whether every T=0 answer equals the
target's plain greedy decoding (HF `model.generate`, computed once in-process before the load starts).

    # start a service itself (tiny random target; random eagle2 heads written to a temporary work dir)
    python benchmarks/serve_load.py --config configs/tiny.yaml --random-heads --out reports/serve_load.md

    # SmolLM2 with whatever heads exist in runs/cpu/heads (plain only when there are none)
    python benchmarks/serve_load.py --config configs/cpu.yaml --dtype float32 --out reports/serve_load.md

    # against a running service (`taps serve --config configs/cpu.yaml`); --config for the greedy check
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --config configs/cpu.yaml

Each run replaces its own section (named by --label, default the config's name) in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

import httpx  # noqa: E402

from taps_ray.fsio import atomic_write_text  # noqa: E402

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
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _prepare_config(args):
    from taps_ray.config import load_config

    cfg = load_config(args.config)
    if args.dtype:
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"dtype": args.dtype})})
    serve_update = {}
    if args.max_batch_size:
        serve_update["max_batch_size"] = args.max_batch_size
    if args.replica_cpus:
        serve_update["replica_num_cpus"] = args.replica_cpus
    if args.draft_below is not None:
        serve_update["draft_below"] = args.draft_below or None
    if args.max_tokens > cfg.serve.max_tokens_limit:
        serve_update["max_tokens_limit"] = args.max_tokens
    if serve_update:
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update=serve_update)})
    return cfg


def _expected(cfg, max_tokens: int) -> dict[str, str]:
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


def _start_service(cfg, random_heads: bool) -> tuple[str, str]:
    """A loopback Ray + Serve in this process; returns (url, note about heads)."""
    from ray import serve

    from taps_ray.cluster.runtime import start_ray, start_serve
    from taps_ray.cluster.serve import build_app
    from taps_ray.models.draft_head import new_head
    from taps_ray.models.target import load_target
    from taps_ray.workdir import head_checkpoint, heads_root

    note = f"heads from {heads_root(cfg)}"
    if random_heads:
        work = Path(tempfile.mkdtemp(prefix="taps-serve-load-"))
        cfg = cfg.model_copy(update={"work_dir": str(work)})
        target = load_target(cfg.target)
        for seed, mixture in enumerate(cfg.train.mixtures, start=1):
            new_head(target.model.config, seed=seed).save(head_checkpoint(cfg, cfg.serve.head_kind, mixture))
        note = f"random (untrained) {cfg.serve.head_kind} heads for {', '.join(cfg.train.mixtures)}"
        del target
    start_ray(cfg.ray, log_to_driver=False)
    port = _free_port()
    start_serve(port=port)
    serve.run(build_app(cfg), name="taps-load", route_prefix="/")
    return f"http://127.0.0.1:{port}", note


def _stop_service() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


async def _load(url: str, models: list[str], clients: int, duration: float, max_requests: int, max_tokens: int,
                expected: dict[str, str] | None) -> dict:
    results: list[dict] = []
    counter = {"next": 0}
    deadline = time.perf_counter() + duration

    async def client(client_id: int, http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            n = counter["next"]
            if n >= max_requests:
                return
            counter["next"] = n + 1
            model, question = models[n % len(models)], QUESTIONS[(n // len(models)) % len(QUESTIONS)]
            body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                    "max_tokens": max_tokens}
            t0 = time.perf_counter()
            record = {"model": model, "question": question}
            try:
                response = await http.post("/v1/chat/completions", json=body)
                record["latency"] = time.perf_counter() - t0
                record["status"] = response.status_code
                if response.status_code == 200:
                    data = response.json()
                    record["text"] = data["choices"][0]["message"]["content"]
                    record["tokens"] = data["usage"]["completion_tokens"]
                    record["tau"] = data["speculative"]["tau"]
                    record["batch"] = data["speculative"]["batch_size"]
                else:
                    record["error"] = response.text[:200]
            except httpx.HTTPError as error:
                record.update(latency=time.perf_counter() - t0, status=0, error=repr(error))
            results.append(record)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as http:
        for model in models:  # warm-up, not counted
            await http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                          "temperature": 0, "max_tokens": 2})
        start = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        elapsed = time.perf_counter() - start

    ok = [r for r in results if r["status"] == 200]
    mismatches = [r for r in ok if expected is not None and r["text"] != expected[r["question"]]]
    per_model: dict[str, dict] = {}
    grouped = defaultdict(list)
    for r in ok:
        grouped[r["model"]].append(r)
    for model, rows in grouped.items():
        per_model[model] = {
            "requests": len(rows),
            "tau": statistics.fmean(r["tau"] for r in rows),
            "p50": _percentile([r["latency"] for r in rows], 0.5),
            "batch": statistics.fmean(r["batch"] for r in rows),
        }
    latencies = [r["latency"] for r in ok]
    return {
        "elapsed": elapsed,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": [r.get("error") for r in results if r["status"] != 200][:3],
        "mismatches": len(mismatches),
        "mismatch_samples": [(r["model"], r["question"], r["text"][:60], expected[r["question"]][:60])
                             for r in mismatches[:3]] if expected else [],
        "checked": expected is not None,
        "rps": len(ok) / elapsed if elapsed else 0.0,
        "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed if elapsed else 0.0,
        "p50": _percentile(latencies, 0.5),
        "p99": _percentile(latencies, 0.99),
        "mean_batch": statistics.fmean(r["batch"] for r in ok) if ok else 0.0,
        "max_batch": max((r["batch"] for r in ok), default=0),
        "per_model": per_model,
    }


def _markdown(label: str, command: str, setup: list[str], stats: dict) -> str:
    check = (f"{stats['ok'] - stats['mismatches']}/{stats['ok']} equal plain greedy" if stats["checked"]
             else "not checked (no --config)")
    lines = [
        f"<!-- section:{label} -->",
        f"## {label}",
        "",
        "Regenerate with:",
        "",
        "```sh",
        command,
        "```",
        "",
        *[f"- {item}" for item in setup],
        "",
        "| requests | errors | req/s | completion tok/s | p50 latency | p99 latency | mean / max batch | T=0 check |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {stats['requests']} | {stats['errors']} | {stats['rps']:.2f} | {stats['tokens_per_s']:.1f} | "
        f"{stats['p50'] * 1000:.0f} ms | {stats['p99'] * 1000:.0f} ms | {stats['mean_batch']:.2f} / {stats['max_batch']} | {check} |",
        "",
        "| model | requests | mean tau | p50 latency | mean batch |",
        "|---|---:|---:|---:|---:|",
        *[f"| {m} | {s['requests']} | {s['tau']:.2f} | {s['p50'] * 1000:.0f} ms | {s['batch']:.2f} |"
          for m, s in stats["per_model"].items()],
        "",
    ]
    if stats["error_samples"]:
        lines += ["Errors (first three):", "", *[f"- `{e}`" for e in stats["error_samples"]], ""]
    if stats["mismatch_samples"]:
        lines += ["Greedy mismatches (first three: model, question, served, expected):", "",
                  *[f"- {s}" for s in stats["mismatch_samples"]], ""]
    lines.append(f"<!-- /section:{label} -->")
    return "\n".join(lines)


def _write_section(path: Path, label: str, section: str) -> None:
    header = ("# Serve load test\n\n`benchmarks/serve_load.py`: concurrent OpenAI-style chat clients against the Ray Serve "
              "app on loopback, T=0, every answer compared with the target's plain greedy decoding. Sections are "
              "rewritten by the command shown in each.\n")
    text = path.read_text() if path.is_file() else header
    pattern = re.compile(rf"<!-- section:{re.escape(label)} -->.*?<!-- /section:{re.escape(label)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="study config: starts a service (without --url) and computes expected outputs")
    parser.add_argument("--url", help="a running service (loopback only), e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    parser.add_argument("--max-requests", type=int, default=500, help="stop after this many requests (default 500)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--models", default=None, help="comma-separated (default: plain, the heads, routed, merged)")
    parser.add_argument("--random-heads", action="store_true", help="write random heads to a temporary work dir first")
    parser.add_argument("--dtype", default=None, help="override target.dtype (e.g. float32 for an exact greedy check)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="override serve.max_batch_size")
    parser.add_argument("--replica-cpus", type=float, default=None,
                        help="override serve.replica_num_cpus (also the replica's torch threads)")
    parser.add_argument("--draft-below", type=int, default=None,
                        help="override serve.draft_below (0: always draft, whatever the batch)")
    parser.add_argument("--label", default=None, help="report section name (default: the config's name)")
    parser.add_argument("--out", default=None, help="markdown report to write/update, e.g. reports/serve_load.md")
    args = parser.parse_args(argv)
    if not args.url and not args.config:
        parser.error("give --config (start a service) and/or --url (use a running one)")
    if args.url and (urlparse(args.url).hostname or "") not in LOOPBACK:
        parser.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}); this load test stays on this machine")
    if args.clients < 1 or args.duration <= 0 or args.max_requests < 1 or args.max_tokens < 1:
        parser.error("--clients, --duration, --max-requests and --max-tokens must be positive")

    cfg = _prepare_config(args) if args.config else None
    expected = _expected(cfg, args.max_tokens) if cfg is not None else None
    started = False
    try:
        if args.url:
            url, note = args.url.rstrip("/"), "heads: whatever the running service loaded"
        else:
            url, note = _start_service(cfg, args.random_heads)
            started = True
        health = httpx.get(f"{url}/healthz", timeout=30).json()
        available = health["models"]
        if args.models:
            models = [m.strip() for m in args.models.split(",") if m.strip()]
            unknown = [m for m in models if m not in available]
            if unknown:
                print(f"serve_load: {unknown} not served; available: {available}", file=sys.stderr)
                return 2
        else:
            models = [m for m in ["plain", *health["heads"], "routed", "merged"] if m in available]
        print(f"serve_load: {url} models {models}, {args.clients} clients, {args.duration:.0f}s / {args.max_requests} requests",
              flush=True)
        stats = asyncio.run(_load(url, models, args.clients, args.duration, args.max_requests, args.max_tokens, expected))
    finally:
        if started:
            _stop_service()

    label = args.label or (cfg.name if cfg else "service")
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/serve_load.py", *(argv if argv is not None else sys.argv[1:])])
    setup = [
        f"target `{health['target']}`" + (f" ({cfg.target.dtype})" if cfg else "") + f"; {note}",
        f"models: {', '.join(models)} (round robin); {args.clients} clients; {args.duration:.0f} s or {args.max_requests} "
        f"requests; chat, T=0, max_tokens={args.max_tokens}",
        (f"serve: {cfg.serve.num_replicas} replica(s) × {cfg.serve.replica_num_cpus} CPU, max_batch_size="
         f"{cfg.serve.max_batch_size} (continuous batching), draft_below="
         f"{cfg.serve.draft_below or 'off (always draft)'}" if cfg else "serve: as running"),
        f"machine: {os.cpu_count()} CPU cores, no GPU, load average {os.getloadavg()[0]:.1f} at the end of the run "
        f"(other jobs share the cores); {time.strftime('%Y-%m-%d')}",
    ]
    section = _markdown(label, command, setup, stats)
    print(section)
    if args.out:
        _write_section(Path(args.out), label, section)
        print(f"serve_load: wrote section {label!r} of {args.out}")
    failed = stats["errors"] or stats["mismatches"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
