"""Whether a ZeroMQ endpoint is bound by anyone right now (ckpt_core/wire/endpoint.py), and the
connecting side's watch built on it (PeerWatch.unbound): real sockets, and a binder in a process
of its own where the process's death is the point."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from ckpt_core.wire import endpoint, link
from ckpt_core.wire.endpoint import endpoint_bound
from ckpt_core.wire.link import ENDPOINT_CHECK_S, PeerWatch
from support.ports import free_port
from support.wire import bound_in_process


def _abstract() -> str:
    return f"ipc://@ckpt-test-endpoint-{uuid.uuid4().hex}"


def _eventually(predicate, within: float = 10.0) -> bool:
    """ZeroMQ closes a socket's listener on its I/O thread, a moment after close() returned."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_an_abstract_name_is_bound_while_its_socket_lives_and_not_after_it_closed(ctx):
    handle = _abstract()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(handle)
    assert endpoint_bound(handle) is True   # bind is synchronous: bound as soon as it returned
    sock.close(linger=0)
    assert _eventually(lambda: endpoint_bound(handle) is False), "a closed socket's name still reads as bound"


def test_a_name_nobody_ever_bound_is_not_bound():
    assert endpoint_bound(_abstract()) is False


def test_a_name_is_still_bound_while_a_peer_is_connected_and_unbound_once_the_binder_left(ctx):
    """The binder's accepted connection shows the name too: while it lives the answer errs towards waiting."""
    handle = _abstract()
    ps, worker = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    ps.bind(handle)
    worker.connect(handle)
    assert ps.poll(5000, zmq.POLLOUT), "the worker did not connect"
    assert endpoint_bound(handle) is True
    ps.close(linger=0)
    assert _eventually(lambda: endpoint_bound(handle) is False)
    worker.close(linger=0)


def test_a_name_bound_by_a_process_that_was_killed_is_not_bound():
    handle = _abstract()
    with bound_in_process(handle) as proc:
        assert endpoint_bound(handle) is True   # another process's socket: the table is the namespace's
        proc.kill()
        proc.wait(30)
        assert _eventually(lambda: endpoint_bound(handle) is False), "a dead process's name still reads as bound"


def test_an_ipc_path_is_bound_while_a_socket_listens_there_not_for_the_file_left_behind(ctx, tmp_path):
    path = tmp_path / "ps.sock"
    handle = f"ipc://{path}"
    assert endpoint_bound(handle) is False   # no such file
    sock = ctx.socket(zmq.PAIR)
    sock.bind(handle)
    assert endpoint_bound(handle) is True
    sock.close(linger=0)
    assert _eventually(lambda: endpoint_bound(handle) is False), "a closed socket's path still reads as bound"
    assert path.is_socket(), "ZeroMQ left no socket file behind: the case of a file without a listener is untested"
    path.unlink()
    path.write_text("not a socket")
    assert endpoint_bound(handle) is False


@pytest.mark.parametrize("handle", ["tcp://127.0.0.1:{port}", "inproc://ckpt-test", "ipc://*", "ipc://", "", None, 7,
                                    "ipc:///\0bad"])
def test_what_cannot_be_checked_is_unknown_never_an_error(handle):
    if isinstance(handle, str):
        handle = handle.format(port=free_port())
    assert endpoint_bound(handle) is None


def test_an_unreadable_socket_table_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(endpoint, "PROC_UNIX", str(tmp_path / "no-such-table"))
    assert endpoint_bound(_abstract()) is None


def test_a_table_that_lists_no_abstract_names_is_not_believed(monkeypatch, tmp_path):
    """A sandbox's socket table may be empty or partial: "not listed" there proves nothing."""
    table = tmp_path / "unix"
    table.write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                     "0000000000000000: 00000002 00000000 00010000 0001 01 12345 /run/some.sock\n")
    monkeypatch.setattr(endpoint, "PROC_UNIX", str(table))
    assert endpoint_bound(_abstract()) is None


def test_a_name_listed_with_the_padding_of_a_full_address_length_is_bound(monkeypatch, tmp_path):
    handle = _abstract()
    table = tmp_path / "unix"
    table.write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                     f"0000000000000000: 00000002 00000000 00010000 0001 01 12345 {handle[6:]}@@@@\n")
    monkeypatch.setattr(endpoint, "PROC_UNIX", str(table))
    assert endpoint_bound(handle) is True
    assert endpoint_bound(handle + "x") is None   # another name: not listed, and this table is not believed


# -- PeerWatch.unbound: the connecting side's view ----------------------------------------------------------

def _counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = link.endpoint_bound

    def counted(handle):
        calls.append(handle)
        return real(handle)
    monkeypatch.setattr(link, "endpoint_bound", counted)
    return calls


def test_a_watch_that_expects_a_never_bound_endpoint_says_unbound_after_the_grace(ctx, monkeypatch):
    """Never seen bound: maybe its binder (a PS rank slower than the one that posted the handle) has
    not bound it yet; unbound only once the grace passed."""
    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 1.5)
    sock = ctx.socket(zmq.PAIR)
    watch = PeerWatch(sock, sticky=True)
    handle = _abstract()
    watch.expect(handle)
    sock.connect(handle)
    try:
        assert not watch.unbound   # the first look, at once: within the grace
        time.sleep(ENDPOINT_CHECK_S + 0.1)
        assert not watch.unbound   # 1.1 s: still within it
        time.sleep(ENDPOINT_CHECK_S + 0.1)
        assert watch.unbound and not watch.seen and not watch.lost
    finally:
        watch.close()
        sock.close(linger=0)


def test_a_watch_that_saw_its_endpoint_bound_says_unbound_at_the_next_look_once_it_is_gone(ctx, monkeypatch):
    """Seen bound at one look (not connected yet), gone at the next: its binder left; no grace."""
    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 60.0)
    handle = _abstract()
    ps, sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    watch = PeerWatch(sock, sticky=True)
    ps.bind(handle)
    try:
        watch.expect(handle)
        assert not watch.unbound   # bound
        ps.close(linger=0)
        assert _eventually(lambda: endpoint_bound(handle) is False)
        time.sleep(ENDPOINT_CHECK_S + 0.1)
        assert watch.unbound and not watch.seen
    finally:
        watch.close()
        sock.close(linger=0)


def test_a_watch_looks_at_most_once_per_interval_and_never_once_its_peer_connected(ctx, monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 0.0)
    handle = _abstract()
    ps, sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    watch = PeerWatch(sock, sticky=True)
    try:
        assert not watch.unbound and calls == [], "a watch that expects nothing looked something up"
        watch.expect(handle)
        assert watch.unbound and len(calls) == 1   # nobody binds it yet: the first look is at once
        for _ in range(50):
            assert not watch.unbound   # within the interval: no look, no verdict
        assert len(calls) == 1, f"looked {len(calls)} times within {ENDPOINT_CHECK_S} s"
        ps.bind(handle)
        time.sleep(ENDPOINT_CHECK_S + 0.1)
        assert not watch.unbound and len(calls) == 2   # bound now: a slow PS is waited for
        sock.connect(handle)
        assert _eventually(lambda: watch.drain() or watch.seen)
        ps.close(linger=0)
        assert _eventually(lambda: endpoint_bound(handle) is False)
        time.sleep(ENDPOINT_CHECK_S + 0.1)
        assert not watch.unbound and watch.lost   # once connected, a PS that left is a lost peer
        assert len(calls) == 2, "the watch looked the endpoint up after its peer connected"
    finally:
        watch.close()
        sock.close(linger=0)
