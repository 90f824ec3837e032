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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "data":
        from taps_ray.data.commands import cmd_list, cmd_show

        if args.data_command == "list":
            return cmd_list(args.data_dir)
        return cmd_show(args.name, args.n, args.data_dir)
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
