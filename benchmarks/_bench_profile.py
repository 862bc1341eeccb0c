"""Profiles for the update benchmark (``update_bench.py --profile DIR``): cProfile of one timed
update on the parameter-server side (each rank) and in the simulated engine worker (each worker),
written as ``.prof`` files and as text tables of the top entries, so the per-tensor work on the
hot path can be read off (issue 38)."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from contextlib import contextmanager

TOP = 25


def top_entries(prof: cProfile.Profile, n: int = TOP, sort: str = "tottime") -> str:
    """The ``n`` costliest functions of ``prof`` by ``sort``, as pstats prints them."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(n)
    return out.getvalue()


@contextmanager
def profiled(path: str | None):
    """cProfile the block into ``path``.prof and ``path``.txt (top entries by own and cumulative
    time); no-op when ``path`` is None."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.dump_stats(path + ".prof")
        with open(path + ".txt", "w") as f:
            f.write(top_entries(prof, sort="tottime"))
            f.write(top_entries(prof, sort="cumulative"))
