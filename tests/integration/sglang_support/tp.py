"""Tensor parallelism for the CPU SGLang stand-in (``engine.py --tp-size N``): one process per TP rank.

Every rank builds SGLang's own parallel state (``init_distributed_environment`` and
``initialize_model_parallel`` over gloo, SGLang's real ``GroupCoordinator``s), its
``SchedulerWeightUpdaterManager``, model-runner ``WeightUpdater`` and its TP shard of the real
``Qwen2ForCausalLM``. Rank 0 also runs the HTTP app. As in SGLang's scheduler, the rank-0 scheduler
broadcasts each request it takes to the other TP ranks over the TP group's CPU group (SGLang's own
``broadcast_pyobj``), every rank runs it in turn, and only rank 0's result answers the route (SGLang's
tokenizer hears from the rank-0 scheduler alone). Test-only calls (``ckpt_test_*``: digests, a cold
load, fault injection) travel the same way; their per-rank results come back to rank 0 as JSON
gathered over the same group.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Callable

log = logging.getLogger("sglang_support.tp")
TEST_OP = "ckpt_test_"


def cpu_model_parallel() -> None:
    """SGLang takes this CUDA build of torch for a CUDA machine and gives its groups pynccl and custom
    all-reduce communicators; the CPU machine has no GPU, so its groups are gloo only."""
    import sglang.srt.distributed.parallel_state as ps

    real = ps.init_model_parallel_group

    def gloo_only(*args, **kwargs):
        kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                      use_torch_symm_mem_allreduce=False)
        return real(*args, **kwargs)

    ps.init_model_parallel_group = gloo_only


def gather_json(value: Any, size: int, group) -> list:
    """Every rank's JSON-able ``value``, in rank order, on every rank (gloo all-gather of its bytes)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(value).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(bufs, mine, group=group)
    return [json.loads(bytes(b[:int(n)].numpy())) for b, n in zip(bufs, sizes)]


class FanOut:
    """Runs each scheduler call on every TP rank: rank 0 calls :meth:`call`, the others :meth:`serve`."""

    def __init__(self, handlers: dict[str, Callable[[Any], Any]]):
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        self.rank, self.size, self.group = group.rank_in_group, group.world_size, group.cpu_group
        self.handlers = handlers

    def call(self, name: str, arg: Any = None) -> Any:
        """Rank 0, in the scheduler's turn: every rank runs ``name``; rank 0's result (for ``ckpt_test_*``
        calls, every rank's, in rank order)."""
        if self.size > 1:
            from sglang.srt.utils import broadcast_pyobj

            broadcast_pyobj([(name, arg)], self.rank, self.group, src=0)
        return self._run(name, arg)

    def serve(self) -> None:
        """Ranks 1..: take the calls rank 0 broadcasts, one at a time, until the process ends."""
        from sglang.srt.utils import broadcast_pyobj

        while True:
            for name, arg in broadcast_pyobj([], self.rank, self.group, src=0):
                self._run(name, arg)

    def _run(self, name: str, arg: Any) -> Any:
        if not name.startswith(TEST_OP):
            return self.handlers[name](arg)   # SGLang's own methods: they answer their failures
        try:
            value = self.handlers[name](arg)
        except Exception as exc:   # noqa: BLE001 - every rank must still reach the gather
            log.error("%s failed on TP rank %d:\n%s", name, self.rank, traceback.format_exc())
            value = {"error": f"{type(exc).__name__}: {exc}"}
        return [value] if self.size == 1 else gather_json(value, self.size, self.group)
