"""Drop-in parity with checkpoint-engine on CPU: req_func on every rank (the reference's test shape),
duplicate tensor names, and the surface a migrating user touches."""

from __future__ import annotations

import logging

import pytest
import torch

from support import parity_cases as cases
from support.data import fresh_tensor
from ckpt_core import CheckpointFormatError
from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.checkpoint.safetensors import write_file
from ckpt_core.devices import get_backend


def test_every_ranks_req_func_feeds_its_own_worker_three_updates_then_a_worker_error_reaches_every_rank(tmp_path):
    cases.case_reference_scenario("cpu", 2, tmp_path)


def test_a_req_func_failing_or_hanging_on_rank_1_fails_every_rank_naming_rank_1():
    cases.case_req_func_faults_on_rank_1("cpu")


# ---------------------------------------------------------------- duplicate names in one registration
def _build(files=(), named=None):
    return build_checkpoint("dup", get_backend("cpu"), files=[str(f) for f in files], named_tensors=named or {})


def test_byte_identical_duplicates_are_registered_once_with_a_warning_naming_both_files(tmp_path, caplog):
    gen = torch.Generator().manual_seed(1)
    shared = {"a": fresh_tensor((3, 5), torch.float16, gen), "b": fresh_tensor((7,), torch.float8_e4m3fn, gen)}
    f1, f2 = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    write_file(str(f1), {**shared, "x": fresh_tensor((4,), torch.float32, gen)})
    write_file(str(f2), {"b": shared["b"].clone(), "y": fresh_tensor((2, 2), torch.bfloat16, gen)})
    before = (f1.read_bytes(), f2.read_bytes())
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        ckpt = _build([f1, f2], {"a": shared["a"].clone(), "z": fresh_tensor((5,), torch.float32, gen)})
    try:
        assert sorted(m.name for m in ckpt.metas) == ["a", "b", "x", "y", "z"]
        for m in ckpt.metas:
            if m.name in shared:
                assert torch.equal(ckpt.host_tensor(m).view(torch.uint8), shared[m.name].view(torch.uint8))
        warned = "\n".join(r.getMessage() for r in caplog.records)
        assert f"'b' appears in both {f1} and {f2}" in warned and f"'a' appears in both {f1} and named_tensors" in warned
    finally:
        ckpt.release()
    assert (f1.read_bytes(), f2.read_bytes()) == before, "source files must stay untouched"


@pytest.mark.parametrize("change", ["bytes", "dtype", "shape"])
@pytest.mark.parametrize("second", ["file", "named"])
def test_differing_duplicates_raise_naming_both_sources_and_the_tensor(tmp_path, change, second):
    gen = torch.Generator().manual_seed(2)
    t = fresh_tensor((4, 6), torch.bfloat16, gen)
    other = {"bytes": t.clone().index_fill_(0, torch.tensor([3]), 7.0), "dtype": t.to(torch.float16),
             "shape": t.reshape(6, 4).clone()}[change]
    f1 = tmp_path / "one.safetensors"
    write_file(str(f1), {"w": t})
    if second == "file":
        f2 = tmp_path / "two.safetensors"
        write_file(str(f2), {"w": other})
        files, named, where = [f1, f2], None, str(f2)
    else:
        files, named, where = [f1], {"w": other}, "named_tensors"
    with pytest.raises(CheckpointFormatError) as info:
        _build(files, named)
    msg = str(info.value)
    assert str(f1) in msg and where in msg and "tensor 'w'" in msg and info.value.tensor == "w", msg


# ---------------------------------------------------------------- the surface a migrating user touches
def test_errors_are_still_the_builtins_the_reference_raises():
    import ckpt_core as c
    for cls, builtins in {c.ConfigError: (ValueError, AssertionError), c.CheckpointFormatError: (ValueError,),
                          c.CheckpointNotFoundError: (KeyError, RuntimeError),
                          c.RemoteWorkerError: (RuntimeError,), c.TransportError: (RuntimeError,),
                          c.UpdateTimeoutError: (RuntimeError, TimeoutError), c.ClosedError: (RuntimeError,)}.items():
        for b in builtins:
            assert issubclass(cls, b), f"{cls.__name__} must still be caught by 'except {b.__name__}'"


def test_request_inference_to_update_keeps_the_reference_signature():
    import inspect

    from ckpt_core import request_inference_to_update
    params = list(inspect.signature(request_inference_to_update).parameters.values())
    assert [p.name for p in params[:4]] == ["url", "socket_paths", "timeout", "uds"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:4])
    assert (params[2].default, params[3].default) == (300.0, None)


def test_reference_keywords_metas_round_trip_and_empty_ranks_broadcast():
    """Keyword-only construction with gpu_count; get_metas() -> JSON -> load_metas() on another
    ParameterServer; ranks=[] and ranks=None both broadcast; a req_func that is not callable is a
    ConfigError (the reference asserts)."""
    import json

    import zmq

    from support.data import FAULT_DTYPES, digest
    from support.ports import free_port
    from ckpt_core import ConfigError, ParameterServer, update_weights_from_ipc

    gen = torch.Generator().manual_seed(3)
    named = {f"t{i}": fresh_tensor((16, 8), dtype, gen) for i, dtype in enumerate(FAULT_DTYPES)}
    with ParameterServer(rank=0, world_size=1, gpu_count=1, device="cpu", auto_pg=True, mem_fraction=0.5,
                         master_addr="127.0.0.1", master_port=free_port()) as ps:
        ps.init_process_group()          # the reference's examples call these explicitly
        ps.store_based_barrier()
        ps.register_checkpoint("c", named_tensors=named)
        ps.gather_metas("c")
        saved = json.loads(json.dumps(ps.get_metas()))
        ctx, got = zmq.Context(), {}

        def req_func(handles):   # the engine side, in the req_func thread: one worker, this device
            update_weights_from_ipc(ctx, dict(handles)[ps.device_uuid], 0,
                                    run=lambda ws: got.update({n: digest(t) for n, t in ws}))
        for ranks in ([], None):
            got.clear()
            ps.update("c", req_func, ranks=ranks, timeout=60)
            assert got == {n: digest(t) for n, t in named.items()}, f"ranks={ranks!r} must broadcast"
        with pytest.raises(ConfigError, match="req_func must be callable"):
            ps.update("c", None)
        ctx.term()
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=free_port()) as other:
        other.load_metas(saved)
        assert other.get_metas() == saved


def test_a_req_func_failure_is_published_under_its_own_rank():
    """The store's abort flag names the rank whose req_func raised (it used to say rank 0)."""
    from ckpt_core.transfer.signals import ReqThread, StopSignal

    class Store(dict):
        def set(self, key, value):
            self[key] = value

    def boom(handles):
        raise RuntimeError("no engine here")

    req = ReqThread(boom, [("K", "h")])
    req.start()
    req.join(10)
    store = Store()
    signal = StopSignal(store, "abort", 3, req, logging.getLogger("test"))
    assert "req_func raised" in signal.should_stop() and "no engine here" in signal.should_stop()
    assert store == {"abort": "rank 3: req_func raised: RuntimeError: no engine here"}


def test_an_update_to_a_dead_engine_says_which_url_and_why_in_its_message():
    """The error names the URL and the cause ("connection refused"), not only that req_func
    raised; the traceback stays in remote_traceback."""
    from support.ports import free_port
    from ckpt_core import ParameterServer, RemoteWorkerError, request_inference_to_update

    url = f"http://127.0.0.1:{free_port()}/collective_rpc"   # nothing listens there
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=free_port()) as ps:
        ps.register_checkpoint("c", named_tensors={"w": torch.randn(64)})
        ps.gather_metas("c")
        with pytest.raises(RemoteWorkerError) as info:
            ps.update("c", lambda handles: request_inference_to_update(url, dict(handles), timeout=10), timeout=30)
    message = str(info.value).split("--- remote traceback ---")[0]
    assert url.removesuffix("/collective_rpc") in message and "POST /collective_rpc" in message, message
    assert "ConnectError" in message and "refused" in message.lower(), message
    assert info.value.remote_traceback and "Traceback" in info.value.remote_traceback
