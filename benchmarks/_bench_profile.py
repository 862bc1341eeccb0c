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
def profiled(path: str | None, cuda: bool = False):
    """cProfile the block into ``path``.prof and ``path``.txt (top entries by own and cumulative
    time); no-op when ``path`` is None. ``cuda``: also torch.profiler's table of the device kernels and
    host ops (``path``-kernels.txt: by device time, then by host time), to tell a launch-bound update
    from a bandwidth-bound one."""
    if path is None:
        yield
        return
    tp = None
    if cuda:
        import torch
        tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA])
        tp.__enter__()
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        if tp is not None:
            import torch
            torch.cuda.synchronize()
            tp.__exit__(None, None, None)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            table = tp.key_averages()
            with open(path + "-kernels.txt", "w") as f:
                f.write(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
                f.write("\n")
                f.write(table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.dump_stats(path + ".prof")
        with open(path + ".txt", "w") as f:
            f.write(top_entries(prof, sort="tottime"))
            f.write(top_entries(prof, sort="cumulative"))
