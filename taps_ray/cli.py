"""`taps`, the one command line: data, features, train, search, agreement, eval, generate, report, sweep, serve,
bench.

Every command that takes `--config` gets a validated StudyConfig; known user errors (bad config, missing
data, missing model or head, unknown proposer) print one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from taps_ray.config import HEAD_KINDS, ConfigError, load_config, with_overrides
from taps_ray.data.commands import cmd_list, cmd_show
from taps_ray.data.sources import DataUnavailable
from taps_ray.drafting.names import UnknownProposer
from taps_ray.fsio import OutputRefused, check_new_output
from taps_ray.interop.side import VllmUnavailable
from taps_ray.spelling import did_you_mean
from taps_ray.workdir import head_checkpoint

Handler = Callable[[argparse.Namespace], int]
DATA_DIR_HELP = "local data folder (default: $TAPS_DATA_DIR); searched before packages and the Hub"


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (unless its help already says it, or there is none to say), and the
    example epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        silent = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if silent or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem, then where the usage is (exit 2, as argparse)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _command(commands: argparse._SubParsersAction, name: str, text: str, example: str, **kwargs) -> _Parser:
    """A subcommand with its defaults and one example in its help; `--data-dir` also works after it."""
    parser = commands.add_parser(name, help=text, description=kwargs.pop("description", text),
                                 epilog=f"example:\n  {example}", formatter_class=_Help, **kwargs)
    parser.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    return parser


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="study config, e.g. configs/cpu.yaml")


def _alias(parser: argparse.ArgumentParser, old: str, action: argparse.Action) -> None:
    """`old`, a former spelling of `action`'s flag, still accepted but hidden from the help."""
    parser.add_argument(old, dest=action.dest, nargs=action.nargs, type=action.type, choices=action.choices,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; give 1 or more")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text} is below 0; give 0 (greedy) or more")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty; give at least one character")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="taps", description="TAPS speculative-decoding drafters on Ray", formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"taps {metadata.version('taps-ray')}")
    parser.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    data = _command(commands, "data", "list the data sets and where they come from, or show examples",
                    "taps data show gsm8k -n 3")
    data_commands = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    _command(data_commands, "list", "every data set with its role, source and row count", "taps data list")
    show = _command(data_commands, "show", "print the first examples of a data set", "taps data show gsm8k -n 3")
    show.add_argument("name", help="mt_bench, gsm8k, math_500, svamp, sharegpt or mathinstruct")
    show.add_argument("-n", type=_positive_int, default=3, help="number of examples")

    features = _command(commands, "features", "extract and cache the target's features of training mixtures",
                        "taps features --config configs/cpu.yaml --mixture math")
    _add_config(features)
    features.add_argument("--mixture", default=None, help="one mixture (default: every mixture a head trains on)")

    train = _command(commands, "train", "train (or resume) one draft head on one mixture",
                     "taps train --config configs/cpu.yaml --kind eagle2 --mixture math")
    _add_config(train)
    train.add_argument("--kind", choices=HEAD_KINDS, required=True, help="head kind")
    train.add_argument("--mixture", required=True, help="a mixture name from the config (math, chat, mixed, ...)")

    search = _command(commands, "search", "Ray Tune + ASHA over the math/chat ratio (and size) of a mixture; saves "
                      "the `searched` head", "taps search --config configs/cpu.yaml --quick")
    _add_config(search)
    search.add_argument("--quick", action="store_true",
                        help="the sweep's shrunken study, at most 4 trials of 2 epochs (own work dir)")

    export = _command(commands, "export", "write a trained head in the EAGLE / EAGLE-3 layout vLLM and SGLang load",
                      "taps export --config configs/cpu.yaml --kind eagle2 --mixture math --out exported/math")
    _add_config(export)
    export.add_argument("--kind", choices=HEAD_KINDS, required=True, help="head kind")
    export.add_argument("--mixture", required=True, help="a mixture name from the config (math, chat, mixed, ...)")
    export.add_argument("--out", required=True, help="the new checkpoint folder to write (see docs/export.md)")
    export.add_argument("--force", action="store_true", help="replace what is at --out (atomically)")
    export.add_argument("--layout", choices=["eagle", "eagle3"], default=None,
                        help="default: eagle3 for eagle3 heads, eagle for eagle2 and hass heads")
    export.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                        help="whose conventions the folder follows: EAGLE class name, fc bias, EAGLE-3 layer ids "
                        "(docs/export.md)")

    agreement = _command(commands, "agreement", "measure the held-out agreement of every trained head (cached)",
                         "taps agreement --config configs/cpu.yaml")
    _add_config(agreement)

    evaluate = _command(commands, "eval", "evaluate proposers x benchmarks x temperatures (resumable)",
                        "taps eval --config configs/cpu.yaml --kind eagle2 --proposers math chat --benchmarks gsm8k")
    _add_config(evaluate)
    _alias(evaluate, "--kinds", evaluate.add_argument("--kind", nargs="+", choices=HEAD_KINDS, dest="kinds",
                                                      help="head kinds (default: train.kinds)"))
    evaluate.add_argument("--proposers", nargs="+", help="default: eval.proposers")
    evaluate.add_argument("--benchmarks", nargs="+", help="default: every benchmark in eval.benchmarks")
    evaluate.add_argument("--temperatures", nargs="+", type=_non_negative_float, help="default: eval.temperatures")

    gen = _command(commands, "generate", "decode one prompt with a proposer; prints tau and the speedup",
                   'taps generate --config configs/cpu.yaml --proposer routed --prompt "What is 17*23?"')
    _add_config(gen)
    gen.add_argument("--proposer", default="math", help="plain, a head (math, chat, ...), a combination (routed, "
                     "merged, ...) or any proposer name of docs/algorithms.md")
    gen.add_argument("--prompt", required=True, type=_non_empty, help="the user turn")
    gen.add_argument("--kind", choices=HEAD_KINDS, default="eagle2", help="head kind")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0: greedy")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="answer length limit")
    gen.add_argument("--repetitions", type=_positive_int, default=2,
                     help="timed runs of each of plain and the proposer, interleaved, after one warm-up each")
    gen.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: the config's")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    report = _command(commands, "report", "regenerate the report (tables, plots, findings) from the results store",
                      "taps report --results reports/results")
    report.add_argument("--config", default=None, help="study config, e.g. configs/cpu.yaml; default: the one a "
                        "report's results/ copy holds (its config.yaml)")
    report.add_argument("--results", default=None,
                        help="results store or a report's results/ copy (e.g. reports/results); default: the "
                             "config's work_dir/results")

    heads = _command(commands, "heads-report", "write heads.md from the trained heads' metrics and agreement",
                     "taps heads-report --config configs/cpu.yaml")
    _add_config(heads)
    _alias(heads, "--output", heads.add_argument("--out", default=None,
                                                 help="folder for heads.md (default: the config's reports_dir)"))
    heads.add_argument("--render-only", action="store_true",
                       help="only re-render heads.md from the heads.json in that folder")

    sweep = _command(commands, "sweep", "the whole study on Ray: data, features, train (Tune), eval, report",
                     "taps sweep --config configs/cpu.yaml --quick")
    _add_config(sweep)
    sweep.add_argument("--quick", action="store_true",
                       help="a shrunken study that finishes in minutes (own work dir, its config saved there)")
    sweep.add_argument("--stages", default=None,
                       help="comma-separated subset of data,features,train,eval,report (default: all)")
    sweep.add_argument("--address", default=None, help="Ray address (default: ray.address of the config; 'auto' joins)")
    sweep.add_argument("--work-dir", default=None, help="override work_dir (use an absolute path on a cluster)")
    sweep.add_argument("--reports-dir", default=None, help="override reports_dir")

    plan = _command(commands, "plan", "GPU, host memory and disk per actor kind, and whether each fits the cluster's "
                    "node types (exit 1 when one does not)",
                    "taps plan --config configs/paper.yaml --cluster cluster.yaml")
    _add_config(plan)
    plan.add_argument("--cluster", default=None, help="Ray cluster config whose node types to check, e.g. cluster.yaml")
    plan.add_argument("--model-config", default=None, help="the target's config.json (offline); default: "
                      "configs/models/ for known targets, else the model's folder or Hub id")
    _alias(plan, "--doc", plan.add_argument("--out", default=None,
                                            help="write the plan into this markdown file's generated block"))

    serve_cmd = _command(commands, "serve", "OpenAI-compatible HTTP service of the target and heads (Ray Serve)",
                         "taps serve --config configs/cpu.yaml --port 8000")
    _add_config(serve_cmd)
    serve_cmd.add_argument("--host", default=None, help="listen address (default: serve.host, 127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=None, help="port (default: serve.port, 8000)")
    _alias(serve_cmd, "--head-kind", serve_cmd.add_argument("--kind", choices=HEAD_KINDS, default=None,
                                                            help="head kind (default: serve.head_kind)"))
    bench = _command(commands, "bench", "wall-clock speed vs plain decoding, HF greedy, prompt lookup, assisted",
                     "taps bench --config configs/cpu.yaml --proposers math --per-benchmark 4 --no-peers",
                     argument_default=argparse.SUPPRESS,
                     description="Every option defaults to the full `make bench` run (taps_ray/bench/run.py).")
    _add_config(bench)
    bench.add_argument("--kind", choices=HEAD_KINDS, help="head kind")
    bench.add_argument("--proposers", nargs="+", help="our proposers besides plain")
    bench.add_argument("--per-benchmark", type=_positive_int, help="first turns per benchmark, spread through each set")
    bench.add_argument("--benchmarks", nargs="+", choices=("gsm8k", "mt_bench", "math_500", "svamp"))
    bench.add_argument("--per-category", type=_positive_int, help="prompts per out-of-domain category")
    bench.add_argument("--categories", nargs="*", help="out-of-domain categories (code translation writing reasoning)")
    bench.add_argument("--max-new-tokens", type=_positive_int)
    bench.add_argument("--repetitions", type=_positive_int)
    bench.add_argument("--dtype", nargs="+", choices=("fp32", "bf16", "fp16"), dest="dtypes",
                       help="one run and one report section per dtype (default: fp32 bf16)")
    bench.add_argument("--narrow", nargs="*", choices=("fp32", "bf16", "fp16"), dest="narrow_dtypes",
                       help="dtypes that decode only the first benchmark (default: bf16; none: all decode all)")
    bench.add_argument("--trees", nargs="+", metavar="T/D/K",
                       help="also time the first proposer with these trees (total_token/depth/top_k), e.g. 8/3/2")
    bench.add_argument("--slow-peer-prompts", type=_positive_int, help="prompts per benchmark / category for HF assisted")
    bench.add_argument("--no-peers", action="store_false", dest="peers", help="skip the HF methods (quick tree tuning)")
    _alias(bench, "--name", bench.add_argument("--out", dest="name", metavar="NAME", help="report name: writes "
                                               "<reports_dir>/<NAME>.md and <NAME>_speed.png (default: bench)"))
    bench.add_argument("--vllm-venv", help="also time vLLM's CPU build from this side venv (`make vllm-venv`): "
                       "plain, n-gram and our exported head of --vllm-head-kind (docs/export.md)")
    bench.add_argument("--vllm-head-kind", choices=HEAD_KINDS, help="the head vLLM drafts with (default eagle3)")
    bench.add_argument("--vllm-preload", nargs="+", choices=("on", "off"),
                       help="vLLM with tcmalloc + libiomp5 preloaded (on), without (off), or both, the first "
                       "mode's rows unsuffixed (default: off; reports/vllm_preload.md)")
    bench.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")

    interop = _command(commands, "interop", "serve our exported heads in vLLM's CPU build and check outputs and "
                       "acceptance against our engine (docs/export.md)",
                       "taps interop --config configs/interop.yaml --vllm-venv .venv-vllm")
    _add_config(interop)
    _alias(interop, "--kinds", interop.add_argument("--kind", nargs="+", choices=HEAD_KINDS, dest="kinds",
                                                    default=["eagle2", "hass", "eagle3"], help="head kinds"))
    interop.add_argument("--mixture", default="math", help="the mixture the heads were trained on")
    interop.add_argument("--prompts", type=_positive_int, default=6, help="GSM8K first turns")
    interop.add_argument("--max-new-tokens", type=_positive_int, default=64, help="answer length limit")
    interop.add_argument("--k", type=_positive_int, default=3,
                         help="num_speculative_tokens (our chain: k+1 nodes, depth k)")
    interop.add_argument("--vllm-venv", default=None, help="vLLM's side venv (default $TAPS_VLLM_VENV or .venv-vllm)")
    interop.add_argument("--vllm-preload", action="store_true",
                         help="preload tcmalloc + libiomp5 into vLLM, as its CPU notes suggest (default off)")
    _alias(interop, "--name", interop.add_argument("--out", dest="name", metavar="NAME", default="interop",
                                                   help="report name: writes <reports_dir>/<NAME>.md"))
    return parser


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", None: None}


def _data(args: argparse.Namespace) -> int:
    if args.data_command == "list":
        return cmd_list(args.data_dir)
    return cmd_show(args.name, args.n, args.data_dir)


def _features(args: argparse.Namespace) -> int:
    from taps_ray.training.commands import cmd_features  # late: torch and transformers (this command only)

    config = _config(args)
    cmd_features(config, args.mixture and _mixture(config, args.mixture))
    return 0


def _train(args: argparse.Namespace) -> int:
    from taps_ray.training.commands import cmd_train  # late: torch and transformers (this command only)

    config = _config(args)
    cmd_train(config, args.kind, _mixture(config, args.mixture))
    return 0


def _search(args: argparse.Namespace) -> int:
    from taps_ray.study.search import cmd_search  # late: Ray Tune, torch, transformers (this command only)

    return cmd_search(_config(args), args.quick)


def _export(args: argparse.Namespace) -> int:
    from taps_ray.models.draft_head import DraftHead  # late: torch (this command only)
    from taps_ray.models.published import export_head  # late: torch, safetensors (this command only)

    out = check_new_output(args.out, args.force)
    config = _config(args)
    folder = head_checkpoint(config, args.kind, _mixture(config, args.mixture))
    if not folder.is_dir():
        raise FileNotFoundError(f"no trained {args.kind} head for mixture {args.mixture!r} at {folder}; train it first")
    try:
        out = export_head(DraftHead.load(folder), out, args.layout, args.engine)
    except OSError as error:  # e.g. the disk filled up or turned read-only while writing
        raise OutputRefused(f"--out {out}: {error.strerror or error}; nothing was written, choose another path") from None
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

    return cmd_generate(
        _config(args), args.proposer, args.prompt, args.kind, args.temperature, args.max_new_tokens,
        DTYPES[args.dtype], args.json, args.seed, args.repetitions,
    )


def _report(args: argparse.Namespace) -> int:
    from taps_ray.report import build_report  # late: matplotlib and pandas (this command only)
    from taps_ray.report.data import ReportCopy, results_source  # late: pandas (this command only)

    source = results_source(args.results) if args.results else None
    command = "taps report" + (f" --config {args.config}" if args.config else "") + (
        f" --results {args.results}" if args.results else "")
    if args.config is not None:
        config = _config(args)
    else:  # the copy's own config; the report goes where the copy is (its reports_dir/results)
        saved = source.config_path() if isinstance(source, ReportCopy) else None
        if saved is None:
            raise ConfigError("taps report needs --config (e.g. configs/cpu.yaml), or --results naming a report's "
                              "results/ copy that holds its config.yaml")
        config = with_overrides(load_config(saved), data_dir=args.data_dir, reports_dir=str(source.root.parent))
    path = build_report(config, source, command=command)
    print(f"report written to {path}")
    return 0


def _heads_report(args: argparse.Namespace) -> int:
    from taps_ray.report.heads import build_heads_report, rerender_heads_md  # late: matplotlib, torch

    config = _config(args)
    folder = args.out or config.reports_dir
    if args.render_only:
        if not (Path(folder) / "heads.json").is_file():
            raise FileNotFoundError(f"no heads.json in {folder} to re-render; run `taps heads-report --config "
                                    f"{args.config}` without --render-only first")
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
    from taps_ray.serve.process import cmd_serve  # late: Ray Serve, torch, transformers (this command only)

    config = _config(args)
    if args.kind:
        config = config.model_copy(update={"serve": config.serve.model_copy(update={"head_kind": args.kind})})
    cmd_serve(config, args.host, args.port)
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


def _mixture(config, name: str) -> str:
    """`name` once it is a mixture of the config; else a ConfigError naming the near miss and the choices."""
    if name not in config.mixtures:
        raise ConfigError(f"mixture {name!r} is not in this config{did_you_mean(name, config.mixtures)}; choose one "
                          f"of: {', '.join(config.mixtures)}")
    return name


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
