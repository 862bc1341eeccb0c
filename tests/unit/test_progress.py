"""The terminal progress bar: drawn on a terminal, silent otherwise, never in the way."""

import io

import pytest

pytest.importorskip("tqdm")
from ckpt_core._progress import TerminalProgress  # noqa: E402


def _one_update(bar, seen=None):
    bar("update", "plan", None, None)
    bar("update", "handshake", 0, 3)
    for i in range(1, 4):
        bar("update", "transfer", i, 3)
        if seen is not None:
            seen.append((bar._bar.n, bar._bar.total))
    bar("update", "post-hook", 3, 3)


def test_a_bar_counts_the_buckets_of_an_update_on_a_terminal():
    out = io.StringIO()
    bar = TerminalProgress("rank 0", out, force=True)
    seen = []
    _one_update(bar, seen)
    text = out.getvalue()
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert "rank 0 update" in text and bar._bar is None, "closed after the post hook"
    _one_update(bar)   # the next update gets a fresh bar
    assert text.count("rank 0 update") <= out.getvalue().count("rank 0 update") - 1


def test_nothing_is_drawn_when_the_stream_is_not_a_terminal():
    out = io.StringIO()
    bar = TerminalProgress("rank 0", out)
    _one_update(bar)
    assert not bar.enabled and out.getvalue() == ""
