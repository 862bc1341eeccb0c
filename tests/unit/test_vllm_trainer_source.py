"""What each trainer rank registers per round (ckpt_vllm._trainer_source), the trainer side's init
info and the translation of a client's failures: pure, no vLLM (the project venv has none)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from ckpt_core import TensorShard
from ckpt_core.errors import ConfigError, RemoteWorkerError, TransportError, UpdateTimeoutError
from ckpt_vllm._trainer_source import round_tensors


def fresh(n: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"layers.{i}.w": torch.randn(3, 4, generator=gen) + 5 for i in range(n)}


class Source:
    def __init__(self, tensors, held=None, order=None):
        self.tensors, self.held, self.order = tensors, held, order

    def metadata(self):
        return [SimpleNamespace(name=n, dtype=t.dtype, shape=t.shape) for n, t in self.tensors.items()]

    def held_names(self):
        return self.held

    def __iter__(self):
        for name in self.order or self.tensors:
            t = self.tensors[name]
            yield name, (t if self.held is None or name in self.held else None)


def test_a_replicated_weight_source_is_dealt_round_robin_and_every_tensor_lands_on_exactly_one_rank():
    tensors = fresh(7)
    shares = [round_tensors(Source(tensors), r, 3) for r in range(3)]
    assert [sorted(s.tensors) for s in shares] == [sorted(list(tensors)[r::3]) for r in range(3)]
    assert shares[0].expected == list(tensors) and len({s.layout for s in shares}) == 1
    assert all(torch.equal(s.tensors[n], tensors[n]) for s in shares for n in s.tensors)


def test_held_names_decide_what_a_rank_registers():
    tensors = fresh(4)
    share = round_tensors(Source(tensors, held={"layers.1.w", "layers.3.w"}), 0, 2)
    assert sorted(share.tensors) == ["layers.1.w", "layers.3.w"]


def test_a_source_that_strays_from_its_metadata_is_refused_naming_the_position():
    tensors = fresh(3)
    with pytest.raises(ConfigError, match="yielded 'layers.1.w' at position 0"):
        round_tensors(Source(tensors, order=["layers.1.w", "layers.0.w", "layers.2.w"]), 0, 1)
    with pytest.raises(ConfigError, match="yielded 2 tensors; metadata\\(\\) lists 3"):
        round_tensors(Source(tensors, order=["layers.0.w", "layers.1.w"]), 0, 1)


def test_named_tensors_replicated_go_round_robin_over_sorted_names_and_pieces_stay_on_their_rank():
    tensors = fresh(4)
    piece = TensorShard(torch.ones(2, 4), (4, 4), (2 * 1, 0))
    named = dict(tensors, **{"pieced": piece})
    share = round_tensors(named, 1, 2)
    names = sorted(named)
    assert sorted(n for n in share.tensors if n != "pieced") == sorted(n for n in names[1::2] if n != "pieced")
    assert share.tensors["pieced"] is piece and share.expected == names
    own = round_tensors(list(tensors.items()), 1, 2, replicated=False)
    assert sorted(own.tensors) == sorted(tensors) and own.expected is None and own.layout == "own"


@pytest.mark.parametrize("bad, match", [
    ((t for t in []), "generator is consumed once"),
    ([("a", torch.ones(1)), ("a", torch.ones(1))], "name a tensor twice"),
    ({"a": [1, 2]}, "'a' is a list, not a tensor"),
    ({"": torch.ones(1)}, "non-empty string"),
    (None, "no weights to send"),
])
def test_weights_that_cannot_be_sent_are_a_config_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        round_tensors(bad, 0, 1)


def test_the_layout_digest_tells_two_models_apart():
    a, b = fresh(3), fresh(4)
    assert round_tensors(a, 0, 1).layout == round_tensors(dict(a), 0, 1).layout != round_tensors(b, 0, 1).layout


def test_the_trainer_module_imports_without_vllm_and_validates_its_init_info():
    from ckpt_vllm import trainer

    assert "vllm" not in sys.modules and not trainer.HAS_TRAINER_FACTORY   # the project venv has no vLLM
    info = trainer.CkptTrainerInitInfo(rank=1, world_size=2)
    assert info.backend == "ckpt" and not info.is_sender
    for bad in ({"rank": -1}, {"rank": 2, "world_size": 2}, {"rank": 0, "timeout_s": 0},
                {"rank": 0, "commit_pause": "later"}, {"rank": 0, "version_prefix": "a@b"}):
        with pytest.raises(ConfigError):
            trainer.CkptTrainerInitInfo(**bad)


def test_stage_and_slices_without_an_endpoint_are_refused_before_any_process_group():
    from ckpt_vllm.trainer import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

    client = SimpleNamespace(**{m: (lambda *a, **k: None) for m in (
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")})
    with pytest.raises(ConfigError, match="need the server's HTTP address"):
        CkptTrainerWeightTransferEngine.trainer_init(CkptTrainerInitInfo(rank=0, stage=True), client=client)
    with pytest.raises(ConfigError, match="lacks \\['finish_weight_update'\\]"):
        del client.finish_weight_update
        CkptTrainerWeightTransferEngine.trainer_init(CkptTrainerInitInfo(rank=0), client=client)


class HTTPError(Exception):
    def __init__(self):
        super().__init__("500 Server Error")
        self.response = SimpleNamespace(status_code=500, text='{"error": "nothing arrived for lm_head.weight"}')


class ReadTimeout(Exception):
    pass


class ConnectionError_(OSError):
    pass


@pytest.mark.parametrize("exc, kind, text", [
    (HTTPError(), RemoteWorkerError, "answered HTTP 500: {\"error\": \"nothing arrived for lm_head.weight\"}"),
    (ReadTimeout("read timed out"), UpdateTimeoutError, "did not answer update_weights in time"),
    (ConnectionError_("refused"), TransportError, "cannot reach http://h:1 for update_weights"),
    (ValueError("odd"), RemoteWorkerError, "update_weights on http://h:1 failed: ValueError: odd"),
])
def test_a_clients_failure_becomes_one_of_ckpt_engines_errors(exc, kind, text):
    from ckpt_vllm._trainer_sender import translated

    got = translated("update_weights", "http://h:1", exc)
    assert type(got) is kind and text in str(got)


def test_auto_on_device_takes_a_share_only_when_every_tensor_lies_contiguous_on_the_ps_device():
    from ckpt_vllm._trainer_source import device_resident
    dev = torch.device("meta")   # a device other than the CPU, present without a GPU
    on = {"a": torch.empty(3, 4, device=dev), "b": TensorShard(torch.empty(2, 4, device=dev), (4, 4), (2, 0))}
    assert device_resident(on, dev)
    assert not device_resident({}, dev), "an empty share stays in the pool"
    assert not device_resident(dict(on, c=torch.empty(4, 3, device=dev).t()), dev), "not contiguous"
    assert not device_resident(dict(on, c=torch.zeros(3)), dev), "one tensor on the host"
    assert not device_resident(fresh(), torch.device("cpu")), "the cpu kind keeps its weights in the pool"


def test_on_device_must_be_a_bool_or_none_and_refuses_p2p_services():
    from ckpt_core.errors import DeviceResidentError
    from ckpt_vllm.trainer import CkptTrainerInitInfo
    assert CkptTrainerInitInfo(rank=0).on_device is None
    with pytest.raises(ConfigError, match="on_device"):
        CkptTrainerInitInfo(rank=0, on_device="yes")
    with pytest.raises(DeviceResidentError, match="p2p_services"):
        CkptTrainerInitInfo(rank=0, on_device=True, p2p_services="http://h:1")
    assert CkptTrainerInitInfo(rank=0, on_device=False, p2p_services="http://h:1").on_device is False


def test_a_failed_direct_round_marks_vllms_weight_version_mixed_over_real_http():
    """The trainer's direct round posts vLLM's routes; once ``/update_weights`` was posted and failed, layers
    reloaded before the failure may hold the new weights, so vLLM's own weight version (on its outputs) is
    set to ``mixed_weight_version`` of the round's version instead of still naming the last good one. A
    real HTTP server stands in for the vLLM server's ``/update_weight_version`` route."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ckpt_core.engines.base import mixed_weight_version
    from ckpt_vllm._trainer_sender import Sender

    posted: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):   # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            posted.append((self.path, json.loads(body or b"{}")))
            out = b'{"success": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    calls: list = []

    def update_weights(info):
        calls.append("update_weights")
        raise HTTPError()

    client = SimpleNamespace(base_url=f"http://127.0.0.1:{server.server_address[1]}",
                             init_weight_transfer_engine=lambda info: calls.append("init"),
                             start_weight_update=lambda: calls.append("start"), update_weights=update_weights,
                             finish_weight_update=lambda *a: calls.append("finish"))
    info = SimpleNamespace(engine_url=None, timeout_s=30.0, stage=False, reset_prefix_cache=False)
    sender = Sender(info)
    try:
        with pytest.raises(RemoteWorkerError, match="update_weights on .* answered HTTP 500"):
            sender.round(client, {"GPU-0": "ipc://@x"}, "v7", None, threading.Event())
        assert calls == ["init", "start", "update_weights"]
        assert posted == [("/update_weight_version", {"new_version": mixed_weight_version("v7")})], posted
    finally:
        sender.close()
        server.shutdown()
        server.server_close()
