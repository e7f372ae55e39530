"""Unknown command-line flags answered with the closest known one, for ``distserve`` and
``distserve place`` alike (placement imports nothing of distserve, so it lives here)."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


def refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> NoReturn:
    """Exit 2 through ``parser.error`` on arguments it does not know, naming the closest known flag
    of each (``--tensor-paralel-size (did you mean --tensor-parallel-size?)``)."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    parts = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6) if arg.startswith("-") else []
        parts.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    parser.error(f"unrecognized arguments: {', '.join(parts)}")


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the closest known flag named for each unknown one."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown(parser, unknown)
    return args
