"""argparse pieces of the ``ckpt-engine`` command line: bounded numbers, renamed options.

Every number the command line takes is bounded above as well as below, and checked by argparse
before any work: far above any real cluster, low enough that nothing derived from it (bytes,
lists, loops, processes) can outgrow a machine. A value out of bounds is a usage error (exit 2)
naming the option and the bound, never a traceback, a hang or a kernel kill further in.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# The bounds (docs/operations.md, "Bounds of the command line", lists them).
MAX_GIB = float(1 << 20)        # 1 PiB: a model, a device's free memory, a bucket
MAX_MIB = MAX_GIB * 1024        # the same in MiB (a tensor)
MAX_GB_PER_S = 1e6              # 1 PB/s: any link or copy rate
MAX_RANKS = 1 << 20             # parameter-server ranks of one checkpoint
MAX_NODES = 1 << 16
MAX_DEVICES = 1 << 12           # per node; also the largest engine tensor-parallel size
MAX_SLOTS = 1 << 10             # buckets in flight (PS_NUM_SLOTS has the same bound)
MAX_TENSORS = 10 ** 8           # ~1000x the tensors of the largest MoE checkpoints
MAX_PID = 1 << 22               # Linux's PID_MAX_LIMIT


def number(kind, *, low: float | None = None, low_open: bool = True, high: float | None = None,
           why: str = ""):
    """An argparse ``type``: ``kind`` (int or float) that is finite and within bounds; a bad value is a usage
    error (exit 2) naming the option, never a traceback further in (NaN and inf pass ``float()``).
    ``why``: what the upper bound stands for, said when it is exceeded."""
    def shown(bound: float) -> str:
        return str(int(bound)) if kind is int or float(bound).is_integer() else f"{bound:g}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:   # also int() of more digits than Python converts
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>' if low_open else '>='} {shown(low)}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} must be <= {shown(high)}{f' ({why})' if why else ''}")
        return value
    convert.__name__ = "positive number" if kind is float else "integer"
    convert.kind, convert.low, convert.low_open, convert.high = kind, low, low_open, high   # type: ignore[attr-defined]
    return convert


def count(high: int, why: str = ""):
    """An integer in ``[1, high]``."""
    return number(int, low=1, low_open=False, high=high, why=why)


GIB = number(float, low=0, high=MAX_GIB, why="1 PiB")
MIB = number(float, low=0, high=MAX_MIB, why="1 PiB")
RATE = number(float, low=0, high=MAX_GB_PER_S, why="1 PB/s")
COUNT = count(MAX_RANKS, "ranks of one parameter-server world")
PORT = number(int, low=0, low_open=False, high=65535)
PID = number(int, low=1, low_open=False, high=MAX_PID, why="Linux's largest process id")
MAX_SECONDS = 1e8               # ~3 years (the settings' bound too): a wait longer than this is a typo
TIMEOUT = number(float, low=0, high=MAX_SECONDS, why="~3 years")
SECONDS = number(float, low=0, low_open=False, high=MAX_SECONDS, why="~3 years")
GIB_OR_NONE = number(float, low=0, low_open=False, high=MAX_GIB, why="1 PiB")   # 0 allowed


def nproc():
    """``bench --nproc``: processes started on this machine, one per rank: at most its CPU count."""
    cpus = os.cpu_count() or 1
    return count(cpus, f"this machine's {cpus} CPUs: one process per rank")


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
