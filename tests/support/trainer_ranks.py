"""Trainer ranks driving ``ckpt_vllm.trainer`` in real processes, into the simulated engine (``support.engine``).

Each rank process builds ``CkptTrainerWeightTransferEngine.trainer_init(CkptTrainerInitInfo(...),
client=FakeSyncClient(...), source=...)`` (vLLM's trainer factory needs vLLM, which the project
venv lacks; tests/integration/test_vllm_trainer_api.py drives the real one) and runs a list of
rounds. ``FakeSyncClient`` speaks vLLM's four-method ``VLLMWeightSyncClient`` protocol; its
``update_weights`` hands the ZeroMQ handles to ``support.engine.EngineFront`` (real engine-worker
processes running the core's receive loop), which is what a vLLM server's ``/update_weights``
makes its workers do. Rounds: ``("send", spec)``; the outcome of each goes back to the test.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch

from support.data import digest, fresh_tensors
from support.engine import make_req_func
from support.procs import CTX, run_world

SHAPES = {f"model.layers.{i}.{part}.weight": ((24, 16), torch.float32) for i in range(3) for part in ("q", "k", "mlp")}
SHAPES.update({"model.embed_tokens.weight": ((40, 16), torch.bfloat16), "model.norm.weight": ((16,), torch.float32)})


class FakeSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol in front of an ``EngineFront``; ``fail`` names a
    method that raises ``OSError`` (a connection refused), once."""

    def __init__(self, address, fail: str | None = None):
        self.address, self.fail, self.calls = address, fail, []

    def _maybe_fail(self, method: str) -> None:
        self.calls.append(method)
        if self.fail == method:
            self.fail = None
            raise ConnectionRefusedError(111, f"injected: {method} refused")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._maybe_fail("init_weight_transfer_engine")
        assert init_info["timeout_s"] > 0

    def start_weight_update(self) -> None:
        self._maybe_fail("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._maybe_fail("update_weights")
        assert update_info["check_complete"] is True
        make_req_func(self.address)(list(update_info["zmq_handles"].items()))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._maybe_fail(f"finish_weight_update {weight_version}")


class OldSyncClient(FakeSyncClient):
    """vLLM 0.26's client shape: ``finish_weight_update()`` takes no weight version."""

    def finish_weight_update(self) -> None:   # type: ignore[override]
        self._maybe_fail("finish_weight_update")


# A stand-in for vLLM 0.26's trainer API (its factory's earlier form, its base class taking a config)
FAKE_VLLM026 = Path(__file__).resolve().parents[1] / "fakes" / "vllm026"


def _trainer_engine(info, client, vllm026: bool):
    if not vllm026:
        from ckpt_vllm.trainer import CkptTrainerWeightTransferEngine

        return CkptTrainerWeightTransferEngine.trainer_init(info, client=client)
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ckpt_vllm.plugin import register_trainer

    assert register_trainer(), "the ckpt trainer engine did not register with vLLM 0.26's factory"
    return WeightTransferTrainerFactory.trainer_init("ckpt", None, info, client=client, source=None)


class ListSource:
    """vLLM's ``WeightSource`` by shape: ``metadata()`` and a fresh pass per iteration;
    ``held``: the names this rank holds (None: all)."""

    def __init__(self, tensors: dict, held=None):
        self.tensors, self.held = tensors, held

    def metadata(self):
        from types import SimpleNamespace

        return [SimpleNamespace(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.tensors.items()]

    def held_names(self):
        return self.held

    def __iter__(self):
        for name, t in self.tensors.items():
            yield name, (t if self.held is None or name in self.held else None)


def weights_of(seed: int) -> dict:
    """The trainer's weights at a step: the same on every rank (replicas), fresh per step."""
    return fresh_tensors(SHAPES, torch.Generator().manual_seed(seed))


def _source(spec: dict, rank: int):
    tensors = weights_of(spec["seed"])
    bad = spec.get("bad_on_rank")
    if bad == rank:   # this rank's source hands over something that is no tensor, where it registers
        tensors = dict(tensors, **{sorted(tensors)[rank]: "not a tensor"})   # (round robin over sorted names)
    if spec.get("strided_on_rank") == rank:   # the same values, not contiguous, where this rank registers
        name = sorted(tensors)[rank]
        tensors = dict(tensors, **{name: tensors[name].t().contiguous().t()})
    kind = spec.get("kind", "named")
    if kind == "named":
        return tensors
    held = spec.get("held", {}).get(rank)
    return ListSource(tensors, None if held is None else set(held))


def trainer_rank_main(rank: int, world: int, port: int, address, rounds: list, out, timeout_s: float,
                      vllm026: bool = False, info_kwargs: dict | None = None) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    if vllm026:
        sys.path.insert(0, str(FAKE_VLLM026))
    from ckpt_vllm.trainer import CkptTrainerInitInfo

    results = []
    try:
        client = (OldSyncClient if vllm026 else FakeSyncClient)(address)
        info = CkptTrainerInitInfo(rank=rank, world_size=world, device="cpu", master_addr="127.0.0.1",
                                   master_port=port, timeout_s=timeout_s, **(info_kwargs or {}))
        engine = _trainer_engine(info, client, vllm026)
        for step, spec in rounds:
            client.fail = spec.get("client_fails") if rank == 0 else None
            t0 = time.monotonic()
            try:
                result = engine.send_weights(_source(spec, rank))
                results.append({"ok": True, "bytes": result["bytes"], "name": result["name"],
                                "registered": engine.ps.last_register["bytes"], "seconds": time.monotonic() - t0,
                                "on_device": engine.ps.last_register["on_device"]})
            except Exception as exc:   # noqa: BLE001 - the test checks every rank's type and message
                results.append({"ok": False, "error": type(exc).__name__, "message": str(exc),
                                "seconds": time.monotonic() - t0})
        results.append({"calls": client.calls, "bases": [f"{c.__module__}.{c.__name__}" for c in type(engine).__mro__]})
        engine.shutdown()
    except Exception:   # noqa: BLE001
        results.append({"fatal": traceback.format_exc()})
    out.put((rank, results))


def run_trainer_world(world: int, address, rounds: list, *, timeout_s: float = 30, timeout: float = 180,
                      vllm026: bool = False, info: dict | None = None) -> dict:
    """Every rank's results: one per round, then ``{"calls", "bases"}`` (the engine's classes); ``vllm026``:
    the ranks meet vLLM 0.26's trainer API (tests/fakes/vllm026) and its version-less client; ``info``: more
    ``CkptTrainerInitInfo`` fields (e.g. ``on_device``)."""
    def ranks(port: int):
        q = CTX.Queue()
        return [CTX.Process(target=trainer_rank_main, args=(r, world, port, address, rounds, q, timeout_s, vllm026,
                                                            info), daemon=True) for r in range(world)], q

    got = run_world(ranks, "trainer world", timeout)
    for rank, results in got.items():
        assert "fatal" not in results[-1], f"trainer rank {rank} failed:\n{results[-1]['fatal']}"
    return got


def want(seed: int) -> dict[str, str]:
    return {n: digest(t) for n, t in weights_of(seed).items()}
