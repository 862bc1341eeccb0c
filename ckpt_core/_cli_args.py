"""argparse pieces of the ``ckpt-engine`` command line: bounded numbers, renamed options."""

from __future__ import annotations

import argparse
import math
import sys


def number(kind, *, low: float | None = None, low_open: bool = True, high: float | None = None):
    """An argparse ``type``: ``kind`` (int or float) that is finite and within bounds; a bad value is a usage
    error (exit 2) naming the option, never a traceback further in (NaN and inf pass ``float()``)."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>' if low_open else '>='} {low:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text!r} must be <= {high:g}")
        return value
    convert.__name__ = "positive number" if kind is float else "integer"
    return convert


POSITIVE = number(float, low=0)
COUNT = number(int, low=1, low_open=False)


class Deprecated(argparse.Action):
    """An old option name that still works, warns once on stderr, and stores into the new option."""

    def __init__(self, option_strings, dest, new: str, why: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new, self.why = new, why

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"ckpt-engine: warning: {option_string} is deprecated ({self.why}); use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed(parser, new: str, old: str, why: str, **kw) -> None:
    """``new`` with its ``kw``; ``old`` a hidden deprecated alias of it."""
    action = parser.add_argument(new, **kw)
    parser.add_argument(old, dest=action.dest, action=Deprecated, new=new, why=why, type=kw.get("type"),
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
