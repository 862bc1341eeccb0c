"""Steps run inside PS processes (``PsWorld``'s ``call`` command) for the P2P exposure and
lifecycle tests, and the foreign Mooncake peer that tries to read and write a PS's memory."""

from __future__ import annotations

import torch

from ckpt_core.ops.sockets import listening_sockets
from support.data import fresh_tensors, want_digests
from support.engine import make_req_func


def memory_view(ps, rank, name):
    """What a foreign peer would aim at: this rank's store address, the host regions of checkpoint
    ``name``, what the store registered, and the sockets this process listens on."""
    st = ps._p2p.store
    regions = [(r.tensor.data_ptr(), r.nbytes) for r in ps._catalog.checkpoints[name].regions.values() if r.nbytes]
    return {"address": None if st is None else st.address, "regions": regions,
            "registered": [] if st is None else sorted(st.registered.items()), "listening": listening_sockets()}


def close_and_listen(ps, rank):
    """close(); the sockets this process listened on before and after, and the port to reuse."""
    before = listening_sockets()
    ps.close()
    return {"before": before, "after_close": listening_sockets(), "port": ps.settings.master_port}


def reopen_and_update(ps, rank, address, seed):
    """After ``close_and_listen`` on every rank: a new ParameterServer on the same MASTER_PORT registers
    fresh tensors and updates the engine at ``address`` (rank 0 posts), then closes too. Reports the
    listening sockets at the end and the digests the engine must hold."""
    from ckpt_core import ParameterServer
    again = ParameterServer(rank, ps.world_size, device=ps.backend.kind, master_addr="127.0.0.1",
                            master_port=ps.settings.master_port)
    try:
        data = fresh_tensors({f"again{rank}.{i}": ((512,), torch.float32) for i in range(3)},
                             torch.Generator().manual_seed(seed + rank))
        again.register_checkpoint("again", named_tensors=data)
        again.gather_metas("again")
        again.update("again", make_req_func(address) if rank == 0 else (lambda h: None), timeout=60)
        during = listening_sockets()
    finally:
        again.close()
    return {"during": during, "after_second_close": listening_sockets(), "want": want_digests(data)}


class ForeignPeer:
    """A TransferEngine of nobody's world (another loopback address), aiming at a PS's memory."""

    def __init__(self, host: str = "127.0.0.4", nbytes: int = 4096):
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        assert self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
        self.gen = torch.Generator().manual_seed(66)
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        assert self.engine.register_memory(self.buf.data_ptr(), nbytes) == 0

    def read(self, address: str, remote: int, n: int) -> int:
        return self.engine.batch_transfer_sync_read(address, [self.buf.data_ptr()], [remote], [n])

    def write(self, address: str, remote: int, n: int) -> int:
        """Write fresh random bytes (never what a read just fetched) to ``remote``."""
        self.buf.copy_(torch.randint(1, 256, self.buf.shape, dtype=torch.uint8, generator=self.gen))
        return self.engine.batch_transfer_sync_write(address, [self.buf.data_ptr()], [remote], [n])

    def close(self) -> None:
        self.engine.unregister_memory(self.buf.data_ptr())
        self.engine = None
