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
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
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
                             load_format="dummy", checkpoint_engine_wait_weights_before_ready=True)
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
        self.model, self.running, self.paused, self.weight_version = model, 0, None, None
        self.flushes = 0   # cache flushes asked for (the update's flush_cache, /flush_cache)
        self.weight_updater = None   # the model runner's real WeightUpdater, set by main()

    # what SchedulerWeightUpdaterManager calls
    def flush_cache(self, empty_cache: bool = True) -> bool:
        self.flushes += 1
        return self.running == 0 or self.paused in ("retract", "abort")

    def is_fully_idle(self, **_kw) -> bool:
        return self.running == 0

    def record_weight_version_change(self, new_version=None) -> None:
        self.weight_version = new_version

    def weight_update_runners(self):   # the tp worker's runners
        return [("target", self)]


def make_manager(server_args, model_config, scheduler: SchedulerStandIn):
    from sglang.srt.managers.io_struct import (ContinueGenerationReqInput, FlushCacheReqOutput,
                                               PauseGenerationReqInput)
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

        def auto_create_handle_loop(self) -> None:
            pass

        def abort_request(self, abort_all: bool = False, **_kw) -> None:
            scheduler.running = 0

        async def update_weights_from_ipc_communicator(self, obj):
            return [await asyncio.to_thread(updater.update_weights_from_ipc, obj)]

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
    from fastapi import Query
    from sglang.srt.checkpoint_engine.checkpoint_engine_worker import SGLangCheckpointEngineWorkerExtensionImpl
    from sglang.srt.entrypoints import http_server
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from ckpt_core import local_device_key
    import stock_cpu_device as cpu_device

    cpu_device.install(stock)
    SGLangCheckpointEngineWorkerExtensionImpl.get_device_uuid = lambda self: local_device_key("cpu", 0)
    scheduler = SchedulerStandIn(model)
    scheduler.weight_updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=model_config, custom_weight_loaders={},
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
        scheduler.running = n
        return {"running": n}

    print(f"engine pid {os.getpid()} serving on 127.0.0.1:{args.port}", flush=True)
    # lifespan off: its startup builds the tokenizer, OpenAI handlers and the warmup thread of a full
    # server; the routes used here read only the global state set above
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
