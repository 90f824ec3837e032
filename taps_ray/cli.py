"""`taps`, the one command line: data, features, train, search, agreement, eval, generate, report, sweep, serve,
bench.

Every command that takes `--config` gets a validated StudyConfig; known user errors (bad config, missing
data, missing model or head, unknown proposer) print one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from taps_ray.config import HEAD_KINDS, ConfigError, load_config, with_overrides
from taps_ray.data.commands import cmd_list, cmd_show
from taps_ray.data.sources import DataUnavailable
from taps_ray.drafting.names import UnknownProposer
from taps_ray.interop.side import VllmUnavailable
from taps_ray.workdir import head_checkpoint

Handler = Callable[[argparse.Namespace], int]


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="study config, e.g. configs/cpu.yaml")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taps", description="TAPS speculative-decoding drafters on Ray")
    parser.add_argument(
        "--data-dir", default=None, help="local data folder (default: $TAPS_DATA_DIR); searched before packages and the Hub"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="list the data sets and where they come from, or show examples")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    data_commands.add_parser("list", help="every data set with its role, source and row count")
    show = data_commands.add_parser("show", help="print the first examples of a data set")
    show.add_argument("name", help="mt_bench, gsm8k, math_500, svamp, sharegpt or mathinstruct")
    show.add_argument("-n", type=int, default=3, help="number of examples (default 3)")

    features = commands.add_parser("features", help="extract and cache the target's features of training mixtures")
    _add_config(features)
    features.add_argument("--mixture", default=None, help="one mixture (default: every mixture a head trains on)")

    train = commands.add_parser("train", help="train (or resume) one draft head on one mixture")
    _add_config(train)
    train.add_argument("--kind", choices=HEAD_KINDS, required=True)
    train.add_argument("--mixture", required=True, help="a mixture name from the config (math, chat, mixed, ...)")

    search = commands.add_parser(
        "search", help="Ray Tune + ASHA over the math/chat ratio (and size) of a mixture; saves the `searched` head")
    _add_config(search)
    search.add_argument("--quick", action="store_true",
                        help="the sweep's shrunken study, at most 4 trials of 2 epochs (own work dir)")

    export = commands.add_parser("export", help="write a trained head in the EAGLE / EAGLE-3 layout vLLM and SGLang load")
    _add_config(export)
    export.add_argument("--kind", choices=HEAD_KINDS, required=True)
    export.add_argument("--mixture", required=True, help="a mixture name from the config (math, chat, mixed, ...)")
    export.add_argument("--out", required=True, help="the checkpoint folder to write (see docs/export.md)")
    export.add_argument("--layout", choices=["eagle", "eagle3"], default=None,
                        help="default: eagle3 for eagle3 heads, eagle for eagle2 and hass heads")
    export.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                        help="whose conventions the folder follows: EAGLE class name, fc bias, EAGLE-3 layer ids "
                        "(docs/export.md; default vllm)")

    agreement = commands.add_parser("agreement", help="measure the held-out agreement of every trained head (cached)")
    _add_config(agreement)

    evaluate = commands.add_parser("eval", help="evaluate proposers × benchmarks × temperatures (resumable)")
    _add_config(evaluate)
    evaluate.add_argument("--kinds", nargs="+", choices=HEAD_KINDS, help="default: train.kinds")
    evaluate.add_argument("--proposers", nargs="+", help="default: eval.proposers")
    evaluate.add_argument("--benchmarks", nargs="+", help="default: every benchmark in eval.benchmarks")
    evaluate.add_argument("--temperatures", nargs="+", type=float, help="default: eval.temperatures")

    gen = commands.add_parser("generate", help="decode one prompt with a proposer; prints tau and the speedup")
    _add_config(gen)
    gen.add_argument("--proposer", default="math", help="plain, a head (math, chat, ...) or a combination")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--kind", choices=HEAD_KINDS, default="eagle2")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: the config's")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    report = commands.add_parser("report", help="regenerate the report (tables, plots, findings) from the results store")
    _add_config(report)
    report.add_argument("--results", default=None,
                        help="results store or a report's results/ copy (e.g. reports/results); default: the "
                             "config's work_dir/results")

    heads = commands.add_parser("heads-report", help="write heads.md from the trained heads' metrics and agreement")
    _add_config(heads)
    heads.add_argument("--output", default=None, help="folder for heads.md (default: the config's reports_dir)")
    heads.add_argument("--render-only", action="store_true",
                       help="only re-render heads.md from the heads.json in that folder")

    sweep = commands.add_parser("sweep", help="the whole study on Ray: data, features, train (Tune), eval, report")
    from taps_ray.study.sweep import add_arguments as _sweep_arguments  # late: torch, Ray Tune, matplotlib

    _sweep_arguments(sweep)

    plan = commands.add_parser("plan", help="GPU, host memory and disk per actor kind, and whether each fits the "
                               "cluster's node types (exit 1 when one does not)")
    from taps_ray.plan import add_arguments as _plan_arguments  # late: plan loads torch and transformers

    _plan_arguments(plan)

    serve_cmd = commands.add_parser("serve", help="OpenAI-compatible HTTP service of the target and heads (Ray Serve)")
    _add_config(serve_cmd)
    serve_cmd.add_argument("--host", default=None, help="listen address (default: serve.host, 127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=None, help="port (default: serve.port, 8000)")
    serve_cmd.add_argument("--head-kind", choices=HEAD_KINDS, default=None, help="default: serve.head_kind")
    bench = commands.add_parser("bench", help="wall-clock speed vs plain decoding, HF greedy, prompt lookup, assisted",
                                argument_default=argparse.SUPPRESS,
                                description="Every option defaults to the full `make bench` run (taps_ray/bench/run.py).")
    _add_config(bench)
    bench.add_argument("--kind", choices=HEAD_KINDS)
    bench.add_argument("--proposers", nargs="+", help="our proposers besides plain")
    bench.add_argument("--per-benchmark", type=int, help="first turns per benchmark, spread through each set")
    bench.add_argument("--benchmarks", nargs="+", choices=("gsm8k", "mt_bench", "math_500", "svamp"))
    bench.add_argument("--per-category", type=int, help="prompts per out-of-domain category")
    bench.add_argument("--categories", nargs="*", help="out-of-domain categories (code translation writing reasoning)")
    bench.add_argument("--max-new-tokens", type=int)
    bench.add_argument("--repetitions", type=int)
    bench.add_argument("--dtype", nargs="+", choices=("fp32", "bf16", "fp16"), dest="dtypes",
                       help="one run and one report section per dtype (default: fp32 bf16)")
    bench.add_argument("--narrow", nargs="*", choices=("fp32", "bf16", "fp16"), dest="narrow_dtypes",
                       help="dtypes that decode only the first benchmark (default: bf16; none: all decode all)")
    bench.add_argument("--trees", nargs="+", metavar="T/D/K",
                       help="also time the first proposer with these trees (total_token/depth/top_k), e.g. 8/3/2")
    bench.add_argument("--slow-peer-prompts", type=int, help="prompts per benchmark / category for HF assisted")
    bench.add_argument("--no-peers", action="store_false", dest="peers", help="skip the HF methods (quick tree tuning)")
    bench.add_argument("--name", help="report name: writes <reports_dir>/<name>.md and <name>_speed.png")
    bench.add_argument("--vllm-venv", help="also time vLLM's CPU build from this side venv (`make vllm-venv`): "
                       "plain, n-gram and our exported head of --vllm-head-kind (docs/export.md)")
    bench.add_argument("--vllm-head-kind", choices=HEAD_KINDS, help="the head vLLM drafts with (default eagle3)")
    bench.add_argument("--vllm-preload", nargs="+", choices=("on", "off"),
                       help="vLLM with tcmalloc + libiomp5 preloaded (on), without (off), or both, the first "
                       "mode's rows unsuffixed (default: off; reports/vllm_preload.md)")
    bench.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")

    interop = commands.add_parser("interop", help="serve our exported heads in vLLM's CPU build and check outputs and "
                                  "acceptance against our engine (docs/export.md)")
    _add_config(interop)
    interop.add_argument("--kinds", nargs="+", choices=HEAD_KINDS, default=["eagle2", "hass", "eagle3"])
    interop.add_argument("--mixture", default="math", help="the mixture the heads were trained on (default math)")
    interop.add_argument("--prompts", type=int, default=6, help="GSM8K first turns (default 6)")
    interop.add_argument("--max-new-tokens", type=int, default=64)
    interop.add_argument("--k", type=int, default=3, help="num_speculative_tokens (our chain: k+1 nodes, depth k)")
    interop.add_argument("--vllm-venv", default=None, help="vLLM's side venv (default $TAPS_VLLM_VENV or .venv-vllm)")
    interop.add_argument("--vllm-preload", action="store_true",
                         help="preload tcmalloc + libiomp5 into vLLM, as its CPU notes suggest (default off)")
    interop.add_argument("--name", default="interop", help="writes <reports_dir>/<name>.md")
    return parser


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", None: None}


def _data(args: argparse.Namespace) -> int:
    if args.data_command == "list":
        return cmd_list(args.data_dir)
    return cmd_show(args.name, args.n, args.data_dir)


def _features(args: argparse.Namespace) -> int:
    from taps_ray.training.commands import cmd_features  # late: torch and transformers (this command only)

    cmd_features(_config(args), args.mixture)
    return 0


def _train(args: argparse.Namespace) -> int:
    from taps_ray.training.commands import cmd_train  # late: torch and transformers (this command only)

    cmd_train(_config(args), args.kind, args.mixture)
    return 0


def _search(args: argparse.Namespace) -> int:
    from taps_ray.study.search import cmd_search  # late: Ray Tune, torch, transformers (this command only)

    return cmd_search(_config(args), args.quick)


def _export(args: argparse.Namespace) -> int:
    from taps_ray.models.draft_head import DraftHead  # late: torch (this command only)
    from taps_ray.models.published import export_head  # late: torch, safetensors (this command only)

    folder = head_checkpoint(_config(args), args.kind, args.mixture)
    if not folder.is_dir():
        raise FileNotFoundError(f"no trained {args.kind} head for mixture {args.mixture!r} at {folder}; train it first")
    out = export_head(DraftHead.load(folder), args.out, args.layout, args.engine)
    print(f"wrote {out} for {args.engine} (serve commands: docs/export.md)")
    return 0


def _agreement(args: argparse.Namespace) -> int:
    from taps_ray.training.commands import cmd_agreement  # late: torch and transformers (this command only)

    cmd_agreement(_config(args))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from taps_ray.eval.commands import cmd_eval, plan_cells  # late: torch, transformers, pandas (this command only)

    config = _config(args)
    cells = plan_cells(config, args.kinds, args.proposers, args.benchmarks, args.temperatures)
    return cmd_eval(config, cells)


def _generate(args: argparse.Namespace) -> int:
    from taps_ray.eval.commands import cmd_generate  # late: torch, transformers, pandas (this command only)

    if args.temperature < 0 or args.max_new_tokens < 1:
        raise ValueError("--temperature must be >= 0 and --max-new-tokens >= 1")
    return cmd_generate(
        _config(args), args.proposer, args.prompt, args.kind, args.temperature, args.max_new_tokens,
        DTYPES[args.dtype], args.json, args.seed,
    )


def _report(args: argparse.Namespace) -> int:
    from taps_ray.report import build_report  # late: matplotlib and pandas (this command only)
    from taps_ray.report.data import results_source  # late: pandas (this command only)

    source = results_source(args.results) if args.results else None
    command = f"taps report --config {args.config}" + (f" --results {args.results}" if args.results else "")
    path = build_report(_config(args), source, command=command)
    print(f"report written to {path}")
    return 0


def _heads_report(args: argparse.Namespace) -> int:
    from taps_ray.report.heads import build_heads_report, rerender_heads_md  # late: matplotlib, torch

    config = _config(args)
    folder = args.output or config.reports_dir
    if args.render_only:
        rerender_heads_md(folder)
    else:
        build_heads_report(config, folder)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from taps_ray.study.sweep import cmd_sweep  # late: Ray Tune, torch, matplotlib (this command only)

    return cmd_sweep(args)


def _plan(args: argparse.Namespace) -> int:
    from taps_ray.plan import cmd_plan  # late: plan loads torch and transformers

    return cmd_plan(args)


def _serve(args: argparse.Namespace) -> int:
    from taps_ray.serve.app import cmd_serve  # late: Ray Serve, torch, transformers (this command only)

    config = _config(args)
    if args.head_kind:
        config = config.model_copy(update={"serve": config.serve.model_copy(update={"head_kind": args.head_kind})})
    cmd_serve(config, args.host, args.port, blocking=True)
    return 0


def bench_options(args: argparse.Namespace):
    """The BenchOptions a `taps bench` command line asks for: only the options given, the rest its defaults."""
    from taps_ray.bench.run import BenchOptions  # late: torch, transformers, matplotlib (this command only)

    given = {k: v for k, v in vars(args).items() if k not in ("command", "config", "data_dir")}
    for key in ("dtypes", "narrow_dtypes"):
        if key in given:
            given[key] = [DTYPES[d] for d in given[key]]
    return BenchOptions(**given)


def _bench(args: argparse.Namespace) -> int:
    from taps_ray.bench.run import cmd_bench  # late: torch, transformers, matplotlib (this command only)

    command = "taps " + " ".join(sys.argv[1:]) if sys.argv[1:] else "taps bench --config configs/cpu.yaml"
    return cmd_bench(_config(args), bench_options(args), command)


def _interop(args: argparse.Namespace) -> int:
    from taps_ray.bench.prompts import first_turns  # late: the bench's datasets loaders
    from taps_ray.interop.check import InteropOptions, cmd_interop  # late: torch, transformers
    from taps_ray.interop.side import side_vllm  # late: only this command runs vLLM

    options = InteropOptions(kinds=args.kinds, mixture=args.mixture, prompts=args.prompts,
                             max_new_tokens=args.max_new_tokens, k=args.k, name=args.name)
    config = _config(args)
    turns = [text for _, text in first_turns([options.benchmark], options.prompts, [], 0, config.resolved_data_dir())]
    command = "taps " + " ".join(sys.argv[1:]) if sys.argv[1:] else "taps interop --config configs/interop.yaml"
    # eager: the check compares outputs and acceptance, and each of its vLLM processes then starts in a minute
    side = side_vllm(args.vllm_venv, preload=args.vllm_preload, enforce_eager=True)
    return cmd_interop(config, options, side, command, turns)


HANDLERS: dict[str, Handler] = {
    "data": _data,
    "features": _features,
    "train": _train,
    "search": _search,
    "export": _export,
    "agreement": _agreement,
    "eval": _eval,
    "generate": _generate,
    "serve": _serve,
    "sweep": _sweep,
    "plan": _plan,
    "report": _report,
    "heads-report": _heads_report,
    "bench": _bench,
    "interop": _interop,
}


def _config(args: argparse.Namespace):
    return with_overrides(load_config(args.config), data_dir=args.data_dir)


def _user_errors() -> tuple[type[BaseException], ...]:
    from taps_ray.models.target import ModelUnavailable  # late: torch, transformers (`taps --help` goes without)

    return (ConfigError, DataUnavailable, ModelUnavailable, UnknownProposer, VllmUnavailable, FileNotFoundError,
            ValueError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except _user_errors() as error:
        print(f"taps {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
