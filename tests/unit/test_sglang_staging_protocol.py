"""What our SGLang client and our loader inside SGLang say to each other (ckpt_sglang/_protocol.py),
and the client's refusal of a server that does not run the loader, over real sockets."""

from __future__ import annotations

import http.server
import json
import pickle
import base64
import threading

import pytest
import torch

from ckpt_core.errors import ConfigError, ProtocolError, RemoteWorkerError, UpdateTimeoutError
from ckpt_sglang import SglangClient
from ckpt_sglang._protocol import COMMAND_TENSOR, LOADER, ReplySocket, decode_command, encode_command, reply


def _named(payload: str):
    return pickle.loads(base64.b64decode(payload))   # what SGLang's SafeUnpickler reads (torch types only)


def test_a_command_is_one_uint8_tensor_of_json_per_tp_rank_and_decodes_back():
    payloads = encode_command("stage", "ipc://@x", 2, weights="v8", handles={"K": "ipc://@h"}, device_bytes=5)
    assert len(payloads) == 2 and payloads[0] == payloads[1]
    named = _named(payloads[0])
    assert [n for n, _ in named] == [COMMAND_TENSOR] and named[0][1].dtype == torch.uint8
    cmd = decode_command(named)
    assert cmd["op"] == "stage" and cmd["weights"] == "v8" and cmd["handles"] == {"K": "ipc://@h"}


@pytest.mark.parametrize("named, message", [
    ([], "expected one tensor"),
    ([("model.embed_tokens.weight", torch.zeros(2))], "expected one tensor"),
    ([(COMMAND_TENSOR, torch.frombuffer(bytearray(b"\xff\xfe"), dtype=torch.uint8))], "not JSON"),
    ([(COMMAND_TENSOR, torch.frombuffer(bytearray(b'{"format": "other"}'), dtype=torch.uint8))], "not a ckpt-sglang"),
    ([(COMMAND_TENSOR, torch.frombuffer(bytearray(json.dumps(
        {"format": "ckpt-sglang/command", "version": 1, "op": "rm", "reply": "x"}).encode()), dtype=torch.uint8))],
     "bad command"),
])
def test_anything_else_given_to_the_loader_is_a_protocol_error(named, message):
    with pytest.raises(ProtocolError, match=message):
        decode_command(named)


def test_replies_come_back_one_per_rank_in_rank_order_and_a_failing_rank_is_named():
    import zmq

    ctx = zmq.Context.instance()
    with ReplySocket() as sock:
        reply(ctx, sock.address, {"tp_rank": 1, "ok": True, "result": {"r": 1}})
        reply(ctx, sock.address, {"tp_rank": 0, "ok": True, "result": {"r": 0}})
        assert sock.collect("state", 2, 10, "srv") == [{"r": 0}, {"r": 1}]
        reply(ctx, sock.address, {"tp_rank": 0, "ok": False, "error": "nothing is staged", "error_type": "ConfigError",
                                  "traceback": "Traceback ..."})
        with pytest.raises(RemoteWorkerError, match=r"commit failed on TP rank\(s\) \[0\]: ConfigError: nothing"):
            sock.collect("commit", 1, 10, "srv")
        with pytest.raises(UpdateTimeoutError, match="1 of 1 rank"):
            sock.collect("drop", 1, 0.2, "srv")


class _ServerInfo(http.server.BaseHTTPRequestHandler):
    posts: list = []

    def do_GET(self):
        body = json.dumps({"custom_weight_loader": [], "tp_size": 1, "dp_size": 1}).encode()
        self.send_response(200 if self.path == "/server_info" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        type(self).posts.append(self.path)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


def test_a_server_without_our_loader_is_refused_before_anything_is_posted():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ServerInfo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with SglangClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout=10) as client:
            for call in (lambda: client.commit("v1"), lambda: client.stage({"K": "h"}, "v1"), client.drop_staged):
                with pytest.raises(ConfigError, match=f"not started with --custom-weight-loader {LOADER}"):
                    call()
        assert _ServerInfo.posts == [], "an unknown load_format would end SGLang's scheduler: nothing may be posted"
    finally:
        srv.shutdown()
        srv.server_close()
