"""The terminal progress bar: drawn on a terminal, silent otherwise, never in the way."""

import io

import pytest

pytest.importorskip("tqdm")
from ckpt_core.ops.progress import TerminalProgress  # noqa: E402


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


def test_a_real_registration_draws_a_bar_per_phase_in_bytes_and_ends_closed(tmp_path):
    """register_checkpoint reports its phases in bytes (fault-in/pin when the kind pins, the copy
    of every file and tensor); the bar shows them and is closed when the registration is done."""
    import torch
    from ckpt_core import ParameterServer
    from ckpt_core.checkpoint.safetensors import write_file
    calls = []
    out = io.StringIO()
    bar = TerminalProgress("rank 0", out, force=True)

    def record(*a):
        calls.append(a)
        bar(*a)
    path = str(tmp_path / "a.safetensors")
    write_file(path, {"w": torch.arange(300 << 18, dtype=torch.int32)})   # 300 MiB: two copy pieces
    with ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1", master_port=_port()) as ps:
        ps.progress = record
        ps.register_checkpoint("c", files=[path], named_tensors={"t": torch.ones(7)})
    fill = [(d, t) for op, phase, d, t in calls if op == "register" and phase == "fill"]
    assert calls[0][:2] == ("register", "validate") and calls[-1][:2] == ("register", "done")
    assert len(fill) >= 2 and fill[-1][0] == fill[-1][1] >= (300 << 20), fill
    assert [d for d, _ in fill] == sorted(d for d, _ in fill), "bytes done only grow"
    assert "rank 0 register: fill" in out.getvalue() and bar._bar is None


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
