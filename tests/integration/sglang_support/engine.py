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
(``stock_cpu_device.py``) and ``vllm._custom_ops`` (imported by SGLang's rotary embedding).
``GET /ckpt_test/digests`` reports a digest of every parameter (and the weight version, the
pause mode and how many cache flushes were asked for).

Staged updates: the server args name ``--custom-weight-loader ckpt_sglang.staging.load``, and
SGLang's own ``begin_weight_update``/``update_weights_from_tensor``/``end_weight_update``/
``update_weight_version`` methods run on the stand-in, into the real managers and
``WeightUpdater`` (which imports and calls our loader by that name).

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
import hashlib
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


def digest(t) -> str:   # same format as tests/harness.py's digest
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest() \
        + f"|{t.dtype}|{tuple(t.shape)}"


def build_model(model_dir: str, port: int):
    """SGLang's runtime context, a gloo world of 1, and its Qwen2ForCausalLM (random init)."""
    _stub_vllm_ops()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    server_args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True, dtype="float32",
                             load_format="dummy", checkpoint_engine_wait_weights_before_ready=True,
                             custom_weight_loader=["ckpt_sglang.staging.load"])
    publish(server_args, role="scheduler")
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port + 1}")
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


def make_manager(server_args, model_config, scheduler: SchedulerStandIn):
    from sglang.srt.managers.io_struct import (ContinueGenerationReqInput, FlushCacheReqOutput,
                                               PauseGenerationReqInput, UpdateWeightVersionReqOutput)
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.aio_rwlock import RWLock

    updater = SchedulerWeightUpdaterManager(tp_worker=scheduler, draft_worker=None, memory_saver_adapter=None,
                                            flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle,
                                            scheduler=scheduler)

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

        async def _on_scheduler(self, fn, *args):   # between decode steps, as SGLang's scheduler runs it
            def call():
                with scheduler.lock:
                    return fn(*args)
            return [await asyncio.to_thread(call)]

        async def update_weights_from_ipc_communicator(self, obj):
            return await self._on_scheduler(updater.update_weights_from_ipc, obj)

        async def update_weights_from_tensor_communicator(self, obj):
            return await self._on_scheduler(updater.update_weights_from_tensor, obj)

        async def begin_weight_update_communicator(self, obj):
            return await self._on_scheduler(updater.begin_weight_update, obj)

        async def end_weight_update_communicator(self, obj):
            return await self._on_scheduler(updater.end_weight_update, obj)

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    server_args, model_config, model = build_model(args.model_dir, args.port)

    import checkpoint_engine.worker as stock
    import uvicorn
    from fastapi import Body, HTTPException, Query
    from sglang.srt.checkpoint_engine.checkpoint_engine_worker import SGLangCheckpointEngineWorkerExtensionImpl
    from sglang.srt.entrypoints import http_server
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from ckpt_core import local_device_key
    import stock_cpu_device as cpu_device

    cpu_device.install(stock)
    SGLangCheckpointEngineWorkerExtensionImpl.get_device_uuid = lambda self: local_device_key("cpu", 0)
    scheduler = SchedulerStandIn(model)
    scheduler.weight_updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=model_config,
        custom_weight_loaders=server_args.custom_weight_loader,
        get_model=lambda: model, update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: scheduler)
    manager = make_manager(server_args, model_config, scheduler)
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=manager, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app

    @app.get("/ckpt_test/digests")
    async def digests():
        return {"params": {n: digest(p) for n, p in model.named_parameters()},
                "weight_version": scheduler.weight_version, "paused": scheduler.paused,
                "flushes": scheduler.flushes}

    @app.post("/ckpt_test/busy")
    async def busy(n: int = Query(0)):
        scheduler.busy = n
        return {"running": n}

    scheduler.decoder = DecoderStandIn(scheduler, args.model_dir)

    @app.post("/ckpt_test/next_stage")
    async def next_stage(fail_after: int = Query(-1), slow_s: float = Query(0.0)):
        """The next stage's receiver raises after staging ``fail_after`` buckets (a worker failing
        mid-way), and/or takes ``slow_s`` longer per bucket (a big checkpoint's transfer, which
        outlasts the pause that opens the stage; the tiny one here would not)."""
        import ckpt_sglang.staging as staging
        real = staging.StagingArea

        class TestArea(real):
            def add(self, weights):
                staging.StagingArea = real   # one stage only
                if 0 <= fail_after <= len(self.buckets):
                    raise RuntimeError(f"injected failure after {fail_after} staged bucket(s)")
                time.sleep(slow_s)
                super().add(weights)

        staging.StagingArea = TestArea
        return {"fail_after": fail_after, "slow_s": slow_s}

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
