"""Online adaptation on a live stream: a replica with only the math head serves chat, adapts, then math returns.

The replica is Serve's own decode loop (serve/scheduler.py `DecodeLoop` over the continuous batcher, exactly as a
`TapsService` replica runs it, without the HTTP layer) with `serve.adapt` on for the `math` model: it records a
sampled share of its requests and swaps head versions between steps. The trainer is the Ray actor
(`adapt.trainer_actor.OnlineTrainerActor`) on its own CPU of a loopback Ray cluster. The replica decodes on one
torch thread (serve.replica_num_cpus 1), the trainer trains on the other core.

    1. baselines (nothing recorded, no trainer): the static math head (version 0) and the offline chat head
       (trained on 1,000 ShareGPT conversations) on every --baseline-every-th prompt of both streams;
    2. the chat stream: --chat MT-Bench prompts (each question's turns as single-turn prompts: no head trained on
       MT-Bench) and --sharegpt ShareGPT prompts from conversations no head trained on, shuffled together, sent by
       --concurrency closed-loop clients to model `math`;
    3. the shift back: --math GSM8K test questions to the same model;
    4. the trainer's cost to serving: the same prompts decoded by the static math head in alternating blocks with
       the trainer paused and training back to back at its --trainer-duty (a worst case: while traffic flows it
       trains only when --min-new-tokens new positions were recorded);
    5. the greedy check: every stream request's output against plain greedy decoding (fp32: token for token).

    python benchmarks/serving/online_adapt.py --config configs/data_size.yaml --work-dir runs/data-size \
        --out reports/online.md

The head folders are read from --work-dir; buffers and versions go to a temporary folder (--adapt-dir to keep
them). The last line printed (and the report's) is
`online: chat_tau start=A end=B offline_chat=C requests=N failed=F throughput_cost=P%`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("OMP_WAIT_POLICY", "PASSIVE")):
    os.environ.setdefault(_name, _value)

import ray  # noqa: E402
import torch  # noqa: E402

from taps_ray.adapt.replica import ReplicaAdaptation  # noqa: E402
from taps_ray.adapt.trainer_actor import model_store, start_trainer  # noqa: E402
from taps_ray.config import StudyConfig, load_config, with_overrides  # noqa: E402
from taps_ray.data.chat import render_ids  # noqa: E402
from taps_ray.data.mixtures import build_mixture  # noqa: E402
from taps_ray.data.sources import load_conversations, load_questions  # noqa: E402
from taps_ray.decoding.continuous import ContinuousBatcher, Request, Result  # noqa: E402
from taps_ray.decoding.step import tau  # noqa: E402
from taps_ray.decoding.verify import SamplingParams  # noqa: E402
from taps_ray.drafting.proposer import Proposer  # noqa: E402
from taps_ray.drafting.setup import load_heads, load_proposers  # noqa: E402
from taps_ray.fsio import report_lines  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.target import Target, load_target  # noqa: E402
from taps_ray.relpaths import shown_path  # noqa: E402
from taps_ray.ray_runtime import loopback_cluster  # noqa: E402
from taps_ray.serve.scheduler import DecodeLoop  # noqa: E402

GREEDY = SamplingParams()
MODEL = "math"


@dataclass
class Served:
    """One request of the streams, as the replica answered it."""

    index: int
    phase: str
    prompt: list[int]
    version: int
    result: Result
    finished: float


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/data_size.yaml")
    p.add_argument("--work-dir", default=None, help="where the trained heads are (default: the config's work_dir)")
    p.add_argument("--adapt-dir", default=None, help="buffers and versions (default: a temporary folder)")
    p.add_argument("--chat", type=int, default=100, help="chat requests from MT-Bench (its turns, at most 160)")
    p.add_argument("--sharegpt", type=int, default=0, help="chat requests from ShareGPT conversations no head of the "
                   "config trained on (their first user turn), shuffled in with the MT-Bench turns")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="ShareGPT prompts longer than this are skipped")
    p.add_argument("--math", type=int, default=40, help="math requests after the chat stream (GSM8K test)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (= serve.max_batch_size)")
    p.add_argument("--window", type=int, default=20, help="requests per row of the tau-over-time table")
    p.add_argument("--baseline-every", type=int, default=2, help="static baselines on every n-th stream prompt")
    p.add_argument("--sample", type=float, default=1.0, help="serve.adapt.sample: share of requests recorded")
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--precision", default="fp32", help="serve.adapt.precision (this CPU has no AMX: fp32 is faster)")
    p.add_argument("--steps-per-round", type=int, default=40)
    p.add_argument("--trainer-duty", type=float, default=1.0, help="serve.adapt.trainer_duty: the most share of time "
                   "the trainer trains (it rests after each optimizer step)")
    p.add_argument("--min-new-tokens", type=int, default=768)
    p.add_argument("--cost-prompts", type=int, default=8, help="prompts per block of the throughput-cost A/B")
    p.add_argument("--cost-blocks", type=int, default=2, help="paused/training block pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the markdown report here (e.g. reports/online.md)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def adapt_config(args: argparse.Namespace, adapt_dir: Path) -> StudyConfig:
    cfg = with_overrides(load_config(args.config), work_dir=args.work_dir)
    cfg = cfg.model_copy(update={"work_dir": str(Path(cfg.work_dir).resolve())})
    adapt = cfg.serve.adapt.model_copy(update={
        "enabled": True, "models": [MODEL], "sample": args.sample, "max_recorded_per_minute": 1000, "poll_s": 1.0,
        "lr": args.lr, "precision": args.precision, "steps_per_round": args.steps_per_round, "min_new_tokens": args.min_new_tokens,
        "trainer_duty": args.trainer_duty,
        "trainer_num_cpus": 1.0, "dir": str(adapt_dir.resolve()),
    })
    serve = cfg.serve.model_copy(update={"adapt": adapt, "max_batch_size": args.concurrency, "replica_num_cpus": 1.0,
                                         "cost_model": False})  # raw proposers: tau is the head's alone
    return cfg.model_copy(update={"serve": serve})


def unseen_sharegpt(cfg: StudyConfig, count: int, max_tokens: int, render: Callable[[str], list[int]],
                    seed: int) -> list[list[int]]:
    """`count` ShareGPT first user turns (at most `max_tokens` rendered) from conversations that no mixture of `cfg`
    holds, so that neither the offline chat head nor the math head was trained on them; seeded order."""
    trained = [c for m in cfg.mixtures.values() if "sharegpt" in m.mixture for c in build_mixture(m)]
    trained_ids = {c.id for c in trained}
    seen_texts = {c.messages[0]["content"] for c in trained}  # ShareGPT repeats prompts under other ids
    unseen = [c for c in load_conversations("sharegpt") if c.id not in trained_ids]
    random.Random(seed).shuffle(unseen)
    prompts = []
    for conversation in unseen:
        text = conversation.messages[0]["content"]
        if text in seen_texts:
            continue
        seen_texts.add(text)
        ids = render(text)
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"--sharegpt {count}: only {len(prompts)} unseen ShareGPT prompts of at most {max_tokens} tokens")


def stream_prompts(cfg: StudyConfig, target: Target,
                   args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(chat, math) prompts rendered with the chat template: MT-Bench turns and unseen ShareGPT prompts shuffled
    together (the chat traffic is the same mix from start to end), GSM8K test in order."""
    turns = [turn for q in load_questions("mt_bench") for turn in q.turns]
    if args.chat > len(turns):
        raise SystemExit(f"--chat {args.chat}: MT-Bench has {len(turns)} turns")
    random.Random(args.seed).shuffle(turns)
    math = [q.turns[0] for q in load_questions("gsm8k")]

    def render(text: str) -> list[int]:
        return render_ids(target.tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)

    chat = [render(t) for t in turns[: args.chat]]
    if args.sharegpt:
        chat += unseen_sharegpt(cfg, args.sharegpt, args.max_prompt_tokens, render, args.seed)
        random.Random(args.seed).shuffle(chat)
    return chat, [render(t) for t in math[: args.math]]


def decode(target: Target, proposer: Proposer, prompts: list[list[int]], max_tokens: int,
           batch: int) -> tuple[list[Result], float]:
    """Decode `prompts` in one continuous batch of `batch` rows (no recording); returns the results and seconds."""
    batcher = ContinuousBatcher(target.model, target.stop_token_ids, batch)
    results: dict[int, Result] = {}
    for i, prompt in enumerate(prompts):
        batcher.submit(Request(prompt=prompt, proposer=proposer, params=GREEDY, max_tokens=max_tokens, seed=0),
                       on_done=lambda r, i=i: results.__setitem__(i, r))
    start = time.perf_counter()
    while batcher.busy:
        batcher.step()
    return [results[i] for i in range(len(prompts))], time.perf_counter() - start


async def serve_stream(loop: DecodeLoop, adapt: ReplicaAdaptation, proposers: dict[str, Proposer],
                       phases: list[tuple[str, list[list[int]]]], args: argparse.Namespace) -> list[Served]:
    """Closed-loop clients over the phases in order: each client sends its next prompt when its last is answered."""
    served: list[Served] = []
    work = [(phase, prompt) for phase, prompts in phases for prompt in prompts]
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < len(work):
            index, (phase, prompt) = next_index, work[next_index]
            next_index += 1
            request = Request(prompt=prompt, proposer=proposers[MODEL], params=GREEDY, max_tokens=args.max_tokens,
                              seed=0)
            version = adapt.models[MODEL].version_of(request.proposer)
            result = await loop.submit(request, MODEL).wait()
            served.append(Served(index, phase, prompt, version, result, time.time()))
            if len(served) % 10 == 0:
                print(f"  {len(served)}/{len(work)} requests, version {adapt.models[MODEL].version}", flush=True)

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return sorted(served, key=lambda s: s.index)


def pooled(results: list[Result]) -> float:
    return tau([s for r in results for s in r.generation.steps])


def tokens_per_s(results: list[Result], seconds: float) -> float:
    return sum(len(r.generation.tokens) for r in results) / seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the replica's one CPU; the trainer actor has the other
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="taps-online-") as tmp:
        adapt_dir = Path(args.adapt_dir) if args.adapt_dir else Path(tmp)
        cfg = adapt_config(args, adapt_dir)
        target = load_target(cfg.target)
        heads = load_heads(cfg, "eagle2", target.dtype, ["math", "chat"], target.device)
        static = load_proposers(cfg, ["math", "chat"], target=target, heads=heads)
        plain = load_proposers(cfg, ["plain"], target=target)["plain"]
        chat_prompts, math_prompts = stream_prompts(cfg, target, args)

        print("baselines: the static math head and the offline chat head", flush=True)
        every = args.baseline_every
        sampled = {"chat": list(range(0, len(chat_prompts), every)), "math": list(range(0, len(math_prompts), every))}
        prompts_of = {"chat": chat_prompts, "math": math_prompts}
        baseline: dict[tuple[str, str], dict[int, Result]] = {}
        for head in ("math", "chat"):
            for phase in ("chat", "math"):
                picked = [prompts_of[phase][i] for i in sampled[phase]]
                results, _ = decode(target, static[head], picked, args.max_tokens, args.concurrency)
                baseline[head, phase] = dict(zip(sampled[phase], results))

        cluster = loopback_cluster(num_cpus=2)
        try:
            proposers: dict[str, Proposer] = {}

            def build(model: str, head) -> Proposer:
                return load_proposers(cfg, [model], target=target, heads={model: head.to(target.device)})[model]

            adapt = ReplicaAdaptation(cfg, [MODEL], build, proposers.__setitem__)
            trainer = start_trainer(cfg, MODEL)
            ray.get(trainer.rounds.remote())  # fails here, not after the stream, when the actor cannot start
            batcher = ContinuousBatcher(target.model, target.stop_token_ids, args.concurrency)
            loop = DecodeLoop(batcher, 4 * args.concurrency, 600.0, adapt=adapt)
            print(f"stream: {len(chat_prompts)} chat then {len(math_prompts)} math requests", flush=True)
            stream_start = time.time()
            served = asyncio.run(serve_stream(loop, adapt, proposers, [("chat", chat_prompts), ("math", math_prompts)],
                                              args))
            stream_end = time.time()
            adapt.flush()
            print("throughput cost: static math head, trainer paused vs training", flush=True)
            ray.get(trainer.pause.remote())
            cost_prompts = (chat_prompts * 2)[: args.cost_prompts]
            paused_s = training_s = 0.0
            paused_tok = training_tok = 0
            for _ in range(args.cost_blocks):
                results, seconds = decode(target, static["math"], cost_prompts, args.max_tokens, args.concurrency)
                paused_s, paused_tok = paused_s + seconds, paused_tok + sum(len(r.generation.tokens) for r in results)
                busy = trainer.train_for.remote(1.5 * seconds)  # outlasts the block: rounds end at their own pace
                time.sleep(0.5)  # the first round has started
                results, seconds = decode(target, static["math"], cost_prompts, args.max_tokens, args.concurrency)
                training_s = training_s + seconds
                training_tok = training_tok + sum(len(r.generation.tokens) for r in results)
                ray.get(busy)
            rounds = ray.get(trainer.rounds.remote())
            ray.get(trainer.stop.remote())
        finally:
            ray.shutdown()
            cluster.shutdown()

        print("greedy check: plain decoding of every stream prompt", flush=True)
        greedy, _ = decode(target, plain, [s.prompt for s in served], args.max_tokens, 8)
        versions = sorted({p.name for p in (adapt_dir / f"eagle2-{MODEL}" / "versions").glob("v*")})
        rejected = model_store(cfg, "eagle2", MODEL).rejected()

    paused_rate, training_rate = paused_tok / paused_s, training_tok / training_s
    cost = 100.0 * (1.0 - training_rate / paused_rate)
    for r in rounds:
        r["during"] = "stream" if r["started"] < stream_end else "cost A/B"
    in_stream = [r for r in rounds if r["during"] == "stream"]
    busy_s = sum(min(r["ended"], stream_end) - r["started"] for r in in_stream)
    duty = busy_s / (stream_end - stream_start)
    failed = sum(s.result.error is not None for s in served)
    mismatched = [s.index for s, g in zip(served, greedy) if s.result.generation.tokens != g.generation.tokens]
    lines = report(args, served, baseline, rounds, versions, rejected, paused_rate, training_rate, cost, duty, failed,
                   mismatched, time.perf_counter() - wall)
    report_lines(lines, args.out)
    return 1 if failed or mismatched else 0


def report(args, served: list[Served], baseline, rounds, versions, rejected, paused_rate: float, training_rate: float,
           cost: float, duty: float, failed: int, mismatched: list[int], wall_s: float) -> list[str]:
    chat = [s for s in served if s.phase == "chat"]
    w = args.window
    windows = [served[i: i + w] for i in range(0, len(served), w)]
    first_chat, last_chat = chat[:w], chat[-w:]
    offline_chat = pooled(list(baseline["chat", "chat"].values()))
    command = "python benchmarks/serving/online_adapt.py " + " ".join(shlex.quote(a) for a in command_args(args))
    line = (f"online: chat_tau start={pooled([s.result for s in first_chat]):.2f} "
            f"end={pooled([s.result for s in last_chat]):.2f} offline_chat={offline_chat:.2f} "
            f"requests={len(served)} failed={failed} throughput_cost={cost:.1f}%")
    pacing = (f" at serve.adapt.trainer_duty {args.trainer_duty:g} (it rests {1 / args.trainer_duty - 1:.2f}x each "
              "optimizer step's time after it)" if args.trainer_duty < 1 else "")
    lines = [
        "# Online adaptation: the math head follows chat traffic, then math returns",
        "",
        f"Regenerate: `{command}` ({wall_s / 60:.0f} min on this machine).",
        f"{cpu_line()}. Target SmolLM2-135M-Instruct in fp32, EAGLE-2 heads of `configs/data_size.yaml`, "
        f"T = 0, {args.max_tokens} new tokens per request, {args.concurrency} closed-loop clients (the replica's "
        "batch), the replica on one torch thread, the trainer actor on the other core.",
        "",
        "The replica is Serve's decode loop (`DecodeLoop` over the continuous batcher, as a `TapsService` replica "
        "runs it, without HTTP) with `serve.adapt` on for model `math`; it starts with only the math head "
        f"(version 0). It records {args.sample:.0%} of its requests; the trainer (a Ray actor) trains "
        f"{args.steps_per_round} steps (lr {args.lr:g}) per {args.min_new_tokens} new recorded positions and "
        "publishes a version only when its top-1 agreement on the newest quarter of the buffer beats the served "
        "version's; the replica looks for one every second, between decode steps.",
        "",
        f"Stream: {len(chat)} chat prompts ({args.chat} MT-Bench turns as single-turn prompts"
        + (f" and {args.sharegpt} first user turns of ShareGPT conversations that no head of the config trained on "
           f"(at most {args.max_prompt_tokens} tokens), shuffled together" if args.sharegpt else ", shuffled")
        + f"; no head trained on MT-Bench), then {len(served) - len(chat)} GSM8K test questions. Why so few: on this 2-core CPU the fp32 "
        f"target with the math head decodes {paused_rate:.1f} tokens/s in a batch of {args.concurrency} (measured below): a {args.max_tokens}-token request takes about "
        f"{args.max_tokens / paused_rate * args.concurrency:.0f} s with {args.concurrency} decoding side by side; the "
        f"stream, the static baselines, the cost A/B and the greedy check of every request took {wall_s / 60:.0f} min "
        "at this size.",
        "",
        "## tau over time",
        "",
        f"Pooled tau (tokens per verification step) per window of {w} requests, in arrival order. The static "
        f"columns decode one prompt in {args.baseline_every} of the same window with the fixed heads (nothing "
        "recorded, no trainer running): prompts differ in how predictable they are, so compare a row's columns, not "
        "rows.",
        "",
        "| requests | traffic | versions serving | online (adapting math head) | static math head | offline chat head |",
        "|---|---|---|---:|---:|---:|",
    ]
    last_chat = None
    for window in windows:
        phase = window[0].phase if len({s.phase for s in window}) == 1 else "chat→math"
        vs = sorted({s.version for s in window})
        static = {head: [baseline[head, s.phase][i] for s in window
                         for i in [position(served, s)] if i in baseline[head, s.phase]] for head in ("math", "chat")}
        if phase == "chat":
            last_chat = (pooled([s.result for s in window]), pooled(static["math"]), pooled(static["chat"]))
        lines.append(f"| {window[0].index + 1}-{window[-1].index + 1} | {phase} | {', '.join(map(str, vs))} | "
                     f"{pooled([s.result for s in window]):.2f} | {pooled(static['math']):.2f} | "
                     f"{pooled(static['chat']):.2f} |")
    per_phase = []
    for phase in ("chat", "math"):
        mine = [s for s in served if s.phase == phase]
        per_phase.append(f"| {phase} | {len(mine)} | {pooled([s.result for s in mine]):.2f} | "
                         f"{pooled(list(baseline['math', phase].values())):.2f} | "
                         f"{pooled(list(baseline['chat', phase].values())):.2f} |")
    if last_chat is not None:
        lines += ["", f"Last chat window: the adapted math head {last_chat[0]:.2f}, the static math head "
                      f"{last_chat[1]:.2f}, the offline chat head {last_chat[2]:.2f}."]
    lines += [
        "",
        "| traffic | requests | online | static math (sampled prompts) | offline chat (sampled prompts) |",
        "|---|---:|---:|---:|---:|",
        *per_phase,
        "",
        "## The trainer",
        "",
        f"Rounds: {len(rounds)}; versions published: {len(versions)} ({', '.join(versions) or 'none'}); rolled back "
        f"by the replica on live tau: {', '.join(f'v{v}' for v in rejected) or 'none'} (serve.adapt.rollback_requests "
        f"and rollback_margin at their defaults).",
        "",
        "| round | during | served version | held-out sequences | agreement served | agreement candidate | published "
        "| s |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
        *(f"| {i + 1} | {r['during']} | {r['served']} | {r['heldout_sequences']} | {r['served_acc']:.3f} | "
          f"{r['candidate_acc']:.3f} | {'v%d' % r['published'] if r['published'] else 'no'} | {r['seconds']:.0f} |"
          for i, r in enumerate(rounds)),
        "",
        "Rounds during the cost A/B train back to back on what the stream recorded (forced, whatever arrived).",
        "",
        "## Cost to serving and exactness",
        "",
        f"Serving throughput, static math head, the same {args.cost_prompts} prompts in {args.cost_blocks} "
        f"alternating block pairs: {paused_rate:.1f} tokens/s with the trainer paused, {training_rate:.1f} tokens/s "
        f"with it training back to back{pacing}: a cost of {cost:.1f}% (a worst case). During the stream the trainer was "
        f"training {duty:.0%} of the time.",
        "",
        f"Requests: {len(served)}, failed: {failed}. fp32 outputs equal to plain greedy decoding: "
        f"{len(served) - len(mismatched)}/{len(served)}" + (f" (differ: {mismatched})" if mismatched else "") + ".",
        "",
        line,
    ]
    return lines


def command_args(args: argparse.Namespace) -> list[str]:
    """The flags that shape the results (not where scratch files went), `--out` as a repository path."""
    out = []
    for action in parser()._actions:
        if action.dest in ("help", "adapt_dir"):
            continue
        value = getattr(args, action.dest)
        if action.dest in ("out", "work_dir") and value:
            value = shown_path(value)
        if value is not None:
            out += [action.option_strings[0], str(value)]
    return out


def position(served: list[Served], s: Served) -> int:
    """The request's index within its phase (the baselines are keyed by it)."""
    return sum(1 for other in served if other.phase == s.phase and other.index < s.index)


if __name__ == "__main__":
    sys.exit(main())
