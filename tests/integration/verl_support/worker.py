"""One verl worker process, run under ``CKPT_VERL_PYTHON`` (scripts/verl_env.sh) by world.py.

    python worker.py trainer|rollout   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: its side's group)

A **trainer** is what verl's ``ActorRolloutRefWorker`` is to the checkpoint engine: a rank of the
actor's torch.distributed group that builds the backend exactly as verl's ``init_model`` does
(``import_external_libs(custom_backend_module)``, then ``CheckpointEngineRegistry.new(backend,
is_master=rank == 0, bucket_size=..., **engine_kwargs)``) and hands ``send_weights`` a generator of
its model's full tensors (a tiny Qwen2, fresh random weights per round, alike on every rank as
after FSDP's ``full_tensor``). A **rollout** is verl's own ``CheckpointEngineWorker`` (it loads
the backend through verl's registry and makes its gloo group), with a server adapter that loads
every received tensor into a live tiny Qwen2 (a ``BaseRollout``, as vLLM's adapter is).

Commands arrive as JSON lines on stdin; each answer is one line ``@@ {json}`` on stdout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# ~6.5 M parameters, 13 MiB in bf16: with verl's smallest bucket (1 MiB) a round is 13+ buckets, so
# a process killed a few tensors into the load still has most of the round ahead of it.
QWEN2 = dict(vocab_size=384, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**QWEN2)).to(torch.bfloat16).eval()


def randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.state_dict().items()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def digests(model) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in model.state_dict().items()}


def ce_config(engine_kwargs: dict):
    from verl.workers.config import CheckpointEngineConfig
    return CheckpointEngineConfig(backend="ckpt", update_weights_bucket_megabytes=1, custom_backend_module="ckpt_verl.backend",
                                  engine_kwargs={"ckpt": engine_kwargs})


class Trainer:
    def __init__(self, engine_kwargs: dict):
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
        dist.init_process_group("gloo")   # the actor group (env://)
        self.model = tiny_qwen2()
        cfg = ce_config(engine_kwargs)
        assert "ckpt_verl" not in sys.modules and cfg.backend not in CheckpointEngineRegistry._registry
        # verl/workers/engine_workers.py, ActorRolloutRefWorker.init_model, step 4, verbatim in effect:
        import_external_libs(cfg.custom_backend_module or None)
        self.engine = CheckpointEngineRegistry.new(cfg.backend, is_master=dist.get_rank() == 0,
                                                   bucket_size=cfg.update_weights_bucket_megabytes << 20,
                                                   **cfg.engine_kwargs.get(cfg.backend, {}))

    def call(self, method: str, *args, **kwargs):   # what execute_checkpoint_engine does
        return getattr(self.engine, method)(*args, **kwargs)

    def round(self, seed: int, step: int, bad: str | None = None) -> dict:
        randomize(self.model, seed)
        weights = ((n, t) for n, t in self.model.state_dict().items())
        if bad == "duplicate" and dist.get_rank() == 1:
            weights = (item for pair in ((n, t) for n, t in self.model.state_dict().items()) for item in (pair, pair))
        metrics = asyncio.run(self.engine.send_weights(weights, global_steps=step))
        return {"digests": digests(self.model), "metrics": metrics}


class SlowLoad:
    """Test behaviour of the rollout's load: sleep per tensor, and say (a file) when mid-transfer."""

    def __init__(self, sleep_s: float = 0.0, mark: str | None = None, after: int = 0):
        self.sleep_s, self.mark, self.after = sleep_s, mark, after


def rollout_adapter(model):
    from verl.workers.rollout.base import BaseRollout

    class ModelRollout(BaseRollout):
        """A rollout whose engine is a live HF model: every received tensor is copied into its parameter."""

        def __init__(self):   # BaseRollout's own __init__ only stores configs this adapter has no use for
            self.model, self.slow = model, SlowLoad()

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            assert wire_format == "named_tensors", wire_format
            live, seen = self.model.state_dict(), set()
            async for name, tensor in weights:
                assert name in live and name not in seen, name
                assert tensor.shape == live[name].shape and tensor.dtype == live[name].dtype, name
                live[name].copy_(tensor)
                seen.add(name)
                if self.slow.mark and len(seen) == self.slow.after:
                    Path(self.slow.mark).touch()
                if self.slow.sleep_s:
                    await asyncio.sleep(self.slow.sleep_s)
            assert seen == set(live), f"missing: {sorted(set(live) - seen)[:5]}"

        async def resume(self, tags):
            pass

        async def release(self):
            pass

    return ModelRollout()


class Rollout:
    def __init__(self, engine_kwargs: dict):
        from verl.checkpoint_engine import CheckpointEngineWorker
        from verl.workers.config import RolloutConfig
        self.model = tiny_qwen2()
        randomize(self.model, 999)   # weights no trainer sends: a round that loads nothing shows
        self.adapter = rollout_adapter(self.model)
        cfg = RolloutConfig(name="vllm", checkpoint_engine=ce_config(engine_kwargs))
        assert "ckpt_verl" not in sys.modules
        self.worker = CheckpointEngineWorker(rollout_config=cfg, model_config=None, server_adapter=self.adapter)
        self.engine = self.worker.checkpoint_engine

    def call(self, method: str, *args, **kwargs):
        return self.worker.execute_checkpoint_engine(method, *args, **kwargs)

    def round(self, seed: int, step: int, slow: dict | None = None) -> dict:
        self.adapter.slow = SlowLoad(**(slow or {}))
        asyncio.run(self.worker.update_weights(global_steps=step))
        return {"digests": digests(self.model), "result": _plain(self.engine.last_result)}


def _plain(obj):
    return json.loads(json.dumps(obj, default=str)) if obj is not None else None


def serve(side: str) -> None:
    engine_kwargs = json.loads(os.environ.get("CKPT_VERL_ENGINE_KWARGS", "{}"))
    me = None
    for line in sys.stdin:
        cmd = json.loads(line)
        t0 = time.monotonic()
        try:
            op = cmd["op"]
            if op == "start":
                me = (Trainer if side == "trainer" else Rollout)(engine_kwargs)
                value = {"module": type(me.engine).__module__, "class": type(me.engine).__name__}
            elif op == "call":
                value = me.call(cmd["method"], *cmd.get("args", []), **cmd.get("kwargs", {}))
            elif op == "topology":   # what CheckpointEngineManager.build_process_group does with the metadata
                from verl.checkpoint_engine import CheckpointEngineRegistry
                actor, rollout = CheckpointEngineRegistry.get("ckpt").build_topology(*cmd["args"])
                value = [actor, rollout]
            elif op == "round":
                value = me.round(**cmd["kwargs"])
            elif op == "close":
                me.engine.close()
                value = None
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "value": value}
        except BaseException as exc:   # noqa: BLE001 - reported to the test
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc),
                     "mro": [c.__name__ for c in type(exc).__mro__], "traceback": traceback.format_exc()}
        reply["seconds"] = time.monotonic() - t0
        print("@@ " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
