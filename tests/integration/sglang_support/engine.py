"""An SGLang "server" on CPU: SGLang's real HTTP app and update path around its real Qwen2 model.

Run with the SGLang venv's python (``scripts/sglang_env.sh``), with the repo, ``tests`` and
``tests/integration`` on PYTHONPATH::

    python -m sglang_support.engine --model-dir DIR --port P

SGLang's server does not run on these CPUs (its kernels need AVX512/AMX), so its scheduler and
tokenizer processes are replaced by one in-process stand-in (``ManagerStandIn``) whose methods
ARE SGLang's: ``TokenizerControlMixin.update_weights_from_ipc``/``flush_cache`` and
``TokenizerManager.pause_generation``/``continue_generation`` run on it, and it forwards to
SGLang's real ``SchedulerWeightUpdaterManager``, model-runner ``WeightUpdater`` and
``SGLangCheckpointEngineWorkerExtensionImpl``, which calls the stock
``checkpoint_engine.worker.update_weights_from_ipc`` (PyPI, 0.4.2) with the model's real
``load_weights``. What is stood in: the request queue (a count of "requests in flight" a test
sets with ``POST /ckpt_test/busy``), SGLang's CPU device key (its CPU platform answers the
machine arch; our PS keys CPU ranks ``CPU-<machine id>-<index>``), the stock DeviceManager
(``tests/support/stock_cpu_device.py``) and ``vllm._custom_ops`` (imported by SGLang's rotary embedding).
``GET /ckpt_test/digests`` reports a digest of every parameter (and the weight version, the
pause mode and how many cache flushes were asked for); ``GET /ckpt_test/cold_digests`` those of a
cold load of a checkpoint directory into a fresh model (``probes.py``).

Tensor parallelism (``--tp-size N``, one process per ``--tp-rank``; ``fixtures.SglangEngine``
starts them): every rank builds SGLang's own gloo groups and its shard of the model, rank 0 serves
HTTP and broadcasts each scheduler call to the others as SGLang's scheduler does (``tp.py``); the
digests then come per rank (``"ranks"``).

Staged updates: the server args name ``--custom-weight-loader ckpt_sglang.staging.load``, and
SGLang's own ``begin_weight_update``/``update_weights_from_tensor``/``end_weight_update``/
``update_weight_version`` methods run on the stand-in, into the real managers and
``WeightUpdater`` (which imports and calls our loader by that name). ``ckpt_sglang.probe.load`` is
named too (``SglangClient.state_digests``).

Weight-update sessions (``sessions.py``): ``events`` in ``/ckpt_test/digests`` lists the weight
calls the scheduler received, in order, each marked when it came inside a weight-update session
(rank 0's; every rank's in ``rank_events``; ``session_open``: a session is open on some rank).
``--without-sessions`` drops SGLang's ``/begin_weight_update`` and ``/end_weight_update`` routes:
the route table of SGLang 0.5.17 (whose IPC route loads without a session, as 0.5.23's does), and
its tensor route, which loads (our loaders included) without asking for a session and runs no
post-processing, on every TP rank.

Generation is stood in too (SGLang's forward needs its CPU kernels): ``DecoderStandIn`` is the
scheduler's loop, one greedy decode step per running request at a time, under the lock that the
weight-update calls take (SGLang's scheduler is one thread: an update runs between steps), and
idle while generation is paused. A step is Hugging Face's Qwen2 forward on SGLang's *live*
parameters (q/k/v and gate/up split back out of SGLang's fused ones), so its tokens change exactly
when SGLang's parameters do. ``POST /ckpt_test/generate`` runs one request through it (tokens,
per-token weight version and time); ``GET /ckpt_test/traffic`` counts the steps taken.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import types


def _stub_vllm_ops() -> None:
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = None   # SGLang falls back to its native rotary embedding
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def build_model(model_dir: str, port: int, tp_size: int = 1, tp_rank: int = 0):
    """SGLang's runtime context, its gloo world of ``tp_size`` (TP group included), and this rank's
    shard of its Qwen2ForCausalLM (random init)."""
    _stub_vllm_ops()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish
    from sglang_support.tp import cpu_model_parallel

    server_args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True, dtype="float32",
                             load_format="dummy", checkpoint_engine_wait_weights_before_ready=True,
                             custom_weight_loader=["ckpt_sglang.staging.load", "ckpt_sglang.probe.load"],
                             tp_size=tp_size)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
    init_distributed_environment(backend="gloo", world_size=tp_size, rank=tp_rank, local_rank=tp_rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port + 1}",
                                 timeout=3600)   # ranks 1.. wait in a broadcast for rank 0's next call
    cpu_model_parallel()
    initialize_model_parallel(backend="gloo")
    model_config = ModelConfig.from_server_args(server_args)
    model = Qwen2ForCausalLM(model_config.hf_config)
    return server_args, model_config, model


class SchedulerStandIn:
    """The scheduler's state that the weight-update path reads: requests in flight, pause mode."""

    def __init__(self, model):
        self.model, self.busy, self.paused, self.weight_version = model, 0, None, None
        self.flushes = 0   # cache flushes asked for (the update's flush_cache, /flush_cache)
        self.weight_updater = None   # the model runner's real WeightUpdater, set by main()
        self.lock = threading.RLock()   # one scheduler thread: decode steps and weight calls alternate
        self.decoder = None             # DecoderStandIn, set by main()
        self.events: list[str] = []     # weight calls received: "ipc", "begin", "tensor (in session)", ...

    @property
    def running(self) -> int:   # requests a test declared busy, plus the decoder's running ones
        return self.busy + (self.decoder.active() if self.decoder is not None else 0)

    def deserialize_own_rank(self, serialized_named_tensors):   # the tp worker's, SGLang's own code
        from sglang.srt.managers.tp_worker import TpModelWorker
        return TpModelWorker.deserialize_own_rank(self, serialized_named_tensors)

    # what SchedulerWeightUpdaterManager calls
    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.flushes += 1
        return self.running == 0 or self.paused in ("retract", "abort")

    def is_fully_idle(self, **_kw) -> bool:
        return self.running == 0

    def record_weight_version_change(self, new_version=None) -> None:
        if new_version is not None:   # as SGLang's scheduler: None leaves the version
            self.weight_version = new_version

    def weight_update_runners(self):   # the tp worker's runners
        return [("target", self)]


def hf_state(model, config) -> dict:
    """Hugging Face Qwen2 names for SGLang's live parameters (views; q/k/v and gate/up split out)."""
    hd = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out = {}
    for name, p in model.named_parameters():
        if ".qkv_proj." in name:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.data.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), p.data.chunk(2)):
                out[name.replace("gate_up_proj", part)] = t
        else:
            out[name] = p.data
    return out


class DecoderStandIn:
    """The scheduler's decode loop (see the module docstring): greedy, one step per request in turn."""

    def __init__(self, scheduler: SchedulerStandIn, model_dir: str):
        import torch
        from transformers import AutoConfig, Qwen2ForCausalLM

        self.torch, self.scheduler = torch, scheduler
        self.config = AutoConfig.from_pretrained(model_dir)
        self.hf = Qwen2ForCausalLM(self.config).eval()
        self.requests: list[dict] = []
        self.steps = 0
        self._cv = threading.Condition()
        threading.Thread(target=self._loop, name="decoder", daemon=True).start()

    def active(self) -> int:
        with self._cv:
            return len(self.requests)

    def submit(self, prompt: list[int], max_new_tokens: int) -> dict:
        req = {"ids": list(prompt), "left": int(max_new_tokens), "tokens": [], "versions": [], "times": [],
               "done": threading.Event()}
        with self._cv:
            self.requests.append(req)
            self._cv.notify()
        return req

    def _loop(self) -> None:
        torch = self.torch
        while True:
            with self._cv:
                while not self.requests:
                    self._cv.wait()
            if self.scheduler.paused is not None:   # paused: running requests wait, none is dropped
                time.sleep(0.002)
                continue
            with self.scheduler.lock, torch.no_grad():
                self.hf.load_state_dict(hf_state(self.scheduler.model, self.config), strict=True)
                with self._cv:
                    batch = list(self.requests)
                for req in batch:
                    nxt = int(self.hf(torch.tensor([req["ids"]])).logits[0, -1].argmax())
                    req["ids"].append(nxt)
                    req["tokens"].append(nxt)
                    req["versions"].append(self.scheduler.weight_version)
                    req["times"].append(time.time())
                    req["left"] -= 1
                    self.steps += 1
                    if req["left"] <= 0:
                        with self._cv:
                            self.requests.remove(req)
                        req["done"].set()


def make_manager(server_args, model_config, scheduler: SchedulerStandIn, fanout):
    """The tokenizer manager stand-in of rank 0; ``fanout`` (``tp.FanOut``) runs each scheduler call
    on every TP rank."""
    from sglang.srt.managers.io_struct import (ContinueGenerationReqInput, FlushCacheReqOutput,
                                               PauseGenerationReqInput, UpdateWeightVersionReqOutput)
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.aio_rwlock import RWLock

    class ManagerStandIn:
        """Plays TokenizerManager for the routes used; the methods below are SGLang's own."""
        update_weights_from_ipc = TokenizerControlMixin.update_weights_from_ipc
        update_weights_from_tensor = TokenizerControlMixin.update_weights_from_tensor
        begin_weight_update = TokenizerControlMixin.begin_weight_update
        end_weight_update = TokenizerControlMixin.end_weight_update
        _weight_update_session_call = TokenizerControlMixin._weight_update_session_call
        update_weight_version = TokenizerControlMixin.update_weight_version
        flush_cache = TokenizerControlMixin.flush_cache
        _update_weight_version_if_provided = TokenizerControlMixin._update_weight_version_if_provided
        pause_generation = TokenizerManager.pause_generation
        continue_generation = TokenizerManager.continue_generation
        record_config_updates = TokenizerManager.record_config_updates
        config_value = TokenizerManager.config_value

        def __init__(self):
            self.server_args, self.model_config = server_args, model_config
            self.model_path = self.served_model_name = server_args.model_path
            self.is_generation, self.mm_processor, self.initial_weights_loaded = True, None, False
            self.model_update_lock, self.is_pause, self.is_pause_cond = RWLock(), False, asyncio.Condition()
            self.startup_time = time.time()

        def auto_create_handle_loop(self) -> None:
            pass

        def abort_request(self, abort_all: bool = False, **_kw) -> None:
            scheduler.busy = 0

        async def get_internal_state(self):
            return [{}]

        async def _on_scheduler(self, name, obj):   # between decode steps, as SGLang's scheduler runs it
            return [await on_scheduler(scheduler, fanout, name, obj)]

        async def update_weights_from_ipc_communicator(self, obj):
            return await self._on_scheduler("update_weights_from_ipc", obj)

        async def update_weights_from_tensor_communicator(self, obj):
            return await self._on_scheduler("update_weights_from_tensor", obj)

        async def begin_weight_update_communicator(self, obj):
            return await self._on_scheduler("begin_weight_update", obj)

        async def end_weight_update_communicator(self, obj):
            return await self._on_scheduler("end_weight_update", obj)

        async def update_weight_version_communicator(self, obj):
            scheduler.record_weight_version_change(obj.new_version)
            return [UpdateWeightVersionReqOutput()]

        async def flush_cache_communicator(self, _req):
            return [FlushCacheReqOutput(success=scheduler.flush_cache())]

        async def _async_dispatch_to_scheduler(self, obj) -> None:
            if isinstance(obj, PauseGenerationReqInput):
                scheduler.paused = obj.mode
            elif isinstance(obj, ContinueGenerationReqInput):
                scheduler.paused = None

    return ManagerStandIn()


async def on_scheduler(scheduler: SchedulerStandIn, fanout, name: str, obj=None):
    """Run scheduler call ``name`` on every TP rank, in the scheduler's turn (between decode steps)."""
    def call():
        with scheduler.lock:
            return fanout.call(name, obj)
    return await asyncio.to_thread(call)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--without-sessions", action="store_true",
                    help="drop /begin_weight_update and /end_weight_update: the route table of SGLang 0.5.17")
    args = ap.parse_args()
    server_args, model_config, model = build_model(args.model_dir, args.port, args.tp_size, args.tp_rank)

    import checkpoint_engine.worker as stock
    from sglang.srt.checkpoint_engine.checkpoint_engine_worker import SGLangCheckpointEngineWorkerExtensionImpl
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from ckpt_core import local_device_key
    from sglang_support.probes import probe_calls
    from sglang_support.sessions import scheduler_calls
    from sglang_support.tp import FanOut
    from support import stock_cpu_device as cpu_device

    cpu_device.install(stock)
    SGLangCheckpointEngineWorkerExtensionImpl.get_device_uuid = lambda self: local_device_key("cpu", args.tp_rank)
    scheduler = SchedulerStandIn(model)
    scheduler.weight_updater = WeightUpdater(
        tp_rank=args.tp_rank, device="cpu", gpu_id=0, model_config=model_config,
        custom_weight_loaders=server_args.custom_weight_loader,
        get_model=lambda: model, update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: scheduler)
    fanout = FanOut({**scheduler_calls(scheduler, args.without_sessions),
                     **probe_calls(model, model_config, args.tp_rank)})
    if args.tp_rank > 0:   # a scheduler of another TP rank: it runs what rank 0 broadcasts
        print(f"engine pid {os.getpid()}: TP rank {args.tp_rank} of {args.tp_size}", flush=True)
        fanout.serve()
    serve_http(args, server_args, model_config, scheduler, fanout)


def serve_http(args, server_args, model_config, scheduler: SchedulerStandIn, fanout) -> None:
    """Rank 0: SGLang's HTTP app over the tokenizer-manager stand-in, and the test routes."""
    import uvicorn
    from fastapi import Body, HTTPException, Query
    from sglang.srt.entrypoints import http_server

    manager = make_manager(server_args, model_config, scheduler, fanout)
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=manager, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app
    if args.without_sessions:
        gone = ("/begin_weight_update", "/end_weight_update")
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in gone]

    @app.get("/ckpt_test/digests")
    async def digests():
        ranks = await on_scheduler(scheduler, fanout, "ckpt_test_digests")
        calls = await on_scheduler(scheduler, fanout, "ckpt_test_weight_calls")
        return {"params": ranks[0], "ranks": ranks, "weight_version": scheduler.weight_version,
                "paused": scheduler.paused, "flushes": scheduler.flushes, "events": calls[0]["events"],
                "rank_events": [c["events"] for c in calls], "session_open": any(c["session_open"] for c in calls)}

    @app.get("/ckpt_test/cold_digests")
    async def cold_digests(model_dir: str = Query(...)):
        """Every rank's parameters after a cold load of ``model_dir`` into a fresh shard of the model."""
        return {"ranks": await on_scheduler(scheduler, fanout, "ckpt_test_cold_digests", model_dir)}

    @app.get("/ckpt_test/cold_state")
    async def cold_state(model_dir: str = Query(...)):
        """Every rank's parameters and buffers (``ckpt_sglang._digest.state_digests``, as the probe loader
        reports them) after a cold load of ``model_dir`` into a fresh shard of the model."""
        return {"ranks": await on_scheduler(scheduler, fanout, "ckpt_test_cold_state", model_dir)}

    @app.post("/ckpt_test/env")
    async def setenv(body: dict = Body(...)):
        """Set (or, with null, unset) environment variables of every rank's process."""
        return (await on_scheduler(scheduler, fanout, "ckpt_test_setenv", body))[0]

    @app.post("/ckpt_test/busy")
    async def busy(n: int = Query(0)):
        scheduler.busy = n
        return {"running": n}

    if args.tp_size == 1:   # its steps run Hugging Face's Qwen2 on the whole (unsharded) parameters
        scheduler.decoder = DecoderStandIn(scheduler, args.model_dir)

    @app.post("/ckpt_test/next_stage")
    async def next_stage(fail_after: int = Query(-1), slow_s: float = Query(0.0), fail_seal: bool = Query(False),
                         rank: int = Query(-1)):
        """See ``probes.probe_calls``' ``next_stage``."""
        arg = {"fail_after": fail_after, "slow_s": slow_s, "fail_seal": fail_seal, "rank": rank}
        await on_scheduler(scheduler, fanout, "ckpt_test_next_stage", arg)
        return arg

    @app.post("/ckpt_test/next_commit")
    async def next_commit(fail_rank: int = Query(...)):
        """See ``probes.probe_calls``' ``next_commit``."""
        return (await on_scheduler(scheduler, fanout, "ckpt_test_next_commit", {"fail_rank": fail_rank}))[fail_rank]

    @app.post("/ckpt_test/generate")
    async def generate(body: dict = Body(...)):
        req = scheduler.decoder.submit(body["prompt"], body.get("max_new_tokens", 8))
        if not await asyncio.to_thread(req["done"].wait, float(body.get("timeout", 120))):
            raise HTTPException(504, "generation did not finish")
        return {k: req[k] for k in ("tokens", "versions", "times")}

    @app.get("/ckpt_test/traffic")
    async def traffic():
        return {"steps": scheduler.decoder.steps, "running": scheduler.decoder.active()}

    print(f"engine pid {os.getpid()} serving on 127.0.0.1:{args.port}", flush=True)
    # lifespan off: its startup builds the tokenizer, OpenAI handlers and the warmup thread of a full
    # server; the routes used here read only the global state set above
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
