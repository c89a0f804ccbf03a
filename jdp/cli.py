"""The `jdp` command. Each capability registers its own subcommand from `<package>/cli.py`."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> module providing `register(subparsers)`; modules are imported only when present.
SUBCOMMANDS = {
    "demo": "jdp.demo",
    "altmin": "jdp.altmin.cli",
    "seqrec": "jdp.seqrec.cli",
    "select": "jdp.selection.cli",
    "meta": "jdp.meta.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jdp", description="Differentially private learning on long-tailed data.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except ValueError as err:  # invalid user input: a clear message, no traceback
        print(f"jdp {args.command}: error: {err}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
