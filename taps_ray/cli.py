"""`taps` command line. Subcommands are added here as the project grows; `taps data list|show` exists now."""

from __future__ import annotations

import argparse
import sys


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
    features.add_argument("--config", required=True, help="study config, e.g. configs/cpu.yaml")
    features.add_argument("--mixture", default=None, help="one mixture (default: every mixture in train.mixtures)")
    train = commands.add_parser("train", help="train (or resume) one draft head on one mixture")
    train.add_argument("--config", required=True, help="study config, e.g. configs/cpu.yaml")
    train.add_argument("--kind", choices=("eagle2", "hass"), required=True)
    train.add_argument("--mixture", required=True, help="a mixture name from the config (math, chat, mixed, ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "data":
        from taps_ray.data.commands import cmd_list, cmd_show

        if args.data_command == "list":
            return cmd_list(args.data_dir)
        return cmd_show(args.name, args.n, args.data_dir)
    if args.command in ("features", "train"):
        import os

        from taps_ray.config import load_config
        from taps_ray.training.commands import cmd_features, cmd_train

        if args.data_dir:
            os.environ["TAPS_DATA_DIR"] = args.data_dir
        cfg = load_config(args.config)
        if args.command == "features":
            cmd_features(cfg, args.mixture)
        else:
            cmd_train(cfg, args.kind, args.mixture)
        return 0
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
