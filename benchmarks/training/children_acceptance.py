#!/usr/bin/env python
"""What our T > 0 tree rule costs at depth 1: deterministic top-k children against one child sampled from the
draft with the q-ratio test, measured on one trained head. Not a test.

    python benchmarks/training/children_acceptance.py --config configs/data_size.yaml --head math,chat \
        --benchmark gsm8k,mt_bench --questions 20 --out reports/children_acceptance.md

Teacher-forced along the target's own greedy continuation (no decoding loop): per question the target
greedy-decodes the evaluation's prompt (first turn, `max_new_tokens`), one target forward over prompt +
continuation gives the features the engine hands a proposer, and one causal head forward over them
(decoding/replay_draft.py `teacher_forced`, as replay drafts) gives the head's depth-1 draft distribution q at
every root position a live loop drafts from. At each of those positions, with p the target's processed
distribution for the next token at `--temperature` (`processed_probs`), taps_ray/eval/children.py computes
A_det(k) = Σ_{c in top-k(q)} p(c), the chance our deterministic children (top-k of the head, q treated as 1,
`PointMass`) accept the node, for k = 1 and k = tree.top_k (an EAGLE-2 tree's root children are at most the
head's top_k there), A_tree, the same mass on the root children the config's tree keeps (drafted as replay
drafts, `draft_along`: the selection of total_token - 1 nodes can drop weak ones), and A_sampled =
Σ_x min(p(x), q(x)), the chance one child x ~ q passes the ratio test min(1, p(x)/q(x)) (SpecInfer / EAGLE's
reference sampling). Also A_det at T = 0 (the target's argmax among the
top k), for reference. Means pool every position of every question; intervals are 95% bootstrap over questions.
Depth 1 only: deeper nodes condition on the path accepted above them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.bench.prompts import first_turns  # noqa: E402
from taps_ray.config import StudyConfig, load_config  # noqa: E402
from taps_ray.data.chat import build_prompt_ids  # noqa: E402
from taps_ray.decoding.replay import GreedyTrace, record_traces  # noqa: E402
from taps_ray.decoding.replay_draft import draft_along, teacher_forced  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.decoding.verify import SamplingParams, processed_probs  # noqa: E402
from taps_ray.drafting.proposers import SingleHead  # noqa: E402
from taps_ray.drafting.setup import load_proposers  # noqa: E402
from taps_ray.eval.children import children_acceptance  # noqa: E402
from taps_ray.fsio import atomic_write_json, atomic_write_text  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.target import Target, dtype_name, load_target  # noqa: E402
from taps_ray.models.target_forward import target_forward  # noqa: E402
from taps_ray.relpaths import shown_path  # noqa: E402
from taps_ray.report.uncertainty import pooled_mean  # noqa: E402
from taps_ray.workdir import head_checkpoint  # noqa: E402

# per-position measures: (key, column heading); "det_k" uses tree.top_k
MEASURES = [
    ("det_1", "A_det(1)"), ("det_k", "A_det(k)"), ("tree", "A_tree"), ("sampled", "A_sampled"),
    ("cost_1", "A_sampled − A_det(1)"), ("cost_k", "A_sampled − A_det(k)"),
    ("greedy_1", "T=0: A_det(1)"), ("greedy_k", "T=0: A_det(k)"),
]


def traces(cfg: StudyConfig, target: Target, benchmark: str, questions: int, max_new_tokens: int) -> list[GreedyTrace]:
    """The benchmark's first turns as `taps bench` picks them, prompted as the evaluation prompts them, each with
    its greedy continuation and the target's proposer features (no feature layers: an EAGLE-2 / HASS head's)."""
    turns = first_turns([benchmark], questions, [], 0, cfg.resolved_data_dir())
    prompts = [build_prompt_ids(target.tokenizer, [text], [], cfg.eval.system_prompt) for _, text in turns]
    return record_traces(lambda: TargetBatch(target.model), prompts, max_new_tokens, target.stop_token_ids, 0)


@torch.no_grad()
def per_position(target: Target, drafter: SingleHead, trace: GreedyTrace, k: int,
                 temperature: float) -> dict[str, torch.Tensor]:
    """Every measure at each root position c the live loop drafts from (prompt length .. end - 2): the target's
    distribution for token c + 1 against the head's depth-1 distribution drafted from output c - 1."""
    start, stop = len(trace.prompt), len(trace.sequence) - 1
    context, _ = teacher_forced(drafter.head, drafter.context, [trace.sequence], [trace.features], [stop])
    draft = drafter.context.log_probs(context[0, start - 1 : stop - 1]).exp()  # [n, draft vocabulary]
    logits = target_forward(target.model).logits(trace.features[start:stop].to(target.dtype))  # [n, V]
    ids = drafter.context.token_ids(torch.arange(draft.shape[-1], device=draft.device))
    q = torch.zeros(logits.shape, dtype=torch.float32, device=draft.device).index_copy_(1, ids, draft)
    p = processed_probs(logits, SamplingParams(temperature=temperature)).to(q.device)
    argmax = processed_probs(logits, SamplingParams()).to(q.device)
    det_1, sampled = children_acceptance(p, q, 1)
    det_k, _ = children_acceptance(p, q, k)
    return {"det_1": det_1, "det_k": det_k, "tree": tree_children(drafter, trace, p), "sampled": sampled,
            "cost_1": sampled - det_1, "cost_k": sampled - det_k,
            "greedy_1": children_acceptance(argmax, q, 1)[0], "greedy_k": children_acceptance(argmax, q, k)[0]}


def tree_children(drafter: SingleHead, trace: GreedyTrace, p: torch.Tensor) -> torch.Tensor:
    """The target's mass on the root children the EAGLE-2 tree keeps at each root position (its selection and
    `min_confidence` can drop weak ones of the top k), drafted as replay drafts them."""
    start, stop = len(trace.prompt), len(trace.sequence) - 1
    (trees,) = draft_along(drafter.head, drafter.context, drafter.tree, [trace.sequence], [trace.features],
                           [range(start, stop)])
    kept = trees.parents == 0
    if trees.sizes is not None:
        sizes = torch.tensor(trees.sizes, device=kept.device)
        kept &= torch.arange(kept.shape[1], device=kept.device) < sizes[:, None]
    return (p.gather(1, trees.tokens.to(p.device)) * kept.to(p.device)).sum(-1)


def summary(rows: list[dict[str, torch.Tensor]]) -> dict:
    """Pooled means over all positions with their intervals over questions, per measure."""
    counts = [int(r["det_1"].numel()) for r in rows]
    out: dict = {"questions": len(rows), "positions": sum(counts)}
    for key, _ in MEASURES:
        interval = pooled_mean([float(r[key].sum()) for r in rows], counts)
        out[key] = None if interval is None else {"mean": interval.delta, "low": interval.low, "high": interval.high}
    return out


def shown_interval(value: dict | None) -> str:
    return "–" if value is None else f"{value['mean']:.3f} [{value['low']:.3f}, {value['high']:.3f}]"


def report(results: list[dict], meta: dict) -> str:
    k = meta["top_k"]
    head = [name.replace("(k)", f"({k})") for _, name in MEASURES]
    lines = [
        "# Deterministic top-k children against sampled children at T > 0 (depth 1)",
        "",
        f"Generated by `{meta['command']}` on {meta['machine']}: {meta['target']} in {meta['dtype']}, "
        f"{meta['kind']} heads of `{meta['config']}` (`{meta['work_dir']}`), T = {meta['temperature']}, "
        f"tree top_k {k}, max_new_tokens {meta['max_new_tokens']}, first turns of {meta['questions']} questions "
        "per benchmark (spread through each set), teacher-forced along the target's greedy continuation.",
        "",
        "Per drafted root position: mean over all positions of all questions, 95% bootstrap interval over "
        "questions in brackets.",
        "",
        f"| head | benchmark | questions | positions | {' | '.join(head)} |",
        "|---|---|---:|---:|" + "---:|" * len(head),
        *(f"| {r['head']} | {r['benchmark']} | {r['questions']} | {r['positions']} | "
          + " | ".join(shown_interval(r[key]) for key, _ in MEASURES) + " |" for r in results),
        "",
        f"What the numbers mean. At T > 0 our trees take a node's children deterministically, the head's top {k} "
        "tokens with the draft probability treated as 1 (`PointMass`, docs/algorithms.md#sampling-and-losslessness): "
        f"the target samples its token from p and some child is accepted with probability A_det({k}) = "
        f"Σ_(c in top-{k}) p(c). SpecInfer / EAGLE's reference sampling draws one child x ~ q and keeps it with "
        "probability min(1, p(x)/q(x)), which accepts with probability A_sampled = Σ_x min(p(x), q(x)). So at "
        f"a node the cost of our choice is A_sampled − A_det(k) when positive (and its gain when negative); "
        "A_det(1) is one deterministic child against one sampled child. The T = 0 columns are the share of "
        "positions where the target's argmax is among the head's top 1 / top k (the greedy acceptance of those "
        "children). A_tree is the target's mass on the root children the config's tree keeps (its selection of "
        f"total_token − 1 nodes can drop a weak one of the top {k}, so A_tree ≤ A_det({k})): the root-level "
        "acceptance of the trees we verify. Depth 1 only: deeper nodes condition on the path accepted above them.",
    ]
    return "\n".join(lines) + "\n"


def shown_command(argv: list[str], data_dir: Path | None) -> str:
    """The command line with machine paths shown as relpaths prints them."""
    words = [shown_path(w, data_dir) if Path(w).is_absolute() else w for w in argv]
    return "python benchmarks/training/children_acceptance.py " + shlex.join(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/data_size.yaml",
                        help="a study config (its work dir holds the heads)")
    parser.add_argument("--kind", default="eagle2",
                        help="head kind (eagle2 or hass: heads that draft from the last hidden state)")
    parser.add_argument("--head", default="math", help="mixture name(s) of the head(s), comma-separated")
    parser.add_argument("--benchmark", default="gsm8k", help="benchmark(s), comma-separated")
    parser.add_argument("--questions", type=int, default=20, help="questions per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default="reports/children_acceptance.md", help="markdown; the JSON goes beside it")
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be > 0 (the T = 0 columns come with every run)")

    cfg = load_config(args.config)
    heads, benchmarks = args.head.split(","), args.benchmark.split(",")
    target = load_target(cfg.target, dtype=cfg.eval.dtype)
    drafters = load_proposers(cfg, heads, target=target, kind=args.kind)
    for name, drafter in drafters.items():
        if not isinstance(drafter, SingleHead) or drafter.feature_layers:
            parser.error(f"{name!r} is not one {args.kind} head drafting from the last hidden state")
    results = []
    for benchmark in benchmarks:
        recorded = traces(cfg, target, benchmark, args.questions, args.max_new_tokens)
        for name in heads:
            rows = [per_position(target, drafters[name], t, cfg.tree.top_k, args.temperature) for t in recorded]
            checkpoint = shown_path(head_checkpoint(cfg, args.kind, name), cfg.resolved_data_dir())
            results.append({"head": name, "checkpoint": checkpoint, "benchmark": benchmark, **summary(rows)})
            print(f"{name} on {benchmark}: {results[-1]}", flush=True)
    meta = {
        "command": shown_command(sys.argv[1:], cfg.resolved_data_dir()), "machine": cpu_line(),
        "target": target.name, "dtype": dtype_name(target.dtype), "kind": args.kind,
        "config": cfg.name, "work_dir": shown_path(cfg.work_dir, cfg.resolved_data_dir()),
        "temperature": args.temperature, "top_k": cfg.tree.top_k, "max_new_tokens": args.max_new_tokens,
        "questions": args.questions, "torch_threads": torch.get_num_threads(),
    }
    out = Path(args.out)
    atomic_write_text(out, report(results, meta))
    atomic_write_json(out.with_suffix(".json"), {**meta, "results": results})
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
