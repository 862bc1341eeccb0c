"""The stock worker loop as our SGLang loader runs it (ckpt_sglang/_stock_loop.py): while a stage or a
direct load receives, the interpreter's switch interval is lowered (SGLang's scheduler thread spins
beside the receiver), and the previous value comes back after, also when the loop fails."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from ckpt_sglang import _stock_loop
from ckpt_sglang._stock_loop import SWITCH_INTERVAL_S, fast_switching, run_stock_loop


@pytest.fixture
def interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


def test_the_switch_interval_is_lowered_while_receiving_and_restored_after_nested_users(interval):
    with fast_switching():
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        with fast_switching():
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S), "an inner user restored it early"
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_switch_interval_comes_back_when_the_stock_loop_fails(interval, monkeypatch):
    seen = []

    def failing_loop(ctx, handle, device_id, *, run, post_hook=None):
        seen.append((sys.getswitchinterval(), handle, device_id))
        raise RuntimeError("the parameter server aborted the update")

    monkeypatch.setattr(_stock_loop, "stock_loop", lambda: failing_loop)
    with pytest.raises(RuntimeError, match="aborted"):
        run_stock_loop("ipc://@nobody", torch.device("cpu"), 0, 1.0, run=lambda weights: None)
    assert seen == [(pytest.approx(SWITCH_INTERVAL_S), "ipc://@nobody", 0)]
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_stock_loop_collects_only_the_young_generation(monkeypatch):
    """The stock loop's own ``gc.collect()`` calls (full collections) become young-generation ones."""
    import gc
    import types

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    namespace = {"gc": gc}
    exec("def update_weights_from_ipc(ctx, handle, device_id, *, run, post_hook=None):\n"
         "    gc.collect()\n    return handle", namespace)
    worker = types.ModuleType("checkpoint_engine.worker")
    worker.update_weights_from_ipc = namespace["update_weights_from_ipc"]
    monkeypatch.setitem(sys.modules, "checkpoint_engine", types.ModuleType("checkpoint_engine"))
    monkeypatch.setitem(sys.modules, "checkpoint_engine.worker", worker)
    sys.modules["checkpoint_engine"].worker = worker
    assert _stock_loop.stock_loop()(None, "h", 0, run=None) == "h" and calls == [0]
    worker.update_weights_from_ipc(None, "h", 0, run=None)
    assert calls == [0, 2], "the stock module itself was changed"


def test_the_stage_probe_runs_on_the_cpu_and_records_its_three_cases(tmp_path):
    """benchmarks/sglang_stage_probe.py (no timing asserted: the figures belong to the probe)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "sglang_stage_probe.py"), "--tasks", "10",
                           "--remote-ms", "0.2", "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["spinning"], r["tasks"]) for r in rows] == [(False, 10), (True, 10), (True, 10)]
    assert rows[2]["switch_interval_ms"] == pytest.approx(SWITCH_INTERVAL_S * 1e3) and rows[1]["spinner_iterations"] > 0
    assert sys.getswitchinterval() > 0 and "faster beside the spinner" in proc.stdout


# -- the owner's stop: the stock loop's receives wait in slices and ask should_stop between them ---------

def _stock_shaped_loop(method: str):
    """A loop with the stock worker's receiving (checkpoint_engine.worker 0.2-0.4): a REP socket made by
    the context it is given, connected to the handle; a failed first receive is answered with a send and
    an ack is awaited, then re-raised; each later message is handed to ``run`` and answered with b""
    (``method``: the receive it uses; the stock loop's is ``recv_pyobj``). No GPU, no IPC buffer."""
    import zmq

    def loop(ctx, handle, device_id, *, run, post_hook=None):
        sock = ctx.socket(zmq.REP)
        sock.connect(handle)
        try:
            try:
                getattr(sock, method)()
                sock.send(b"")
            except Exception as exc:
                sock.send_string(f"{type(exc).__name__}: {exc}")
                sock.recv()   # the ack, as the stock loop waits for it
                raise
            while True:
                run(getattr(sock, method)())
                sock.send(b"")
        finally:
            sock.close()

    return loop


class _Peer:
    """The parameter server's end: a REQ socket bound at a fresh address (``bound=False``: nobody binds
    it, as when the PS gave the update up before the receiver connected; ``unchecked``: a tcp:// address,
    whose binding the receiver cannot look up, so that it waits as for a silent PS)."""

    def __init__(self, bound: bool, unchecked: bool = False):
        import uuid

        import zmq

        from support.ports import free_port

        self.ctx = zmq.Context()
        self.address = (f"tcp://127.0.0.1:{free_port()}" if unchecked
                        else f"ipc://@ckpt-test-stock-loop-{uuid.uuid4().hex}")
        self.sock = self.ctx.socket(zmq.REQ) if bound else None
        if self.sock is not None:
            self.sock.bind(self.address)

    def exchange(self, *frames: bytes) -> None:
        """Send each frame and take the loop's empty answer to it."""
        import zmq

        for frame in frames:
            self.sock.send(frame)
            assert self.sock.poll(10_000, zmq.POLLIN), "the loop did not answer"
            assert self.sock.recv() == b""

    def close(self):
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()


def _receive_in_thread(handle, timeout_s, should_stop, method="recv_pyobj", runs=None):
    import threading

    out: dict = {}

    def main():
        try:
            run_stock_loop(handle, torch.device("cpu"), 0, timeout_s, run=(runs if runs is not None else []).append,
                           should_stop=should_stop)
        except BaseException as exc:   # noqa: BLE001 - the outcome under test
            out["error"] = exc
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("method", ["recv_pyobj", "recv"])
@pytest.mark.parametrize("bound", [True, False], ids=["silent-ps", "unchecked-absent-ps"])
def test_a_wait_for_a_ps_that_gave_up_ends_within_a_poll_when_the_owner_stops_it(monkeypatch, bound, method):
    """A stage's receiver waiting for a PS that never sends (bound and silent, or absent behind an address
    whose binding cannot be looked up) ends with the owner's reason, a ConfigError, within a poll of
    the owner's stop, not at the receive timeout (60 s here); the error is the stop, not ZeroMQ's refusal
    of the loop's answer after a failed first receive."""
    import threading

    from ckpt_core.errors import ConfigError

    monkeypatch.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop(method))
    peer, stop = _Peer(bound, unchecked=not bound), threading.Event()
    try:
        thread, out = _receive_in_thread(peer.address, 60.0,
                                         lambda: "the stage of 'v1' was dropped" if stop.is_set() else None, method)
        time.sleep(1.5)   # past the first looks at the PS's address
        assert thread.is_alive() and not out, "it stopped although nobody asked it to"
        asked = time.monotonic()
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the owner's stop did not end the wait"
        assert isinstance(out["error"], ConfigError), repr(out["error"])
        assert str(out["error"]) == ("the stage of 'v1' was dropped (the receiver was waiting for the parameter "
                                     "server's next message)")
        assert out["ended"] - asked < 5.0, "the stop took far longer than a poll"   # generous: a poll is 0.2 s
    finally:
        peer.close()


def test_a_stop_between_messages_ends_the_loop_after_what_it_received():
    """Stopped after a first message was received and answered: the next wait ends with the reason; what
    came before went to ``run``."""
    import threading


    from ckpt_core.errors import ConfigError

    peer, stop, runs = _Peer(True), threading.Event(), []
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop("recv"))
            thread, out = _receive_in_thread(peer.address, 60.0, lambda: "replaced" if stop.is_set() else None,
                                             "recv", runs)
            peer.exchange(b"hello", b"bucket-0")
            stop.set()
            thread.join(10)
        assert not thread.is_alive() and isinstance(out["error"], ConfigError) and str(out["error"]).startswith(
            "replaced (the receiver was waiting"), out
        assert runs == [b"bucket-0"]
    finally:
        peer.close()


@pytest.mark.parametrize("bound", [True, False], ids=["silent-ps", "unchecked-absent-ps"])
def test_a_silent_ps_is_a_timeout_naming_the_receive_timeout_when_nobody_stops_it(monkeypatch, bound):
    """Without an owner's stop, each receive still waits at most the timeout: an UpdateTimeoutError
    naming it (before, ZeroMQ's EAGAIN, hidden by the EFSM of the loop's answer to it)."""
    from ckpt_core.errors import UpdateTimeoutError

    monkeypatch.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop("recv_pyobj"))
    peer = _Peer(bound, unchecked=not bound)
    try:
        with pytest.raises(UpdateTimeoutError, match=r"no message from the parameter server within the receive "
                                                     r"timeout \(0.5 s\)"):
            run_stock_loop(peer.address, torch.device("cpu"), 0, 0.5, run=lambda weights: None)
    finally:
        peer.close()


@pytest.mark.parametrize("monitor", ["reports the disconnect", "misses the disconnect"])
def test_a_ps_that_connected_and_died_ends_the_wait_without_any_owner(monitor):
    """A direct load runs the loop in the scheduler's own call: nobody can stop it. A PS that had
    connected and went away (its process died) ends its wait with a TransportError saying so, long
    before the receive timeout (60 s here): by ZeroMQ's disconnect event, or without it by the PS's
    handle no longer bound (``PeerWatch.binder_left``)."""
    import zmq

    from ckpt_core.errors import TransportError
    from ckpt_core.wire.endpoint import endpoint_bound
    from support.wire import monitor_misses_disconnects

    peer = _Peer(True)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if monitor == "misses the disconnect":
                if endpoint_bound(peer.address) is not True:
                    pytest.skip("this machine's socket table cannot tell whether the PS's handle is bound")
                monitor_misses_disconnects(mp)
            mp.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop("recv_pyobj"))
            thread, out = _receive_in_thread(peer.address, 60.0, None)
            deadline = time.monotonic() + 10
            while not peer.sock.poll(0, zmq.POLLOUT):   # a REQ socket is writable once its peer connected
                assert time.monotonic() < deadline, "the loop did not connect"
                time.sleep(0.01)
            time.sleep(0.3)
            gone = time.monotonic()
            peer.sock.close(0)
            peer.sock = None
            thread.join(20)
        assert not thread.is_alive(), "the loop still waits for a PS that went away"
        assert isinstance(out["error"], TransportError), repr(out["error"])
        said = "the parameter server disconnected" if monitor.startswith("reports") else "is not bound any more"
        assert said in str(out["error"]), str(out["error"])
        assert out["ended"] - gone < 10, "the disconnect was noticed only much later"   # generous: a poll is 0.2 s
    finally:
        peer.close()


# -- a PS that gave the update up before the receiver connected: its handle is bound by nobody ---------------

def _gone_handle(how: str) -> str:
    """A stock-wire handle whose PS gave the update up before any receiver connected: never bound, bound
    and closed (its deadline or a stop), or bound by a process that was killed."""
    import uuid

    import zmq

    from support.wire import bound_in_process

    handle = f"ipc://@checkpoint-engine-test-gone-{uuid.uuid4().hex}.sock"
    if how == "closed":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.bind(handle)
        sock.close(0)
        ctx.term()
    elif how == "killed":
        with bound_in_process(handle, "REQ") as proc:
            proc.kill()
            proc.wait(30)
    return handle


@pytest.mark.parametrize("how", ["never-bound", "closed", "killed"])
def test_a_ps_that_gave_up_before_the_receiver_connected_ends_the_wait_without_any_owner(monkeypatch, how):
    """A direct load runs the loop in the scheduler's own call: nobody can stop it. When its request ran
    after the PS gave the update up, the PS's handle is bound by nobody: the wait ends with a
    TransportError saying so after the grace a slower PS rank may need to bind it (2 s here), not at
    the receive timeout (60 s here), before anything ran; the loop's answer to the failed receive does
    not hide it."""
    from ckpt_core.errors import TransportError
    from ckpt_core.wire import link

    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 2.0)
    handle = _gone_handle(how)
    monkeypatch.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop("recv_pyobj"))
    runs: list = []
    t0 = time.monotonic()
    thread, out = _receive_in_thread(handle, 60.0, None, runs=runs)
    thread.join(30)
    assert not thread.is_alive(), "the loop still waits for a PS that gave up"
    assert isinstance(out["error"], TransportError), repr(out["error"])
    assert str(out["error"]) == (f"the parameter server's socket {handle} is not bound: it gave the update up "
                                 "(deadline, stop or death) before this receiver connected; nothing was loaded")
    assert 2.0 <= out["ended"] - t0 < 10, f"noticed after {out['ended'] - t0:.1f} s (grace 2 s)"
    assert runs == []


def test_a_slow_ps_that_bound_its_handle_is_waited_for_without_any_owner():
    """A PS that bound its handle and sends its first message late (1.5 s: past the receiver's first looks
    at the handle) is no PS that gave up: the loop answers what it sends."""
    import threading


    from ckpt_core.errors import ConfigError

    peer, stop, runs = _Peer(True), threading.Event(), []
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_stock_loop, "stock_loop", lambda: _stock_shaped_loop("recv"))
            thread, out = _receive_in_thread(peer.address, 60.0, lambda: "done" if stop.is_set() else None,
                                             "recv", runs)
            time.sleep(1.5)
            assert thread.is_alive() and not out, f"a slow PS was refused: {out}"
            peer.exchange(b"hello", b"bucket-0")
            stop.set()
            thread.join(10)
        assert isinstance(out["error"], ConfigError) and runs == [b"bucket-0"], out
    finally:
        peer.close()


def test_the_real_stock_loop_ends_soon_when_its_ps_was_killed_before_it_connected(tmp_path):
    """The same with the stock checkpoint-engine worker loop itself (0.4.2, from ``$CKPT_STOCK_CE``), as
    SGLang's scheduler runs it for a direct load, in a process of its own: its PS process was killed
    before the receiver connected (never seen bound: it ends after the grace, 2 s in that process)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from support.stock_workers import stock_dirs

    folder = stock_dirs().get("0.4.2")
    if folder is None:
        pytest.skip("stock checkpoint-engine 0.4.2 not installed: run scripts/stock_ce_env.sh and export "
                    "CKPT_STOCK_CE (scripts/test.sh does)")
    root = Path(__file__).resolve().parents[2]
    handle = _gone_handle("killed")
    script = ("import json, sys, time, torch\n"
              "from support.stock_workers import load_stock_worker\n"
              "load_stock_worker(sys.argv[2])\n"
              "from ckpt_core.wire import link\n"
              "link.NEVER_BOUND_GRACE_S = 2.0\n"
              "from ckpt_sglang._stock_loop import run_stock_loop\n"
              "runs, t0 = [], time.monotonic()\n"
              "try:\n"
              "    run_stock_loop(sys.argv[1], torch.device('cpu'), 0, 60.0, run=runs.append)\n"
              "    out = {'error': None}\n"
              "except Exception as exc:\n"
              "    out = {'error': type(exc).__name__, 'message': str(exc)}\n"
              "out.update(seconds=time.monotonic() - t0, runs=len(runs))\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, handle, folder], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "TransportError" and f"socket {handle} is not bound" in out["message"], out
    assert 2.0 <= out["seconds"] < 10 and out["runs"] == 0, out   # the grace 2 s, the receive timeout 60 s
