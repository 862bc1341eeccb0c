"""The vLLM worker extension under vllm-ascend: a worker that left ``device`` unset still receives.

A PS rank (npu kind, through the installed entry point) pushes a checkpoint; the engine
worker is a separate process that runs ``VllmColocateWorkerExtension.update_weights_from_ipc``
on an object shaped like vllm-ascend's worker with ``device = None``. Only vLLM's layerwise
reload is replaced (no vLLM here): a small session records what arrives.
"""

import json
import sys
import threading
from multiprocessing.connection import Listener

import pytest

from support.engine import AUTH
from support.world import FreshCheckpoints, PsWorld
from fakes.ascend_env import FAKES, ROOT, board_env, installed, run_py

WORKER = r"""
import hashlib, json, sys
import torch, torch_npu
torch.npu.set_device(0)   # the engine opened its NPU long ago; its worker object still says device=None
from ckpt_vllm import worker as ext

class Recorder:
    def __init__(self): self.digests, self.tensors, self.bytes, self.seconds, self.layout = {}, 0, 0, {}, {}
    def load(self, weights):
        for name, t in weights:
            self.layout[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
            self.digests[name] = hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                                                ).hexdigest() + f"|{t.dtype}|{tuple(t.shape)}"
            self.tensors += 1; self.bytes += t.numel() * t.element_size()
    def begin(self): pass
    def check_plan(self, names): list(names)
    def check_whole_layers(self, names): list(names)
    def check_complete(self): pass
    def finish(self): pass
    def abort(self): pass

rec = Recorder()
ext.new_sessions = lambda worker, replay=None, writes=None: [rec]   # stands in for vLLM's layerwise reload (begun)

class AscendWorker(ext.VllmColocateWorkerExtension):
    device = None
    local_rank = 0
    class model_runner: pass

w = AscendWorker()
out = w.update_weights_from_ipc(json.loads(HANDLES), timeout=60)
print(json.dumps({"device": str(w.device), "key": out["device_key"], "digests": rec.digests}))
"""


class OneEngineWorker:
    """Plays vLLM's /collective_rpc for one worker process: receives the handles, runs the worker."""

    def __init__(self, env: dict, paths: list):
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTH)
        self.address, self.env, self.paths = self.listener.address, env, paths
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.listener.accept() as c:
            handles, _ = c.recv()
            try:
                self.result = json.loads(run_py(WORKER.replace("HANDLES", repr(json.dumps(handles))), self.env,
                                                paths=self.paths))
                c.send([("ok", None)])
            except BaseException as exc:   # the PS must hear of it, not wait for its timeout
                self.error = str(exc)
                c.send([("error", self.error)])


def test_a_vllm_ascend_worker_with_no_device_receives_the_update_on_its_chip(installed, tmp_path, monkeypatch):
    env = board_env(tmp_path / "board", [0, 1], 1, visible="1")   # one chip per NPU; the PS sees chip 1 as npu:0
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "path", sys.path + [str(installed), str(FAKES)])
    worker_env = {**env, "ASCEND_RT_VISIBLE_DEVICES": "1"}
    with PsWorld("npu", 1) as world:
        name, want = FreshCheckpoints(world, seed=13).new()
        engine = OneEngineWorker(worker_env, [ROOT, installed, FAKES])
        got = world.update(name, engine, timeout=90)
        engine.thread.join(30)
        assert engine.error is None, engine.error
        assert got[0].ok, got
        assert engine.result["device"] == "npu:0", "the extension set the device the worker left unset"
        assert engine.result["key"] == world.device_uuids[0] and engine.result["key"].endswith("-1")
        assert engine.result["digests"] == want
