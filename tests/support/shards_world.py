"""Trainer worlds for the sharded-registration tests: real torch FSDP2 (and tensor parallelism) on gloo,
with the parameter server inside each trainer process (``ParameterServer(auto_pg=False)`` in the
trainer's default group, as colocated RL runs it), pushing into real engine-worker processes.

``trainer_main`` runs one rank: build a small causal-LM-shaped model with dimensions that do not
divide by the world (uneven shards, an empty one), shard it, train a step on random data, note the
digest of every ``full_tensor()`` (computed before anything is registered), then, with
``DTensor.full_tensor`` and ``DTensor.redistribute`` patched to raise, register the sharded state
dict, gather and update; repeat for ``steps`` steps.
"""

from __future__ import annotations

import os
import traceback

import torch

from support.data import digest
from support.engine import make_req_func
from support.procs import CTX, run_world

VOCAB, HIDDEN, INNER = 37, 24, 42   # 37 rows over 2 or 3 ranks, 42 over (2 x 2): never all even


class TinyLM(torch.nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 2)   # 2 rows: over 3 ranks one shard is empty

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, INNER)
        self.down = torch.nn.Linear(INNER, HIDDEN)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def build(world: int, tp: int, kind: str = "cpu"):
    """The model on a (dp,) or (dp, tp) mesh: column-wise ``up``, row-wise ``down`` under TP, then FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)                      # the same initial weights on every rank
    model = TinyLM().to("cuda" if kind == "cuda" else "cpu")
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(kind, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        plan = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh["dp"]
    else:
        dp = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    for b in model.blocks:
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def train_step(model, dp_rank: int, step: int, lr: float = 0.5) -> None:
    # fresh data per data-parallel rank and step (the ranks of one TP group see the same batch)
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, VOCAB, (4, 8), generator=gen).to(model.embed.weight.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


class NoGather:
    """``DTensor.full_tensor`` and ``redistribute`` raise while it is entered: the proof that nothing gathers."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor
        self.saved = DTensor.full_tensor, DTensor.redistribute

        def refuse(*a, **k):
            raise AssertionError("the parameter server gathered a DTensor (full_tensor/redistribute called)")
        DTensor.full_tensor = DTensor.redistribute = refuse
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor
        DTensor.full_tensor, DTensor.redistribute = self.saved


def local_bytes(state: dict) -> int:
    """Bytes of the local shards this rank holds (replicas included)."""
    return sum(t.to_local().numel() * t.element_size() for t in state.values())


def trainer_main(rank: int, world: int, port: int, tp: int, steps: int, address, out, kind: str = "cpu",
                 delta: bool = False) -> None:
    """``delta``: each step after the first is a bf16 snapshot registered with the previous one as its base and
    updated as a delta (small steps: sparse changes); the engines must apply deltas (``delta_world.DeltaEngine``)."""
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    results: list = []
    try:
        if kind == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world)
        from ckpt_core import ParameterServer
        model = build(world, tp, kind)
        ps = ParameterServer(device=kind, auto_pg=False)
        for step in range(steps):
            train_step(model, rank // tp, step, lr=1e-3 if delta else 0.5)
            state = model.state_dict()
            if delta:   # what an engine is sent: bf16 (elementwise on the local shards, no gather)
                state = {n: t.to(torch.bfloat16) for n, t in state.items()}
            want = {n: digest(t.full_tensor()) for n, t in state.items()}   # before the PS sees a byte
            name = f"step-{step}"
            base = f"step-{step - 1}" if delta and step else None
            behaviors = {i: {"version": name} for i in range(world)} if delta else None
            req = make_req_func(address, behaviors) if rank == 0 else (lambda h: None)
            with NoGather():
                ps.register_checkpoint(name, named_tensors=state, base=base)
                ps.gather_metas(name)
                res = ps.update(name, req, timeout=60, delta=base is not None)
            if step > (1 if delta else 0):   # a delta's base stays registered until the next version's
                ps.unregister_checkpoint(f"step-{step - (2 if delta else 1)}")
            results.append({"want": want, "registered": ps.last_register["bytes"], "local": local_bytes(state),
                            "placements": {n: [f"{type(p).__name__}({getattr(p, 'dim', '')})" for p in t.placements]
                                           for n, t in state.items()},
                            "plans": len(ps._catalog.plans._plans), "buckets": res["buckets"], "bytes": res["bytes"],
                            "delta": res.get("delta")})
        ps.close()
        dist.destroy_process_group()
    except Exception:
        results.append(("fatal", traceback.format_exc()))
    out.put((rank, results))


def run_trainers(world: int, address, *, tp: int = 1, steps: int = 2, timeout: float = 240,
                 kind: str = "cpu", delta: bool = False) -> dict[int, list]:
    def ranks(port: int):
        q = CTX.Queue()
        return [CTX.Process(target=trainer_main, args=(r, world, port, tp, steps, address, q, kind, delta), daemon=True)
                for r in range(world)], q

    return run_world(ranks, "trainer world", timeout)


# ---------------------------------------------------------------- helpers run inside PsWorld ranks ("call")
def register_dtensor(ps, rank: int, name: str, placement: str) -> dict:
    """Register a DTensor of the given placement on a 1-D mesh over the PS's own world; report the
    outcome and what is registered afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    mesh = init_device_mesh("cpu", (ps.world_size,))
    p = {"partial": Partial(), "replicate": Replicate(), "shard": Shard(0)}[placement]
    local = torch.full((3, 4), float(rank + 1))
    t = DTensor.from_local(local, mesh, [p], run_check=False)
    try:
        ps.register_checkpoint(name, named_tensors={"w": t, "plain": torch.ones(2) * rank} if rank == 0 else {"w": t})
        return {"ok": True, "checkpoints": ps.checkpoints(), "bytes": ps.last_register["bytes"]}
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc), "checkpoints": ps.checkpoints()}
